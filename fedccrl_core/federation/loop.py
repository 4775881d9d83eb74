"""Algorithm 1's round loop, written once. The in-process engine (engine.py) and the Flower ServerApp
(fedccrl_flower/server_app.py) both drive `RoundLoop`; the `Transport` is their only difference.

Round t:
  lines 3-6   transport.collect_uploads(t)                 -> {client id: upload} of the clients that answered
  line  7     alg.server_payloads(uploads)                 (server half of the algorithm)
              sample_clients(ids, client_fraction, seed, t)
  lines 8-22  transport.train(t, sampled, global_w, payloads) -> replies in client-id order
  line  23    alg.aggregate(global_w, replies)             (Eq. 2 by default)
  then        evaluate (source validation and target), record, log (on_round), checkpoint

Every random draw is derived from (seed, round, client), and a checkpoint is written after every
round (federation/checkpoints.py), so a rerun resumes after the last complete round and ends with
the metrics of an uninterrupted run (on the CPU). Under train.privacy the noise and the privacy samples (the
clients of a round, Eq. 8's rows) come from the OS instead (privacy/noise.py): a DP run is not bit-reproducible.


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from fedccrl_core.algorithms.base import Aggregation, Algorithm, ListAggregation, Reply
from fedccrl_core.algorithms.fedccrl import StatisticsExchange
from fedccrl_core.federation.checkpoints import RoundCheckpoint, RoundCheckpoints, RoundState
from fedccrl_core.federation.round_record import RoundRecord, SpentRecord
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.seeding import derive_seed, numpy_rng, seed_everything
from fedccrl_core.learning.accuracy import accuracy, predict
from fedccrl_core.learning.clients import ClientData
from fedccrl_core.privacy.dp import DPFedAvgAggregation
from fedccrl_core.privacy.noise import private_rng
from fedccrl_core.privacy.settings import BudgetExhausted


def nbytes(obj) -> int:
    """Bytes of the arrays in a payload (weights dict, statistics dict, ...)."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def uncovered_release(alg: Algorithm) -> str:
    """What `alg` releases that train.privacy's mechanisms (privacy/dp.py) do not cover, read from which hooks it
    overrides ("" when none): an upload other than FedCCRL's statistics rows, an aggregation other than Eq. 2."""
    if type(alg).client_upload is not Algorithm.client_upload and not getattr(alg.Params, "uploads_statistics", False):
        return "uploads something other than FedCCRL's statistics rows (only those are clipped and noised)"
    if type(alg).aggregate is not Algorithm.aggregate or type(alg).after_aggregate is not Algorithm.after_aggregate:
        return "aggregates with a rule of its own, not Eq. 2 (DP-FedAvg replaces Eq. 2 only)"
    return ""


def privacy_of(alg: Algorithm):
    """train.privacy of this run (LocalConfig.privacy): a RunPrivacy, or None when off. Refuses, before any
    work, a setting under which something leaves the client that is neither noised nor counted: an upload the
    mechanisms of privacy/dp.py do not cover, a channel the algorithm releases with its mechanism switched off,
    an aggregation other than Eq. 2."""
    s = alg.local.privacy
    if s is None or not s.enabled:
        return None
    uploads = getattr(alg.Params, "uploads_statistics", False)
    if alg.Params.dp_refusal:  # params.yaml's validation refuses it first (pipeline cross_checks)
        raise ValueError(f"train.privacy.enabled: {alg.name}: {alg.Params.dp_refusal}")
    if uncovered_release(alg):
        raise ValueError(
            f"train.privacy.enabled: {alg.name} {uncovered_release(alg)}, and its Params declare no dp_refusal "
            "(fedccrl_core/foundation/hparams.py): declare why, so that params.yaml's validation refuses it"
        )
    for key, why in s.unprotected(alg.name, uploads):
        raise ValueError(f"{key}: {why}")
    from fedccrl_core.privacy.accountant import RunPrivacy  # dp_accounting, imported only when on

    return RunPrivacy(s, uploads)


def released_rows(uploads: dict) -> dict[str, int]:
    """{client: k_i}: the rows each statistics upload in `uploads` released."""
    rows = {cid: StatisticsExchange.upload_rows(u) for cid, u in uploads.items()}
    return {cid: k for cid, k in rows.items() if k is not None}


def released_sizes(uploads: dict, n_of: dict) -> dict[str, tuple[int, int]]:
    """{client: (n_i, k_i)}: the rows each statistics upload released out of the client's n_i (`n_of`: announced)."""
    return {cid: (int(n_of[cid]), k) for cid, k in released_rows(uploads).items()}


