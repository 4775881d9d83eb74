"""The QUERY phase (Algorithm 1 lines 3-6 over Flower): every connected SuperNode answers with its client id, n_i and
its upload (FedCCRL: F_i, Eq. 8), and the replies are sorted into the round (`FlowerRound`).

Uploads are checked (replies.py) and must share one signature (keys, dtypes, row shapes); a misfit is refused, and
so is a client that is not a source of this run (`spec.sources`), so only those clients are sampled. A site of
`spec.evaluators` answers n = 0: it evaluates only. Under train.privacy.max_epsilon, a source whose size changed so
that it would release at a larger ratio than the pre-round check charged refuses the round's release (replies.py
SiteRefusal with its n_i now): refused in the ledger, and its n_i kept for the next round's check. One client id
answering from two nodes stops the run (`DuplicateClient`, naming both) before any upload is used; under
train.privacy both uploads are charged, and so are the uploads that arrived when the query is interrupted
(`QueryInterrupted`: a stop, a crash). A node without a reply is dropped (the ledger), unless its client answered
from a new node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from fedccrl_core.federation.round_privacy import ReleasedThenRefused
from fedccrl_flower import messages as M
from fedccrl_flower.flower_round import FlowerRound
from fedccrl_flower.replies import Ledger, Unusable, query_releases, read_query_reply, triage
from fedccrl_flower.spec import ServerSpec
from fedccrl_flower.transport import Exchanged, PhaseTimer, QueryInterrupted, RoundFailure, answered


class DuplicateClient(RoundFailure, ReleasedThenRefused):
    """One client id answered a query from two SuperNodes: refused before its uploads are used; both were
    released (each noised on its own node), so the round loop charges both (train.privacy)."""


def exchange_query(grid: Grid, timer: PhaseTimer, rnd: int, msgs: list[Message], sources: set[str]) -> Exchanged:
    """The QUERY messages over the Grid; interrupted (a stop, a crash) after uploads arrived, QueryInterrupted holds
    their releases, so that they are charged before the run stops."""
    got: dict[int, Message] = {}
    try:
        return timer.exchange(grid, rnd, msgs, "query", got)
    except BaseException as stop:  # the uploads that arrived were released: charged before the run stops
        released = query_releases(got, sources)
        if not released:
            raise
        raise QueryInterrupted(
            f"round {rnd}: the query was interrupted ({stop.__class__.__name__}) after "
            f"{sum(map(len, released))} upload(s) arrived",
            released,
        ) from stop


@dataclass
class _Sorted:
    """The query's replies sorted: the source clients' uploads and the evaluation-only sites' nodes."""

    uploads: dict[str, Any] = field(default_factory=dict)
    node_of: dict[str, int] = field(default_factory=dict)
    n_of: dict[str, int] = field(default_factory=dict)
    sigs: dict[str, Any] = field(default_factory=dict)
    eval_node_of: dict[str, int] = field(default_factory=dict)
    told_n: dict[str, int] = field(default_factory=dict)  # a source that refused the round's release: its n_i now
    twice: list[tuple[str, int, int]] = field(default_factory=list)  # (client, first node, second node)


