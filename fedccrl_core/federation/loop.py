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

from fedccrl_core.algorithms.base import Algorithm, Reply
from fedccrl_core.federation.checkpoints import RoundCheckpoint, RoundCheckpoints, RoundState
from fedccrl_core.federation.round_privacy import ReleasedThenRefused, accounting_of
from fedccrl_core.federation.round_record import RoundRecord, SpentRecord
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.seeding import derive_seed, seed_everything
from fedccrl_core.learning.accuracy import accuracy, predict
from fedccrl_core.learning.clients import ClientData
from fedccrl_core.privacy.charged import ChargedRelease
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


@dataclass
class _RunSoFar:
    """What the loop carries from round to round (and a checkpoint saves): the global weights, the best-val model
    and its round and score, the round records, and the first round still to run."""

    global_w: dict
    best_w: dict
    best_round: int
    best_val: float
    history: list[RoundRecord]
    start: int

    def keep_if_best(self, rnd: int, ev: Evaluation) -> None:
        if ev.selection_score() > self.best_val:  # training-domain validation (DomainBed), over comparable rounds
            self.best_val, self.best_round = ev.selection_score(), rnd
            self.best_w = {k: v.detach().clone() for k, v in self.global_w.items()}


def weighted_mean(replies: list[Reply], key: str) -> float | None:
    vals = [(r.metrics[key], r.n) for r in replies if key in r.metrics]
    if not vals:
        return None
    return sum(v * n for v, n in vals) / sum(n for _, n in vals)