def upload_sizes(uploads: dict, transport) -> dict[str, tuple[int, int]]:
    """released_sizes with the n_i the transport announced."""
    rows = released_rows(uploads)
    return released_sizes(uploads, transport.announced_n(sorted(rows)) if rows else {})


class ReleasedThenRefused(RuntimeError):
    """A transport refuses a round after uploads already left the clients (Flower: one client id answering from two
    SuperNodes, each upload noised on its own). `released`: the statistics releases that happened, each
    {client: (n_i, k_i)} as upload_sizes gives them; the round loop charges every one (train.privacy) and stops."""

    def __init__(self, message: str, released: list[dict[str, tuple[int, int]]]):
        super().__init__(message)
        self.released = released


def sampled_count(clients: int, fraction: float) -> int:
    """m, the clients sampled out of N each round; `fraction` in (0, 1] (params.yaml's schema bounds it)."""
    return max(1, round(fraction * clients))


def sample_clients(
    client_ids: list[str], fraction: float, seed: int, rnd: int, rng: np.random.Generator | None = None
) -> list[str]:
    """m of the N clients without replacement, from the run seed, or from `rng` (train.privacy: the OS's)."""
    k = sampled_count(len(client_ids), fraction)
    if k == len(client_ids):
        return list(client_ids)
    idx = (rng or numpy_rng(seed, "sample", rnd)).choice(len(client_ids), size=k, replace=False)
    return [client_ids[i] for i in sorted(idx)]


@dataclass
class EvalSets:
    """Source validation (union of every client's val split) and the held-out target domain."""

    val_x: torch.Tensor
    val_y: torch.Tensor
    target_x: torch.Tensor
    target_y: torch.Tensor
    batch_size: int = 256

    @classmethod
    def for_target(cls, clients, target_x: np.ndarray, target_y, batch_size: int, device) -> EvalSets:
        """The evaluation sets of a held-out run: the concatenation of the clients' val splits (in their order),
        and the target's images (uint8 NHWC, as data/shards.py `load_domain_test` returns them) as NCHW uint8
        on `device`, its labels as int64 on `device`."""
        target = ClientData.from_numpy("target", "target", target_x, target_y, target_x[:0], target_y[:0], device)
        return cls(
            torch.cat([c.val_x for c in clients]),
            torch.cat([c.val_y for c in clients]),
            target.train_x,
            target.train_y,
            batch_size,
        )


@dataclass
class Evaluation:
    """One round's evaluation of the global model: what the round record gets, and what the collapse warning
    reads (`val_labels`: distinct true classes of the validation images, `val_n`: their number)."""

    val_acc: float
    target_acc: float
    val_pred_classes: int
    val_labels: int
    val_n: int
    record: dict = field(default_factory=dict)  # an evaluator's own fields (federated: who evaluated, counts)
    missing: tuple[str, ...] = ()  # sites that should have evaluated and did not: a partial evaluation

    def selection_score(self) -> float:
        """What best-val selection compares (DomainBed's training-domain validation): the validation accuracy of a
        complete evaluation; a partial one (`missing` sites) scores below every complete one, val_acc - 1.5 in
        [-1.5, -0.5], so it is chosen only while no complete round exists, and only over other partial ones."""
        return self.val_acc - 1.5 if self.missing else self.val_acc


class Evaluator(Protocol):
    """Evaluation somewhere else than in `EvalSets` on this machine (Flower: on the sites, fedccrl_flower/evalsets.py)."""

    def evaluate(self, rnd: int, global_w: dict) -> Evaluation:
        """The global weights `global_w` of round `rnd`, evaluated."""


@dataclass
class RunResult:
    history: list[RoundRecord]
    final_weights: dict
    best_weights: dict
    best_round: int
    resumed_from: int = 0
    extra: dict = field(default_factory=dict)


def weighted_mean(replies: list[Reply], key: str) -> float | None:
    vals = [(r.metrics[key], r.n) for r in replies if key in r.metrics]
    if not vals:
        return None
    return sum(v * n for v, n in vals) / sum(n for _, n in vals)


