"""Reading the clients' replies, and the ledger of the replies a round refused and the clients it dropped.

Every reply is checked before use: a query reply's n_i and upload (FedCCRL: F_i, Eq. 8), a train reply's
client id, n_i (Eq. 2), weights (the global weights' keys/shapes/dtypes, finite floats), metrics and upload.
A reply that fails is refused (logged, in the round's record), never aggregated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from fedccrl_core.algorithms.base import Reply
from fedccrl_core.federation.round_privacy import released_sizes
from fedccrl_core.federation.round_record import ClientDropped, ClientRefused
from fedccrl_core.foundation import contract
from fedccrl_flower import messages as M
from fedccrl_flower.transport import error_reason

T = TypeVar("T")
BAD_REPLY = (M.MalformedUpdate, KeyError, TypeError, ValueError)  # what a malformed reply raises while read


class SiteRefusal(Exception):
    """A QUERY reply in which a site refuses: the run, its data not fitting the federation's (its own check, at the
    site: classes, image size, domain, held-out domain; `n` None), or the round's statistics release, its size having
    changed so that it would release at a larger ratio than the pre-round check charged (privacy/charged.py; `n`: the
    n_i it holds now). `client`: the site's client id; the message: its reason. Either way it released nothing."""

    def __init__(self, client: str, reason: str, n: int | None = None):
        super().__init__(reason)
        self.client, self.n = client, n


@dataclass(frozen=True)
class Unusable:
    """A reply that cannot be used, and why: `kind` "error" (an error reply: `reason` is transport.py error_reason's,
    "disconnected" when its node is gone, "error" when its ClientApp raised), "refusal" (the site refuses: `client`
    names it, `n` its n_i now when it refuses a round's release: SiteRefusal) or "malformed" (reading it raised a
    BAD_REPLY); `detail` the message."""

    kind: str
    reason: str
    detail: str
    client: str | None = None
    n: int | None = None


def triage(replies: dict[int, Message], read: Callable[[int, Message], T]) -> Iterator[tuple[int, T | Unusable]]:
    """Each reply of an exchange ({node: reply}), in node order, with what `read(node, reply)` makes of it, or why it
    cannot be used (`Unusable`): the one sorting of replies that every phase of a run (query, evaluate) and the
    evaluation-only run (site_evaluation.py) share; each decides what an unusable reply costs the site."""
    for node, r in sorted(replies.items()):
        got: T | Unusable
        if r.has_error():
            got = Unusable("error", *error_reason(r))
        else:
            try:
                got = read(node, r)
            except SiteRefusal as e:
                got = Unusable("refusal", "refusal", str(e), e.client, e.n)
            except BAD_REPLY as e:
                got = Unusable("malformed", "malformed", str(e))
        yield node, got


def read_query_reply(r: Message) -> tuple[str, int, dict[str, np.ndarray] | None]:
    """(client id, n_i, upload) of a QUERY reply (Algorithm 1 lines 3-6); n_i = 0 from an evaluation-only site.
    SiteRefusal when the site refuses, naming itself, its reason and, for a round's release, its n_i now."""
    info = M.record(r.content, M.INFO, ConfigRecord)
    if M.F_REFUSAL in info:
        now = info.get(M.F_N)
        if now is not None and (isinstance(now, bool) or not isinstance(now, int) or now < 1):
            raise M.MalformedUpdate(f"a refusal's n_i = {now!r} is not a positive integer")
        raise SiteRefusal(str(info[M.F_CLIENT_ID]), str(info[M.F_REFUSAL]), now)
    cid, n = str(info[M.F_CLIENT_ID]), int(info[M.F_N])  # type: ignore[arg-type]  # a list or bytes: TypeError, a BAD_REPLY
    if n < 0:  # 0: an evaluation-only site (the server checks that it is one)
        raise M.MalformedUpdate(f"n_i = {n}")
    upload = (
        M.record_to_arrays(M.record(r.content, M.UPLOAD, ArrayRecord), f"upload of {cid}")
        if M.UPLOAD in r.content
        else None
    )
    M.validate_upload(upload, f"upload of {cid}")
    return cid, n, upload


def query_releases(replies: dict[int, Message], sources: set[str]) -> list[dict[str, tuple[int, int]]]:
    """The statistics releases of a query's `replies` ({node: reply}), as the round loop's ReleasedThenRefused holds
    them: each {client: (n_i, k_i)} of the upload of a client of `sources` (the run's source clients); a client that
    answered from two nodes released twice (its second upload is the next release). An upload is a release whether or
    not the round then uses it."""
    out: list[dict[str, tuple[int, int]]] = []
    for _, got in triage(replies, lambda node, r: read_query_reply(r)):
        if isinstance(got, Unusable):  # an error reply has no content; a refusal, no upload
            continue
        cid, n, upload = got
        sizes = released_sizes({cid: upload}, {cid: n}) if n and cid in sources else {}
        if sizes:
            free = next((d for d in out if cid not in d), None)
            if free is None:
                out.append(free := {})
            free.update(sizes)
    return out


