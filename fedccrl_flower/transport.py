"""Moving one phase's messages over the Grid: pushed, then their replies pulled until every one is in or the phase's
timeout has passed (what Flower's `Grid.send_and_receive` does, here with the replies kept as they arrive).

`exchange` returns each node's reply, the nodes that gave none (reason `timeout`) and how long the exchange took;
`PhaseTimer` runs a phase's exchange with the phase's timeout (`reply_timeout`) and counts its bytes on the wire. The
replies that arrived are in the caller's `got` as they arrive, so that an exchange interrupted mid-way (a stop, a
crash) leaves the caller what came in: under train.privacy, the uploads of a query that must be charged.
A node that leaves the SuperLink is answered for by Flower itself: the SuperLink replies with an error
(NODE_UNAVAILABLE once its heartbeat expired, MESSAGE_UNAVAILABLE once it was removed), which `error_reason`
reads as `disconnected`; an error of the ClientApp itself is `error`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flwr.app import ConfigRecord, Message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedccrl_core.federation.round_privacy import ReleasedThenRefused
from fedccrl_flower import messages as M

if TYPE_CHECKING:
    from fedccrl_flower.spec import ServerSpec

GONE = (ErrorCode.NODE_UNAVAILABLE, ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE)


class RoundFailure(RuntimeError):
    """A round that cannot complete (too few clients); the run stops with this message."""


class TooFewClients(RoundFailure, ReleasedThenRefused):
    """Fewer than min_clients answered a query: the round fails, and the uploads that did arrive were released, so
    the round loop charges them (train.privacy)."""


class QueryInterrupted(ReleasedThenRefused):
    """The query was interrupted (a stop, a crash) after uploads arrived: the round loop charges them, then the run
    stops with the interruption itself (`__cause__`, re-raised by FlowerServer._run)."""


PULL_S = 1.0  # seconds between two pulls of an exchange's replies (Flower's send_and_receive: 3)


def exchange(
    grid: Grid,
    messages: list[Message],
    timeout: float,
    phase: str,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    got: dict[int, Message] | None = None,
):
    """Send `messages` and pull their replies every PULL_S seconds until each has one or `timeout` seconds have
    passed. Returns ({node: reply}, {node without a reply: ("timeout", detail)}, seconds the exchange took); `got`
    (the same dict as the first) is filled as the replies arrive."""
    got = {} if got is None else got
    t0 = clock()
    grid.push_messages(messages)
    node_of = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}  # set when pushed
    waiting = set(node_of)
    while waiting and clock() < t0 + timeout:
        for r in grid.pull_messages(sorted(waiting)):
            mid = r.metadata.reply_to_message_id
            if mid in waiting:
                waiting.discard(mid)
                got[node_of[mid]] = r
        if waiting:
            sleep(PULL_S)
    missing = {node_of[m]: ("timeout", f"no {phase} reply within {timeout:.1f}s") for m in waiting}
    return got, missing, clock() - t0


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


def phase_config(client_spec_json: str, rnd: int, cid: str | None = None) -> ConfigRecord:
    """The CONFIG record of a round's message: the client spec, the round and, to one client, its id."""
    cfg = ConfigRecord({M.F_SPEC: client_spec_json, M.F_ROUND: rnd})
    if cid is not None:
        cfg[M.F_CLIENT_ID] = cid
    return cfg


@dataclass(frozen=True)
class Exchanged:
    """One phase's exchange: each node's reply, the nodes without one ({node: (reason, detail)}), the timeout it
    waited and its bytes on the wire (Flower's serialized messages: the replies up, the messages down)."""

    replies: dict[int, Message]
    missing: dict[int, tuple[str, str]]
    timeout: float
    wire_up: int
    wire_down: int


class PhaseTimer:
    """A phase's exchanges over the Grid, each with the phase's timeout (`reply_timeout`), timed: an exchange that
    got every reply, none an error, sets the slowest time of its phase."""

    def __init__(
        self,
        spec: ServerSpec,
        log: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.spec, self.log, self.clock, self.sleep = spec, log, clock, sleep
        self.slowest: dict[str, float] = {}  # phase -> the slowest complete exchange so far (s)

    def reply_timeout(self, phase: str) -> float:
        """How long a phase ("query" | "train" | "evaluate") waits for its replies: the spec's fixed timeout until an
        exchange of that phase got every reply, then max(floor, factor x the slowest such exchange so far)."""
        s = self.spec
        if phase not in self.slowest:  # an evaluation is a forward pass: it waits as a query does
            return s.query_timeout_s if phase in ("query", "evaluate") else s.train_timeout_s
        return max(s.timeout_floor_s, s.timeout_factor * self.slowest[phase])

    def exchange(
        self, grid: Grid, rnd: int, msgs: list[Message], phase: str, got: dict[int, Message] | None = None
    ) -> Exchanged:
        """One phase's messages over the Grid (`exchange`: `got` fills as replies arrive)."""
        timeout = self.reply_timeout(phase)
        down = sum(M.content_nbytes(m.content) for m in msgs)
        replies, missing, elapsed = exchange(grid, msgs, timeout, phase, self.clock, self.sleep, got)
        if not missing and not any(r.has_error() for r in replies.values()):
            self.slowest[phase] = max(self.slowest.get(phase, 0.0), elapsed)
        self.log(f"round {rnd}: {phase} to {len(msgs)} node(s), {len(replies)} replied in {elapsed:.1f}s")
        up = sum(M.content_nbytes(r.content) for r in replies.values() if r.has_content())
        return Exchanged(replies, missing, timeout, up, down)