class Transport(Protocol):
    """How uploads, payloads, weights and replies move between the server and the clients."""

    def collect_uploads(self, rnd: int) -> dict[str, Any]:
        """Lines 3-6: the upload (or None) of every client that takes part, keyed by client id, sorted."""

    def announced_n(self, sampled: list[str]) -> dict[str, int]:
        """n_i of each sampled client as its reply will state it (Algorithm.sample_count)."""

    def known_n(self) -> dict[str, int | None]:
        """Every client that may upload in the coming round, with its n_i when known before the round's uploads,
        else None (in-process: all known; Flower: every source client, known if it answered the previous query)."""

    def least_clients(self) -> int:
        """The fewest answering clients with which a round goes on (in-process: all; Flower: min_clients)."""

    def train(
        self, rnd: int, sampled: list[str], global_w: dict, payloads: dict, fold: Callable[[Reply], None]
    ) -> list[Reply]:
        """Lines 8-22 on the sampled clients: `fold(reply)` for each valid reply in client-id order, as
        it arrives; returns the replies with their weights dropped (n_i and metrics for the record)."""

    def round_record(self, rnd: int) -> dict:
        """Fields this transport adds to the round's record (wire bytes, dropped clients, ...)."""

    def client_states(self) -> dict[str, dict]:
        """States of the clients trained this round that the server checkpoints (in-process only)."""

    def restore(self, checkpoints: RoundCheckpoints | None, ck: RoundCheckpoint | None) -> None:
        """Where the clients' states come from after a resume (in-process: the state files)."""