def read_train_reply(r: Message, cid: str, reference: dict[str, torch.Tensor], need_train_acc: bool):
    """(n_i, weights, metrics, upload) of `cid`'s TRAIN reply (lines 8-22), its weights checked against the
    global weights `reference`."""
    info = M.record(r.content, M.INFO, ConfigRecord)
    n = info[M.F_N]
    if str(info[M.F_CLIENT_ID]) != cid:
        raise M.MalformedUpdate(f"answers as {info[M.F_CLIENT_ID]!s}, expected {cid}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:  # the algorithm's n_i (Eq. 2)
        raise M.MalformedUpdate(f"n_i = {n!r} is not a positive integer")
    arrays = M.record_to_arrays(M.record(r.content, M.WEIGHTS, ArrayRecord), f"weights of {cid}")
    weights = M.validate_weights(arrays, reference, f"weights of {cid}")
    metrics = M.metrics_from_record(M.record(r.content, M.METRICS, MetricRecord), f"metrics of {cid}")
    if need_train_acc and contract.TRAIN_ACC not in metrics:  # train.privacy: no metrics are sent
        raise M.MalformedUpdate(f"metrics of {cid} lack {contract.TRAIN_ACC}")
    upload = (
        M.record_to_arrays(M.record(r.content, M.UPLOAD, ArrayRecord), f"train upload of {cid}")
        if M.UPLOAD in r.content
        else None
    )
    M.validate_upload(upload, f"train upload of {cid}")
    return n, weights, metrics, upload


def matching_train_uploads(rnd: int, valid: list[Reply], ledger: Ledger) -> list[Reply]:
    """The replies whose train upload fits the others': uploads are summed element-wise, so keys, dtypes and
    full shapes must agree (the most common signature wins); a misfit is refused."""
    sigs = {
        r.client_id: None
        if r.upload is None
        else tuple(sorted((k, str(v.dtype), tuple(v.shape)) for k, v in r.upload.items()))
        for r in valid
    }
    consensus = M.consensus_signature(sigs)
    for r in valid:
        if sigs[r.client_id] != consensus:
            ledger.refuse(rnd, r.client_id, f"train upload {sigs[r.client_id]} does not match the others' {consensus}")
    return [r for r in valid if sigs[r.client_id] == consensus]


class Ledger:
    """The replies refused and the clients dropped, per round: in the round's record, the log and the result."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self._refused: dict[int, list[ClientRefused]] = {}  # per round: replies that arrived malformed
        self._dropped: dict[
            int, list[ClientDropped]
        ] = {}  # per round: clients that did not answer, were unavailable or raised

    def refuse(self, rnd: int, who: str, reason: str) -> None:
        """A reply that arrived but cannot be used (malformed arrays, wrong client, ...)."""
        self._refused.setdefault(rnd, []).append(ClientRefused(client=who, reason=reason))
        self.log(f"round {rnd}: REFUSED reply of {who}: {reason}")

    def drop(self, rnd: int, client: str | None, node: int, phase: str, reason: str, detail: str) -> None:
        """One client dropped from round `rnd`: in the round's record (`dropped_clients`) and the log."""
        self._dropped.setdefault(rnd, []).append(
            ClientDropped(client=client, node=node, phase=phase, reason=reason, detail=detail)
        )
        self.log(
            f"round {rnd}: {client or 'unknown client'} (node {node}) dropped in the {phase} phase: {reason} ({detail})"
        )

    def dropped_in(self, rnd: int) -> set[str]:
        """The clients dropped from round `rnd` (a node that never said which client it serves names none)."""
        return {d.client for d in self._dropped.get(rnd, []) if d.client is not None}

    def dropped_text(self, rnd: int) -> str:
        return (
            "; ".join(
                f"{d.client or 'node ' + str(d.node)}: {d.reason} in {d.phase} ({d.detail})"
                for d in self._dropped.get(rnd, [])
            )
            or "none"
        )

    def record(self, rnd: int) -> dict:
        """The round record's counts and lists (`refused`, `dropped`, `dropped_clients`, `refused_clients`)."""
        drops = [d.to_dict() for d in self._dropped.get(rnd, [])]
        refusals = [r.to_dict() for r in self._refused.get(rnd, [])]
        return {"refused": len(refusals), "dropped": len(drops), "dropped_clients": drops, "refused_clients": refusals}

    def result(self) -> dict[str, list[dict]]:
        """The run result's `refused` and `dropped` lists: every round's, each entry with its round."""
        return {
            "refused": [{"round": rnd, **r.to_dict()} for rnd, rs in self._refused.items() for r in rs],
            "dropped": [{"round": rnd, **d.to_dict()} for rnd, ds in self._dropped.items() for d in ds],
        }