def sort_query_replies(
    rnd: int,
    ex: Exchanged,
    spec: ServerSpec,
    client_of_node: dict[int, str],
    ledger: Ledger,
    log: Callable[[str], None],
    announced: dict[str, int | None],
) -> FlowerRound:
    """The round that the query's replies make: uploads keyed by client id (sorted); `client_of_node` (the last
    client id each node answered with) is updated. `announced`: the n_i the pre-round check read (known_n)."""
    released = query_releases(ex.replies, set(spec.sources))
    failed = dict(ex.missing)  # node -> (reason, detail)
    got = _sort(rnd, ex.replies, failed, spec, client_of_node, ledger, announced)
    if got.twice:
        raise DuplicateClient(
            f"round {rnd}: "
            + "; ".join(
                f"client {cid} answered the query from two SuperNodes, nodes {a} and {b}" for cid, a, b in got.twice
            )
            + f": one client id is one SuperNode (each would release its own noised upload every round); the run "
            f"stops before any upload is used. Give each SuperNode its own client id (node config "
            f"'{M.NODE_CLIENT_ID}')",
            released,
        )
    consensus = M.consensus_signature(got.sigs)
    for cid in sorted(got.uploads):
        if got.sigs[cid] is not None and got.sigs[cid] != consensus:
            ledger.refuse(rnd, cid, f"upload {got.sigs[cid]} does not match the other clients' {consensus}")
            for d in (got.uploads, got.node_of, got.n_of):
                d.pop(cid)
    came = answered(ex.replies)  # refused clients answered: refused, not dropped
    for node in sorted(failed):
        owner = client_of_node.get(node)
        if owner is not None and owner in came:  # a restarted client answered from its new node
            log(f"round {rnd}: stale node {node} of {owner} did not answer ({failed[node][0]})")
            continue
        ledger.drop(rnd, owner, node, "query", *failed[node])
    uploads = {cid: got.uploads[cid] for cid in sorted(got.uploads)}
    return FlowerRound(
        rnd,
        uploads,
        got.node_of,
        got.n_of,
        got.eval_node_of,
        released,
        ex.timeout,
        ex.wire_up,
        ex.wire_down,
        got.told_n,
    )


def _sort(
    rnd: int,
    replies: dict[int, Message],
    failed: dict[int, tuple[str, str]],
    spec: ServerSpec,
    client_of_node: dict[int, str],
    ledger: Ledger,
    announced: dict[str, int | None],
) -> _Sorted:
    """Each reply in node order: an error reply is a failed node; a refusal, a malformed reply, an n = 0 reply of
    a site that is not an evaluation site and a client that is not a source are refused; a client id seen from a
    second node is noted (`twice`)."""
    got = _Sorted()
    for node, reply in triage(replies, lambda n, r: read_query_reply(r)):
        who = f"node {node}" + (f" ({client_of_node[node]})" if node in client_of_node else "")
        if isinstance(reply, Unusable):
            if reply.kind == "error":
                failed[node] = (reply.reason, reply.detail)
            elif reply.kind == "refusal":  # the site's own check: named by its client id, with its reason
                _site_refused(rnd, str(reply.client), reply.detail, reply.n, spec, announced, got, ledger)
            else:
                ledger.refuse(rnd, who, f"malformed query reply: {reply.detail}")
            continue
        cid, n, upload = reply
        if n == 0:  # an evaluation-only site
            if cid not in spec.evaluators:
                ledger.refuse(rnd, who, f"client {cid} announces no training rows but is not an evaluation site")
            elif cid not in got.eval_node_of:
                client_of_node[node] = cid
                got.eval_node_of[cid] = node
            continue
        if cid not in spec.sources:  # e.g. a held-out domain's client that claims training rows
            ledger.refuse(
                rnd,
                who,
                f"client {cid} is not a source client of held-out {spec.held_out} "
                f"(it holds no training rows outside it)",
            )
            continue
        if cid in got.node_of:  # refused by the caller, before any upload is used
            got.twice.append((cid, got.node_of[cid], node))
            continue
        client_of_node[node] = cid
        got.uploads[cid], got.node_of[cid], got.n_of[cid], got.sigs[cid] = upload, node, n, M.upload_signature(upload)
    return got


def _site_refused(
    rnd: int,
    client: str,
    reason: str,
    n: int | None,
    spec: ServerSpec,
    announced: dict[str, int | None],
    got: _Sorted,
    ledger: Ledger,
) -> None:
    """A site's refusal in the ledger: of the run (its data does not fit), or of the round's statistics release (its
    size changed since it announced the one the pre-round check read), whose n_i now is kept (`told_n`) for the next
    round's check. Nothing of either was released, so nothing is charged."""
    if n is None:
        ledger.refuse(rnd, client, f"its data does not fit the run: {reason}")
        return
    before = announced.get(client)
    ledger.refuse(
        rnd,
        client,
        f"its size changed from the n = {before if before is not None else 'unknown'} the pre-round check read to "
        f"n = {n}: {reason}; it released nothing this round, and the next round's check charges n = {n}",
    )
    if client in spec.sources:
        got.told_n[client] = n