class RoundLoop:
    def __init__(
        self,
        algorithm: Algorithm,
        model: torch.nn.Module,
        transport: Transport,
        evalsets: EvalSets | Evaluator,
        rounds: int,
        seed: int,
        client_fraction: float = 1.0,
        checkpoints: RoundCheckpoints | None = None,
        on_round: Callable[[RoundRecord | SpentRecord], None] | None = None,
        run_info: dict | None = None,
        log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
        engine: str = "inprocess",
    ):
        self.alg, self.model, self.transport, self.evalsets = algorithm, model, transport, evalsets
        self.rounds, self.seed, self.client_fraction = rounds, seed, client_fraction
        self.checkpoints, self.on_round = checkpoints, on_round or (lambda rec: None)
        self.run_info, self.log, self.engine = dict(run_info or {}), log, engine
        self.privacy = privacy_of(algorithm)  # train.privacy: None when off (the paper's protocol)
        if self.privacy is not None:
            self.log(f"train.privacy: noise from {self.privacy.s.noise_source()}")

    def planned_round(self) -> tuple[dict[str, tuple[int, int]], int, int]:
        """RunPrivacy.before_round's (sizes, N, m) for the coming round, its worst case over who may answer
        (Transport.known_n, least_clients). sizes: {client: (n_i, k_i)} of the statistics uploads from the sizes the
        clients announced; a client whose size is not known yet (it joins late) as (1, 1), every row released (the
        largest sampling ratio: Gaussian(z_s) unsampled); {} when the algorithm uploads no statistics. (N, m): the
        number of answering clients between least_clients and all of them whose sample m = sampled_count(N) has
        the largest ratio m / N (a sampled Gaussian's RDP grows with it)."""
        known = self.transport.known_n()
        sizes: dict[str, tuple[int, int]] = {}
        if self.privacy.uploads:
            assert isinstance(self.alg, StatisticsExchange)  # the algorithms whose uploads are statistics
            sizes = {cid: (1, 1) if n is None else (n, self.alg.released_rows(n)) for cid, n in known.items()}
        if not known:
            return sizes, 0, 0
        least = max(1, min(self.transport.least_clients(), len(known)))
        pairs = [(c, sampled_count(c, self.client_fraction)) for c in range(least, len(known) + 1)]
        clients, sampled = max(pairs, key=lambda cm: (cm[1] / cm[0], cm[0]))
        return sizes, clients, sampled

    def _accept(self, ck: RoundCheckpoint) -> str | None:
        if ck.run_info != self.run_info:
            return "belongs to another configuration"
        own = self.model.state_dict()
        g = ck.global_weights
        if set(g) != set(own) or any(g[k].shape != own[k].shape for k in own):
            return "does not fit this model"
        return None

    def evaluate(self, rnd: int, global_w: dict) -> Evaluation:
        """Source-validation and target accuracy of the global model (loaded in self.model): here, on `EvalSets`,
        or by an `Evaluator` (federated: Σ correct / Σ n of the sites' counts, the same number)."""
        ev, local = self.evalsets, self.alg.local
        if not isinstance(ev, EvalSets):
            return ev.evaluate(rnd, global_w)
        if len(ev.val_y):
            pred = predict(self.model, ev.val_x, ev.batch_size, local.mean, local.std, local.fast)
            val, val_classes = float((pred == ev.val_y).float().mean()), int(torch.unique(pred).numel())
        else:
            val, val_classes = float("nan"), 0
        tgt = accuracy(self.model, ev.target_x, ev.target_y, ev.batch_size, local.mean, local.std, fast=local.fast)
        return Evaluation(val, tgt, val_classes, int(torch.unique(ev.val_y).numel()), len(ev.val_y))

    def _warn_if_collapsed(self, rnd: int, ev: Evaluation) -> None:
        """A global model that predicts one class for every validation image has collapsed (seen on PACS from
        scratch): say so, instead of reporting a class share as accuracy in silence."""
        if ev.val_pred_classes == 1 and ev.val_labels > 1:
            self.log(
                f"warning: round {rnd}: the global model predicts a single class for all "
                f"{ev.val_n} validation images (collapsed); its accuracy is that class's share"
            )

    def run(self) -> RunResult:
        seed_everything(derive_seed(self.seed, "init"))
        global_w = {k: v.detach().clone() for k, v in self.model.state_dict().items()}  # line 1
        history: list[RoundRecord] = []
        best_w, best_round, best_val, start = global_w, 0, -2.0, 1  # below every selection_score
        ck = self.checkpoints.load(self._accept) if self.checkpoints is not None else None
        if ck is not None:
            global_w, best_w, best_round, best_val = ck.global_weights, ck.best, ck.best_round, ck.best_val
            history, start = list(ck.history), ck.round + 1
            self.alg.load_server_state(ck.server_state)
            self.log(f"resuming from checkpoint after round {ck.round}")
        if self.privacy is not None:
            self._resume_ledger(ck)
        self.transport.restore(self.checkpoints, ck)
        w_bytes = nbytes(global_w)
        for rnd in range(start, self.rounds + 1):  # line 2
            t0 = time.perf_counter()
            try:
                if self.privacy is not None:  # both of the round's events, before its first release
                    self.privacy.before_round(rnd, *self.planned_round())
                uploads = self._collect_uploads(rnd, history)  # lines 3-6
                private = self.privacy is not None
                sampled = sample_clients(
                    list(uploads),
                    self.client_fraction,
                    self.seed,
                    rnd,
                    private_rng(self.privacy.s, "sample", rnd) if private else None,
                )
                if private:
                    self.privacy.statistics(rnd, upload_sizes(uploads, self.transport))
                    self.privacy.before_weights(rnd, len(uploads), len(sampled))
            except BudgetExhausted as stop:
                self.log(str(stop))
                self._report_spent(rnd, history)
                if not history:
                    raise ValueError(f"{stop}: no round completed") from None
                break
            payloads = self.alg.server_payloads(uploads)  # line 7
            agg: DPFedAvgAggregation | Aggregation | ListAggregation
            if self.privacy is not None:  # DP-FedAvg (privacy/dp.py)
                agg = DPFedAvgAggregation(
                    global_w, len(sampled), self.privacy.s, private_rng(self.privacy.s, "weights", rnd)
                )
            else:
                agg = self.alg.aggregation(global_w, float(sum(self.transport.announced_n(sampled).values())))
            try:
                replies = self.transport.train(rnd, sampled, global_w, payloads, agg.add)  # lines 8-22
            except BaseException:  # the round's statistics were charged: the last dp_epsilon logged says so
                self._report_spent(rnd, history)
                raise
            global_w = agg.result()  # line 23, Eq. 2, streamed
            if self.privacy is not None:
                self.privacy.weights(rnd, len(uploads), len(sampled))
            self.model.load_state_dict(global_w)
            ev = self.evaluate(rnd, global_w)
            val_acc, tgt_acc = ev.val_acc, ev.target_acc
            self._warn_if_collapsed(rnd, ev)
            if ev.missing:
                self.log(
                    f"round {rnd}: sites {', '.join(ev.missing)} did not evaluate: its validation accuracy is not "
                    "compared with complete rounds' for best-val selection"
                )
            if ev.selection_score() > best_val:  # training-domain validation (DomainBed), over comparable rounds
                best_val, best_round = ev.selection_score(), rnd
                best_w = {k: v.detach().clone() for k, v in global_w.items()}
            fields: dict[str, Any] = {
                contract.ROUND: rnd,
                contract.VAL_ACC: val_acc,
                contract.TARGET_ACC: tgt_acc,
                contract.VAL_PRED_CLASSES: ev.val_pred_classes,
                contract.SECONDS: time.perf_counter() - t0,
                contract.BYTES_UP: len(replies) * w_bytes
                + sum(nbytes(u) for u in uploads.values())
                + sum(nbytes(r.upload) for r in replies),
                contract.BYTES_DOWN: len(replies) * w_bytes + sum(nbytes(payloads.get(r.client_id)) for r in replies),
            }
            for key in sorted({k for r in replies for k in r.metrics}):
                fields[key] = weighted_mean(replies, key)
            for r in replies:  # none under train.privacy: the clients send no metrics
                if contract.TRAIN_ACC in r.metrics:
                    fields[contract.client_train_acc(r.client_id)] = r.metrics[contract.TRAIN_ACC]
            fields.update(self.transport.round_record(rnd))
            fields.update(ev.record)
            if self.privacy is not None:
                fields.update(self.privacy.record())
            rec = RoundRecord.model_validate(fields)  # typed here, where it is made
            history.append(rec)
            self.log(
                f"round {rnd}/{self.rounds}: {len(replies)} clients, val_acc {val_acc:.4f} "
                f"target_acc {tgt_acc:.4f} ({rec.seconds:.1f}s, {rec.bytes_up} B up, {rec.bytes_down} B down)"
            )
            self.on_round(rec)  # log first: a crash before the checkpoint re-logs identical values
            if self.checkpoints is not None:
                self.checkpoints.save(
                    rnd,
                    RoundState(
                        global_weights=global_w,
                        best=best_w,
                        best_round=best_round,
                        best_val=best_val,
                        history=history,
                        run_info=self.run_info,
                        server_state=self.alg.server_state(),
                        engine=self.engine,
                        **({"privacy": self.privacy.state()} if self.privacy else {}),
                    ),
                    self.transport.client_states(),
                )
        if self.checkpoints is not None:
            self.checkpoints.prune()
            if self.privacy is not None:  # nothing unreleased stays where the operator keeps the run's files
                self.checkpoints.drop_client_states()
        extra = {}
        if self.privacy is not None:  # what the ledger charged, for the sweep's per-image epsilon
            from fedccrl_core.privacy.sweep_epsilon import ledger_releases  # dp_accounting: only when on

            extra[contract.PRIVACY_RELEASES] = ledger_releases(self.privacy.state())
        return RunResult(history, global_w, best_w, best_round, resumed_from=start - 1, extra=extra)

    # ---- train.privacy's ledger ---------------------------------------------------------------
    def _resume_ledger(self, ck: RoundCheckpoint | None) -> None:
        """The ledger goes on from the checkpoint's releases, or from the ledger file's when it holds more (a round
        interrupted after a release): those are charged, and the round, run again, is charged again."""
        assert self.privacy is not None
        path = self.checkpoints.ledger if self.checkpoints is not None else None
        from fedccrl_core.privacy.ledger_file import resume  # dp_accounting, imported only when on

        ahead = resume(self.privacy, ck.privacy if ck is not None else None, path, self.run_info)
        if ahead:
            self.log(
                f"train.privacy: the ledger {path} holds {ahead} release(s) that no round checkpoint covers (a round "
                f"interrupted after them): charged; epsilon spent {self.privacy.ledger.epsilon():.3f}"
            )

    def _collect_uploads(self, rnd: int, history: list[RoundRecord]) -> dict[str, Any]:
        """transport.collect_uploads; a round the transport refuses after uploads left the clients has them charged
        (each release its own event) and reported before the run stops."""
        try:
            return self.transport.collect_uploads(rnd)
        except ReleasedThenRefused as refused:
            if self.privacy is not None:
                for sizes in refused.released:
                    self.privacy.statistics(rnd, sizes)
                self._report_spent(rnd, history)
            raise

    def _report_spent(self, rnd: int, history: list[RoundRecord]) -> None:
        """The run stops in round `rnd`: when that round released something that no round record covers, a record of
        the epsilon spent alone ({round, dp_epsilon..., dp_stopped: 1}) goes to on_round (MLflow), so the last
        dp_epsilon logged is what was spent. It is not a round of the history (no model, no accuracy)."""
        if self.privacy is None or not self.privacy.released_in(rnd):
            return
        if history and history[-1].round == rnd:
            return
        rec = SpentRecord.model_validate({contract.ROUND: rnd, **self.privacy.record(), contract.DP_STOPPED: 1.0})
        self.log(
            f"train.privacy: round {rnd} stopped after a release; epsilon spent {rec.dp_epsilon or 0.0:.3f} "
            "(logged as that round's dp_epsilon)"
        )
        self.on_round(rec)
