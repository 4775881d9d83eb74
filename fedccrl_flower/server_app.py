"""The ServerApp: the Flower Transport of Algorithm 1's round loop, for any fedccrl_core algorithm.

The round loop itself is fedccrl_core/federation/loop.py (RoundLoop), the one the in-process engine drives too;
`FlowerServer` only moves its uploads, payloads, weights and replies as messages, each phase one exchange over the
Grid (pushed, replies pulled as they arrive) with the phase's timeout (transport.py `PhaseTimer`), and keeps the
round's state in one `FlowerRound` (flower_round.py):
  1. QUERY every connected SuperNode (query_phase.py, lines 3-6); each answers with its client id, n_i and its
     upload (FedCCRL: F_i as an ArrayRecord); the replies make the round. Too few clients (`TooFewClients`) fail
     it, their uploads charged under train.privacy. Under train.privacy.max_epsilon the QUERY carries the statistics
     release the pre-round check charged, which a site whose size changed refuses to exceed (privacy/charged.py).
  2. (RoundLoop: sample clients, `alg.server_payloads(uploads)`, line 7) a TRAIN message per sampled client
     (train_phase.py): global weights + its payload (FedCCRL: F_pool minus F_i); every reply checked, then
     `alg.aggregate` (line 23, Eq. 2) over the valid replies in client-id order.
  3. (RoundLoop: evaluate) an EVALUATE message with the aggregated weights to every site that answered the
     round's QUERY (evaluate_phase.py); their counts pooled (evalsets.py). The server reads no data file.
  4. (RoundLoop: the record, checkpoint) the record gets this transport's fields (`FlowerRound.record`): wire bytes
     (`wire_bytes_up/down`, Flower's serialized QUERY/TRAIN messages, `eval_wire_bytes_up/down` the EVALUATE
     ones; `bytes_up/down` count the arrays, as in-process), clients, refused and dropped counts, per-client
     upload/payload sizes, and what the evaluation covered (`val_n`, `target_n`, `eval_sites`).

Faults: a SuperNode that does not answer within the phase's timeout, or that Flower reports gone, is dropped
(replies.Ledger: client id, node id, phase, reason `timeout` | `disconnected` | `error`, detail, in the round's
record and so in MLflow); the round fails, naming the missing clients, if fewer than `min_clients` remain. A
phase waits the spec's `query_timeout_s` / `train_timeout_s` until one of its exchanges got every reply, then
max(timeout_floor_s, timeout_factor x the slowest such exchange so far) (`reply_timeout`). A SuperNode that comes
back (a new node id, same client id) is used from the next round on; a rerun resumes after the last
checkpointed round (client states live on the clients).

Outputs: the checkpoint (`spec.checkpoint`, default <work_dir>/checkpoint.pt) and, per Flower run,
<work_dir>/run-<run id>/: rounds.jsonl (one record per finished round), status.json (running | completed |
failed | stopped), server.log and result.pt (the RunResult fields); with the spec's `report_to`, the records,
status and result also go to the MLflow run it names (tracked_report.py), which an operator follows without this
disk.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.algorithms.base import Reply
from fedccrl_core.federation.checkpoints import RoundCheckpoint, RoundCheckpoints
from fedccrl_core.federation.driver import build_seeded_model
from fedccrl_core.federation.loop import Evaluation, RoundLoop
from fedccrl_core.foundation.fastpath import resolve_device
from fedccrl_core.foundation.procs import die_with_parent
from fedccrl_core.privacy.charged import ChargedRelease
from fedccrl_flower import messages as M
from fedccrl_flower.evaluate_phase import evaluate_at_sites
from fedccrl_flower.flower_result import FlowerResult
from fedccrl_flower.flower_round import FlowerRound
from fedccrl_flower.query_phase import exchange_query, sort_query_replies
from fedccrl_flower.replies import Ledger
from fedccrl_flower.report import RunReport
from fedccrl_flower.spec import ServerSpec, report_dir
from fedccrl_flower.tracked_report import TrackedWriter
from fedccrl_flower.train_phase import exchange_train, train_messages
from fedccrl_flower.transport import (
    PhaseTimer,
    QueryInterrupted,
    RoundFailure,
    TooFewClients,
    phase_config,
    wait_for_nodes,
)

app = ServerApp()


if Path(sys.argv[0]).name.startswith(("flwr-", "flower-")):  # a process Flower started to run this app:
    die_with_parent()  # it ends with the process that started it (fedccrl_core/foundation/procs.py), never orphaned


class FlowerServer:
    """The Transport and the Evaluator of the round loop (fedccrl_core/federation/loop.py) over Flower's Grid."""

    def __init__(
        self,
        grid: Grid,
        spec: ServerSpec,
        report_dir: str | Path | None = None,
        run_id: int | None = None,
        log: Callable[[str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.grid, self.spec = grid, spec
        self.report = RunReport(report_dir or spec.work_dir, tracked_writer(spec, run_id))
        self.checkpoint_path = Path(spec.checkpoint) if spec.checkpoint else Path(spec.work_dir) / "checkpoint.pt"
        self.log = log or self.report.log
        self.timer = PhaseTimer(spec, self.log, clock, sleep)
        self.alg = build_algorithm(spec.algorithm, spec.local, spec.hparams)
        self.device = resolve_device(spec.device)
        self.client_spec_json = spec.client_spec().to_json()
        self.client_of_node: dict[int, str] = {}  # last client id each node answered with
        self.ledger = Ledger(self.log)
        self.sources = set(spec.sources)  # the run's source clients
        self.round: FlowerRound | None = None  # the last round a query made
        self._start = 1

    def run(self) -> FlowerResult:
        try:
            self.report.status("running")
            result = self._run()
            self.report.status("completed", round=result.history[-1].round if result.history else 0)
            return result
        except (SystemExit, KeyboardInterrupt) as e:  # `flwr stop` / a signal
            self.log(f"stopped ({e.__class__.__name__})")
            self.report.status("stopped", error=f"the ServerApp was stopped ({e.__class__.__name__})")
            raise
        except BaseException as e:
            msg = str(e) if isinstance(e, RoundFailure) else f"{e.__class__.__name__}: {e}"
            self.log(f"FAILED: {msg}\n{traceback.format_exc()}")
            self.report.status("failed", error=msg)
            raise
        finally:
            self.report.close()

    # ---- the Evaluator of the round loop: evaluation on the sites (evaluate_phase.py) ---------
    def evaluate(self, rnd: int, global_w: dict) -> Evaluation:
        """EVALUATE at every site that answered this round's QUERY and was not dropped since."""
        assert self.round is not None and self.round.rnd == rnd
        gone = self.ledger.dropped_in(rnd)  # dropped while training
        sites = self.round.sites(gone)
        done = evaluate_at_sites(self.grid, sites, global_w, self.spec, rnd, ledger=self.ledger, timer=self.timer)
        self.round.eval_wire_up, self.round.eval_wire_down = done.wire_up, done.wire_down
        return done.evaluation

    # ---- the Transport of the round loop (fedccrl_core/federation/loop.py) -------------------
    def collect_uploads(self, rnd: int, charged: ChargedRelease | None = None) -> dict:
        """Lines 3-6 over QUERY messages, which carry `charged` (the statistics release the pre-round check charged);
        a round with fewer than min_clients answers fails."""
        s = self.spec
        want = max(s.num_clients, s.min_clients) if rnd == self._start else s.min_clients
        nodes = wait_for_nodes(
            self.grid, rnd, want, s.min_clients, s.wait_for_clients_s, self.timer.clock, self.timer.sleep
        )
        config = phase_config(self.client_spec_json, rnd)
        config[M.F_SKIP_UPLOAD] = json.dumps(
            sorted(c for c in set(self.client_of_node.values()) if not self.alg.upload_wanted(c))
        )
        if charged is not None:  # a site whose size changed refuses to release more (privacy/charged.py)
            config[M.F_CHARGED] = M.charged_field(charged)
        announced = self.known_n()
        msgs = [
            Message(RecordDict({M.CONFIG: config}), dst_node_id=n, message_type=M.QUERY, group_id=str(rnd))
            for n in nodes
        ]
        ex = exchange_query(self.grid, self.timer, rnd, msgs, self.sources)
        rd = self.round = sort_query_replies(rnd, ex, s, self.client_of_node, self.ledger, self.log, announced)
        if len(rd.uploads) < s.min_clients:
            raise TooFewClients(
                f"round {rnd}: only {len(rd.uploads)} client(s) answered "
                f"({', '.join(rd.uploads) or 'none'}), fewer than train.flower.min_clients = "
                f"{s.min_clients}; dropped: {self.ledger.dropped_text(rnd)}",
                rd.released,
            )
        return rd.uploads

    def announced_n(self, sampled: list[str]) -> dict:
        assert self.round is not None
        return {cid: self.round.n_of[cid] for cid in sampled}

    def known_n(self) -> dict:
        """train.privacy's budget check: every source client, with the size it announced in the last query (or told
        when it refused that round's release: its size changed), None when it did not answer it (before round 1, a
        client that joins late: charged as the worst case)."""
        n_of = {**self.round.told_n, **self.round.n_of} if self.round is not None else {}
        return {cid: n_of.get(cid) for cid in sorted(self.sources)}

    def least_clients(self) -> int:
        return self.spec.min_clients

    def train(self, rnd: int, sampled: list[str], global_w: dict, payloads: dict, fold) -> list[Reply]:
        """Lines 8-22 over TRAIN messages; a round with fewer valid replies than min_clients fails."""
        rd = self.round
        assert rd is not None and rd.rnd == rnd
        msgs = train_messages(rnd, self.client_spec_json, global_w, sampled, payloads, rd.node_of)
        cid_of = {rd.node_of[c]: c for c in sampled}
        need_acc = self.alg.local.privacy is None
        replies, ex = exchange_train(
            self.grid, self.timer, rnd, msgs, cid_of, global_w, need_acc, self.device, self.ledger, self.log
        )
        rd.train_timeout_s, rd.train_wire_up, rd.train_wire_down = ex.timeout, ex.wire_up, ex.wire_down
        need = min(self.spec.min_clients, len(sampled))
        if len(replies) < need:
            got = {r.client_id for r in replies}
            raise RoundFailure(
                f"round {rnd}: {len(replies)} valid update(s) ({', '.join(sorted(got)) or 'none'}), "
                f"fewer than train.flower.min_clients = {self.spec.min_clients}; no reply or refused: "
                f"{', '.join(c for c in sampled if c not in got)}; dropped: "
                f"{self.ledger.dropped_text(rnd)}"
            )
        for r in replies:  # client-id order
            fold(r)
        rd.payloads = payloads
        rd.replies = [dataclasses.replace(r, weights={}) for r in replies]
        return rd.replies

    def round_record(self, rnd: int) -> dict:
        assert self.round is not None and self.round.rnd == rnd
        return self.round.record(self.ledger)

    def client_states(self) -> dict:
        return {}  # client states live on the clients (Context.state, mirrored to their state-dir)

    def restore(self, checkpoints: RoundCheckpoints | None, ck: RoundCheckpoint | None) -> None:
        self._start = ck.round + 1 if ck is not None else 1

    def _run(self) -> FlowerResult:
        s = self.spec
        model = build_seeded_model(self.alg, s.backbone, s.num_classes, s.pretrained, s.seed, self.device)
        checkpoints = RoundCheckpoints(self.checkpoint_path, self.device, self.log)
        loop = RoundLoop(
            self.alg,
            model,
            self,
            self,
            s.rounds,
            s.seed,
            s.client_fraction,
            checkpoints,
            self.report.append_record,
            s.run_info,
            self.log,
            engine="flower",
        )
        try:
            res = loop.run()
        except QueryInterrupted as e:  # its uploads charged: the run stops with what interrupted it
            raise (e.__cause__ or e) from None
        result = FlowerResult(
            history=res.history,
            final_weights=res.final_weights,
            best_weights=res.best_weights,
            best_round=res.best_round,
            resumed_from=res.resumed_from,
            extra={**res.extra, **self.ledger.result(), "engine": "flower"},
        )
        self.report.result(result)
        return result


def tracked_writer(spec: ServerSpec, run_id: int | None) -> TrackedWriter | None:
    """The spec's `report_to` for Flower run `run_id` (tracked_report.py), None without one."""
    if spec.report_to is None:
        return None
    if run_id is None:
        raise ValueError("a spec with report_to needs the Flower run id to report under")
    return TrackedWriter(spec.report_to, run_id)


@app.main()
def main(grid: Grid, context: Context) -> None:
    if context.run_config.get(M.RUN_TASK) == M.TASK_SITE_EVAL:  # an evaluation-only run: no training
        from fedccrl_flower.site_evaluation import serve_site_evaluation

        serve_site_evaluation(grid, context)
        return
    raw = context.run_config.get(M.RUN_SPEC, "")
    if not raw:
        print(
            "fedccrl ServerApp: the run config has no 'spec'; start runs with fedccrl_flower.run "
            "(or flwr run --run-config <spec.toml>)",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2)
    spec = ServerSpec.from_json(str(raw), f"Flower run config '{M.RUN_SPEC}'")
    FlowerServer(grid, spec, report_dir=report_dir(spec.work_dir, context.run_id), run_id=context.run_id).run()


__all__ = ["FlowerServer", "app"]
