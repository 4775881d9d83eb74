"""Moving one phase's messages over the Grid: Flower's `Grid.send_and_receive` with the phase's timeout.

`exchange` returns each node's reply, the nodes that gave none (reason `timeout`) and how long the exchange took.
A node that leaves the SuperLink is answered for by Flower itself: the SuperLink replies with an error
(NODE_UNAVAILABLE once its heartbeat expired, MESSAGE_UNAVAILABLE once it was removed), which `error_reason`
reads as `disconnected`; an error of the ClientApp itself is `error`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from flwr.app import Message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedccrl_flower import messages as M

GONE = (ErrorCode.NODE_UNAVAILABLE, ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE)


class RoundFailure(RuntimeError):
    """A round that cannot complete (too few clients); the run stops with this message."""


def exchange(
    grid: Grid, messages: list[Message], timeout: float, phase: str, clock: Callable[[], float] = time.monotonic
):
    """Send `messages` and wait up to `timeout` seconds for their replies (Grid.send_and_receive). Returns
    ({node: reply}, {node without a reply: ("timeout", detail)}, seconds the exchange took)."""
    t0 = clock()
    replies = list(grid.send_and_receive(messages, timeout=timeout))
    elapsed = clock() - t0
    node_of = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}  # set when pushed
    got = {node_of[r.metadata.reply_to_message_id]: r for r in replies if r.metadata.reply_to_message_id in node_of}
    missing = {n: ("timeout", f"no {phase} reply within {timeout:.1f}s") for n in node_of.values() if n not in got}
    return got, missing, elapsed


def error_reason(reply: Message) -> tuple[str, str]:
    """An error reply: the node is gone (Flower's NODE_UNAVAILABLE, ...: "disconnected") or its ClientApp
    raised ("error")."""
    e = reply.error
    return ("disconnected" if e.code in GONE else "error"), f"{e.reason} (code {e.code})"


def answered(replies: dict[int, Message]) -> set[str]:
    """Client ids that sent a query reply with content (well-formed or not)."""
    out = set()
    for r in replies.values():
        try:
            if r.has_content() and M.INFO in r.content:
                out.add(str(r.content[M.INFO][M.F_CLIENT_ID]))
        except (KeyError, TypeError):
            pass
    return out


def wait_for_nodes(
    grid: Grid,
    rnd: int,
    want: int,
    least: int,
    wait_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
):
    """The connected nodes once `want` are connected, or after `wait_s` seconds if at least `least` are
    (Flower's Grid has no wait with a deadline); RoundFailure otherwise."""
    deadline = clock() + wait_s
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= want or (clock() >= deadline and len(nodes) >= least):
            return nodes
        if clock() >= deadline:
            raise RoundFailure(
                f"round {rnd}: {len(nodes)} SuperNode(s) connected after {wait_s:.0f}s, fewer "
                f"than train.flower.min_clients = {least}"
            )
        sleep(1.0)