class Transport(Protocol):
    """How uploads, payloads, weights and replies move between the server and the clients."""

    def collect_uploads(self, rnd: int, charged: ChargedRelease | None = None) -> dict[str, Any]:
        """Lines 3-6: the upload (or None) of every client that takes part, keyed by client id, sorted. `charged`:
        the statistics release the pre-round check charged (train.privacy.max_epsilon, privacy/charged.py), None
        when it charged none. A client whose size changed since it announced it (Flower: a site's folder) refuses to
        release more than that; in-process, the sizes cannot change within a run, and known_n are those used."""

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
        # train.privacy's accounting around each round (round_privacy.py), or the paper's protocol when off
        self.accounting = accounting_of(algorithm, transport, seed, client_fraction, log)

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
        run = self._start()
        w_bytes = nbytes(run.global_w)
        for rnd in range(run.start, self.rounds + 1):  # line 2
            t0 = time.perf_counter()
            released = self._release(rnd, run.history)  # lines 3-6, sampling
            if released is None:
                break
            uploads, sampled = released
            payloads = self.alg.server_payloads(uploads)  # line 7
            agg = self.accounting.aggregation(rnd, run.global_w, sampled)  # Eq. 2, or DP-FedAvg under train.privacy
            try:
                replies = self.transport.train(rnd, sampled, run.global_w, payloads, agg.add)  # lines 8-22
            except BaseException:  # the round's statistics were charged: the last dp_epsilon logged says so
                self._report_spent(rnd, run.history)
                raise
            run.global_w = agg.result()  # line 23, Eq. 2, streamed
            self.accounting.weights_released(rnd, uploads, sampled)
            self.model.load_state_dict(run.global_w)
            ev = self.evaluate(rnd, run.global_w)
            self._warn_if_collapsed(rnd, ev)
            if ev.missing:
                self.log(
                    f"round {rnd}: sites {', '.join(ev.missing)} did not evaluate: its validation accuracy is not "
                    "compared with complete rounds' for best-val selection"
                )
            run.keep_if_best(rnd, ev)
            rec = self._round_record(rnd, t0, ev, uploads, payloads, replies, w_bytes)
            run.history.append(rec)
            self.log(
                f"round {rnd}/{self.rounds}: {len(replies)} clients, val_acc {ev.val_acc:.4f} "
                f"target_acc {ev.target_acc:.4f} ({rec.seconds:.1f}s, {rec.bytes_up} B up, {rec.bytes_down} B down)"
            )
            self.on_round(rec)  # log first: a crash before the checkpoint re-logs identical values
            self._save(rnd, run)
        if self.checkpoints is not None:
            self.checkpoints.prune()
        extra = self.accounting.finish(self.checkpoints)
        return RunResult(run.history, run.global_w, run.best_w, run.best_round, resumed_from=run.start - 1, extra=extra)

    def _start(self) -> _RunSoFar:
        """Round 0 (line 1: the initial global weights), or the state after the last checkpointed round."""
        seed_everything(derive_seed(self.seed, "init"))
        global_w = {k: v.detach().clone() for k, v in self.model.state_dict().items()}  # line 1
        run = _RunSoFar(global_w, global_w, 0, -2.0, [], 1)  # best_val below every selection_score
        ck = self.checkpoints.load(self._accept) if self.checkpoints is not None else None
        if ck is not None:
            run = _RunSoFar(ck.global_weights, ck.best, ck.best_round, ck.best_val, list(ck.history), ck.round + 1)
            self.alg.load_server_state(ck.server_state)
            self.log(f"resuming from checkpoint after round {ck.round}")
        self.accounting.resume(ck, self.checkpoints, self.run_info)
        self.transport.restore(self.checkpoints, ck)
        return run

    def _release(self, rnd: int, history: list[RoundRecord]) -> tuple[dict[str, Any], list[str]] | None:
        """Lines 3-6 and the round's sample: (uploads, sampled client ids); None when the privacy budget stops the
        run before round `rnd` (a ValueError when no round completed)."""
        try:
            charged = self.accounting.before_round(rnd)
            uploads = self._collect_uploads(rnd, charged, history)  # lines 3-6
            sampled = self.accounting.sample(rnd, uploads)
            self.accounting.uploads_released(rnd, uploads, sampled)
        except BudgetExhausted as stop:
            self.log(str(stop))
            self._report_spent(rnd, history)
            if not history:
                raise ValueError(f"{stop}: no round completed") from None
            return None
        return uploads, sampled

    def _round_record(
        self, rnd: int, t0: float, ev: Evaluation, uploads: dict, payloads: dict, replies: list[Reply], w_bytes: int
    ) -> RoundRecord:
        """Round `rnd`'s record: accuracies, time, traffic, the clients' weighted metrics and each one's training
        accuracy, then the transport's, the evaluation's and the accounting's fields."""
        fields: dict[str, Any] = {
            contract.ROUND: rnd,
            contract.VAL_ACC: ev.val_acc,
            contract.TARGET_ACC: ev.target_acc,
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
        fields.update(self.accounting.record())
        return RoundRecord.model_validate(fields)  # typed here, where it is made

    def _save(self, rnd: int, run: _RunSoFar) -> None:
        """The round's checkpoint, when the run keeps them."""
        if self.checkpoints is None:
            return
        self.checkpoints.save(
            rnd,
            RoundState(
                global_weights=run.global_w,
                best=run.best_w,
                best_round=run.best_round,
                best_val=run.best_val,
                history=run.history,
                run_info=self.run_info,
                server_state=self.alg.server_state(),
                engine=self.engine,
                **self.accounting.state(),
            ),
            self.transport.client_states(),
        )

    def _collect_uploads(self, rnd: int, charged: ChargedRelease | None, history: list[RoundRecord]) -> dict[str, Any]:
        """transport.collect_uploads; a round the transport refuses after uploads left the clients has them charged
        (each release its own event) and reported before the run stops."""
        try:
            return self.transport.collect_uploads(rnd, charged)
        except ReleasedThenRefused as refused:
            self.accounting.refused(rnd, refused.released)
            self._report_spent(rnd, history)
            raise

    def _report_spent(self, rnd: int, history: list[RoundRecord]) -> None:
        """The run stops in round `rnd`: the epsilon that round spent, where no round record covers it, goes to
        on_round (MLflow) as a SpentRecord (round_privacy.py Private.spent)."""
        rec = self.accounting.spent(rnd, history)
        if rec is None:
            return
        self.log(
            f"train.privacy: round {rnd} stopped after a release; epsilon spent {rec.dp_epsilon or 0.0:.3f} "
            "(logged as that round's dp_epsilon)"
        )
        self.on_round(rec)
