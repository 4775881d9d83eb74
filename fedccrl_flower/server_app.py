"""The ServerApp: the Flower Transport of Algorithm 1's round loop, for any fedccrl_core algorithm.

The round loop itself is fedccrl_core/federation/loop.py (RoundLoop), the one the in-process engine drives too;
`FlowerServer` only moves its uploads, payloads, weights and replies as messages, each phase one exchange over the
Grid (pushed, replies pulled as they arrive) with the phase's timeout (transport.py):
  1. QUERY every connected SuperNode; each answers with its client id, n_i and its upload (lines 3-6;
     FedCCRL: F_i as an ArrayRecord). Uploads are checked (replies.py) and must share one signature (keys,
     dtypes, row shapes); a misfit is refused, and so is a client that is not a source of this run
     (`spec.sources`), so only those clients are sampled. A site of `spec.evaluators` answers n = 0: it
     evaluates only. One client id answering from two nodes stops the run (`DuplicateClient`, naming both) before
     any upload is used; under train.privacy both uploads are charged, and so are the uploads that arrived when
     too few clients answer (`TooFewClients`) or the query is interrupted (`QueryInterrupted`: a stop, a crash).
  2. (RoundLoop: sample clients, `alg.server_payloads(uploads)`, line 7) a TRAIN message per sampled client:
     global weights + its payload (FedCCRL: F_pool minus F_i).
  3. check every reply against the global weights (replies.py) - a malformed reply is logged and refused,
     never aggregated - then `alg.aggregate` (line 23, Eq. 2) over the valid replies in client-id order.
  4. (RoundLoop: evaluate) an EVALUATE message with the aggregated weights to every site that answered the
     round's QUERY; each returns counts on its own images, which evalsets.py pools (Σ correct / Σ n: the
     in-process engine's central numbers). The server reads no data file.
  5. (RoundLoop: the record, checkpoint) the record gets this transport's fields: wire bytes
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
failed | stopped), server.log and result.pt (the RunResult fields).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.algorithms.base import Reply
from fedccrl_core.federation.checkpoints import RoundCheckpoint, RoundCheckpoints
from fedccrl_core.federation.driver import build_seeded_model
from fedccrl_core.federation.loop import RoundLoop, nbytes
from fedccrl_core.federation.round_privacy import ReleasedThenRefused
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.fastpath import resolve_device
from fedccrl_core.foundation.procs import die_with_parent
from fedccrl_flower import messages as M
from fedccrl_flower.evalsets import pool, read_eval_reply
from fedccrl_flower.replies import (
    BAD_REPLY,
    Ledger,
    SiteRefusal,
    matching_train_uploads,
    query_releases,
    read_query_reply,
    read_train_reply,
)
from fedccrl_flower.report import FlowerResult, RunReport
from fedccrl_flower.spec import ServerSpec, report_dir
from fedccrl_flower.transport import (
    QueryInterrupted,
    RoundFailure,
    TooFewClients,
    answered,
    error_reason,
    exchange,
    wait_for_nodes,
)

app = ServerApp()


if Path(sys.argv[0]).name.startswith(("flwr-", "flower-")):  # a process Flower started to run this app:
    die_with_parent()  # it ends with the process that started it (fedccrl_core/foundation/procs.py), never orphaned


class DuplicateClient(RoundFailure, ReleasedThenRefused):
    """One client id answered a query from two SuperNodes: refused before its uploads are used; both were
    released (each noised on its own node), so the round loop charges both (train.privacy)."""


class FlowerServer:
    def __init__(
        self,
        grid: Grid,
        spec: ServerSpec,
        report_dir: str | Path | None = None,
        log: Callable[[str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.grid, self.spec = grid, spec
        self.report = RunReport(report_dir or spec.work_dir)
        self.work = self.report.folder
        self.checkpoint_path = Path(spec.checkpoint) if spec.checkpoint else Path(spec.work_dir) / "checkpoint.pt"
        self.log = log or self.report.log
        self.sleep, self.clock = sleep, clock
        self.alg = build_algorithm(spec.algorithm, spec.local, spec.hparams)
        self.device = resolve_device(spec.device)
        self.client_spec_json = spec.client_spec().to_json()
        self.client_of_node: dict[int, str] = {}  # last client id each node answered with
        self.ledger = Ledger(self.log)
        self.slowest: dict[str, float] = {}  # phase -> the slowest complete exchange so far (s)
        self._timeouts: dict[str, float] = {}  # phase -> the timeout its last exchange used
        self.sources = set(spec.sources)  # the run's source clients
        self.evaluators = set(spec.evaluators)  # sites that hold only the held-out domain
        self._eval_node_of: dict[str, int] = {}  # evaluation-only site -> its node, from the round's QUERY
        self._e_up = self._e_down = 0

    # ---- messaging ----------------------------------------------------------------------------
    def _config(self, rnd: int, cid: str | None = None) -> ConfigRecord:
        cfg = ConfigRecord({M.F_SPEC: self.client_spec_json, M.F_ROUND: rnd})
        if cid is not None:
            cfg[M.F_CLIENT_ID] = cid
        return cfg

    def reply_timeout(self, phase: str) -> float:
        """How long a phase ("query" | "train") waits for its replies: the spec's fixed timeout until an
        exchange of that phase got every reply, then max(floor, factor x the slowest such exchange so far)."""
        s = self.spec
        if phase not in self.slowest:  # an evaluation is a forward pass: it waits as a query does
            return s.query_timeout_s if phase in ("query", "evaluate") else s.train_timeout_s
        return max(s.timeout_floor_s, s.timeout_factor * self.slowest[phase])

    def _exchange(self, rnd: int, msgs: list[Message], phase: str, got: dict | None = None):
        """One phase's messages over the Grid (transport.exchange: `got` fills as replies arrive); an exchange that
        got every reply, none an error, times the phase (`reply_timeout`)."""
        timeout = self._timeouts[phase] = self.reply_timeout(phase)
        replies, missing, elapsed = exchange(self.grid, msgs, timeout, phase, self.clock, self.sleep, got)
        if not missing and not any(r.has_error() for r in replies.values()):
            self.slowest[phase] = max(self.slowest.get(phase, 0.0), elapsed)
        self.log(f"round {rnd}: {phase} to {len(msgs)} node(s), {len(replies)} replied in {elapsed:.1f}s")
        return replies, missing

    # ---- round phases -------------------------------------------------------------------------
    def _query(self, rnd: int, nodes: list[int]):
        """Lines 3-6: uploads of every responsive client, keyed by client id (sorted)."""
        config = self._config(rnd)
        config[M.F_SKIP_UPLOAD] = json.dumps(
            sorted(c for c in set(self.client_of_node.values()) if not self.alg.upload_wanted(c))
        )
        msgs = [
            Message(RecordDict({M.CONFIG: config}), dst_node_id=n, message_type=M.QUERY, group_id=str(rnd))
            for n in nodes
        ]
        down = sum(M.content_nbytes(m.content) for m in msgs)
        got: dict[int, Message] = {}
        try:
            replies, failed = self._exchange(rnd, msgs, "query", got)  # failed: node -> (reason, detail)
        except BaseException as stop:  # the uploads that arrived were released: charged before the run stops
            released = query_releases(got, self.sources)
            if not released:
                raise
            raise QueryInterrupted(
                f"round {rnd}: the query was interrupted ({stop.__class__.__name__}) after "
                f"{sum(map(len, released))} upload(s) arrived",
                released,
            ) from stop
        self._query_released = query_releases(replies, self.sources)
        up = sum(M.content_nbytes(r.content) for r in replies.values() if r.has_content())
        node_of: dict[str, int] = {}
        uploads, n_of, sigs = {}, {}, {}
        twice: list[tuple[str, int, int]] = []  # (client, first node, second node)
        self._eval_node_of = {}
        for node in sorted(replies):
            r = replies[node]
            who = f"node {node}" + (f" ({self.client_of_node[node]})" if node in self.client_of_node else "")
            if r.has_error():
                failed[node] = error_reason(r)
                continue
            try:
                cid, n, upload = read_query_reply(r)
            except SiteRefusal as e:  # the site's own check: named by its client id, with its reason
                self.ledger.refuse(rnd, e.client, f"its data does not fit the run: {e}")
                continue
            except BAD_REPLY as e:
                self.ledger.refuse(rnd, who, f"malformed query reply: {e}")
                continue
            if n == 0:  # an evaluation-only site
                if cid not in self.evaluators:
                    self.ledger.refuse(
                        rnd, who, f"client {cid} announces no training rows but is not an evaluation site"
                    )
                elif cid not in self._eval_node_of:
                    self.client_of_node[node] = cid
                    self._eval_node_of[cid] = node
                continue
            if cid not in self.sources:  # e.g. a held-out domain's client that claims training rows
                self.ledger.refuse(
                    rnd,
                    who,
                    f"client {cid} is not a source client of held-out {self.spec.held_out} "
                    f"(it holds no training rows outside it)",
                )
                continue
            if cid in node_of:  # refused below, before any upload is used
                twice.append((cid, node_of[cid], node))
                continue
            self.client_of_node[node] = cid
            uploads[cid], node_of[cid], n_of[cid], sigs[cid] = upload, node, n, M.upload_signature(upload)
        if twice:
            raise DuplicateClient(
                f"round {rnd}: "
                + "; ".join(
                    f"client {cid} answered the query from two SuperNodes, nodes {a} and {b}" for cid, a, b in twice
                )
                + f": one client id is one SuperNode (each would release its own noised upload every round); the run "
                f"stops before any upload is used. Give each SuperNode its own client id (node config "
                f"'{M.NODE_CLIENT_ID}')",
                self._query_released,
            )
        consensus = M.consensus_signature(sigs)
        for cid in sorted(uploads):
            if sigs[cid] is not None and sigs[cid] != consensus:
                self.ledger.refuse(rnd, cid, f"upload {sigs[cid]} does not match the other clients' {consensus}")
                for d in (uploads, node_of, n_of):
                    d.pop(cid)
        came = answered(replies)  # refused clients answered: refused, not dropped
        for node in sorted(failed):
            owner = self.client_of_node.get(node)
            if owner is not None and owner in came:  # a restarted client answered from its new node
                self.log(f"round {rnd}: stale node {node} of {owner} did not answer ({failed[node][0]})")
                continue
            self.ledger.drop(rnd, owner, node, "query", *failed[node])
        return {cid: uploads[cid] for cid in sorted(uploads)}, node_of, n_of, up, down

    def _train(self, rnd: int, global_w: dict, sampled: list[str], payloads: dict, node_of: dict):
        """Lines 8-22 on the clients; returns the valid replies in client-id order."""
        weights_rec = M.arrays_to_record(global_w)
        msgs = []
        for cid in sampled:
            content = RecordDict({M.CONFIG: self._config(rnd, cid), M.WEIGHTS: weights_rec})
            if payloads.get(cid) is not None:
                content[M.PAYLOAD] = M.arrays_to_record(payloads[cid])
            msgs.append(Message(content, dst_node_id=node_of[cid], message_type=M.TRAIN, group_id=str(rnd)))
        down = sum(M.content_nbytes(m.content) for m in msgs)
        replies, missing = self._exchange(rnd, msgs, "train")
        cid_of = {node_of[c]: c for c in sampled}
        for node in sorted(missing):
            self.ledger.drop(rnd, cid_of[node], node, "train", *missing[node])
        up = sum(M.content_nbytes(r.content) for r in replies.values() if r.has_content())
        reference = {k: v.detach().cpu() for k, v in global_w.items()}
        valid = []
        for node, r in replies.items():
            cid = cid_of[node]
            if r.has_error():
                self.ledger.drop(rnd, cid, node, "train", *error_reason(r))
                continue
            try:
                n, weights, metrics, upload = read_train_reply(r, cid, reference, self.alg.local.privacy is None)
            except BAD_REPLY as e:
                self.ledger.refuse(rnd, cid, str(e))
                continue
            up_t = None if upload is None else {k: torch.from_numpy(v).to(self.device) for k, v in upload.items()}
            valid.append(Reply(cid, {k: v.to(self.device) for k, v in weights.items()}, n, metrics, up_t))
            self.log(f"round {rnd}: {cid}: {contract.reply_summary(metrics)}")
        return sorted(matching_train_uploads(rnd, valid, self.ledger), key=lambda r: r.client_id), up, down

    # ---- Algorithm 1 --------------------------------------------------------------------------
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

    # ---- the Evaluator of the round loop: evaluation on the sites (evalsets.py) ----------------
    def evaluate(self, rnd: int, global_w: dict):
        """EVALUATE to every site that answered this round's QUERY (every connected source site, sampled or
        not, and every evaluation-only site) and was not dropped since; their counts pooled. A site without a valid reply is dropped
        from this round's evaluation, not from the run."""
        weights_rec = M.arrays_to_record(global_w)
        gone = {d["client"] for d in self.ledger.dropped if d["round"] == rnd}  # dropped while training
        sites = {c: n for c, n in {**self._node_of, **self._eval_node_of}.items() if c not in gone}
        msgs = [
            Message(
                RecordDict({M.CONFIG: self._config(rnd, cid), M.WEIGHTS: weights_rec}),
                dst_node_id=sites[cid],
                message_type=M.EVALUATE,
                group_id=str(rnd),
            )
            for cid in sorted(sites)
        ]
        self._e_down = sum(M.content_nbytes(m.content) for m in msgs)
        replies, missing = self._exchange(rnd, msgs, "evaluate")
        self._e_up = sum(M.content_nbytes(r.content) for r in replies.values() if r.has_content())
        cid_of = {node: cid for cid, node in sites.items()}
        for node in sorted(missing):
            self.ledger.drop(rnd, cid_of[node], node, "evaluate", *missing[node])
        counts = {}
        for node, r in sorted(replies.items()):
            cid = cid_of[node]
            if r.has_error():
                self.ledger.drop(rnd, cid, node, "evaluate", *error_reason(r))
                continue
            try:
                counts[cid] = read_eval_reply(r, cid, self.spec.num_classes)
            except BAD_REPLY as e:
                self.ledger.refuse(rnd, cid, str(e))
        ev = pool(counts, [*self.spec.sources, *self.spec.evaluators])
        if not ev.record[contract.TARGET_N]:
            self.log(f"round {rnd}: no site holding {self.spec.held_out} evaluated: target accuracy is NaN")
        return ev

    # ---- the Transport of the round loop (fedccrl_core/federation/loop.py) -------------------
    def collect_uploads(self, rnd: int) -> dict:
        """Lines 3-6 over QUERY messages; a round with fewer than min_clients answers fails."""
        s = self.spec
        want = max(s.num_clients, s.min_clients) if rnd == self._start else s.min_clients
        nodes = wait_for_nodes(self.grid, rnd, want, s.min_clients, s.wait_for_clients_s, self.clock, self.sleep)
        uploads, self._node_of, self._n_of, self._q_up, self._q_down = self._query(rnd, nodes)
        if len(uploads) < s.min_clients:
            raise TooFewClients(
                f"round {rnd}: only {len(uploads)} client(s) answered "
                f"({', '.join(uploads) or 'none'}), fewer than train.flower.min_clients = "
                f"{s.min_clients}; dropped: {self.ledger.dropped_text(rnd)}",
                self._query_released,
            )
        self._uploads = uploads
        return uploads

    def announced_n(self, sampled: list[str]) -> dict:
        return {cid: self._n_of[cid] for cid in sampled}

    def known_n(self) -> dict:
        """train.privacy's budget check: every source client, with the size it announced in the last query, None
        when it did not answer it (before round 1, a client that joins late: charged as the worst case)."""
        n_of = dict(getattr(self, "_n_of", None) or {})
        return {cid: n_of.get(cid) for cid in sorted(self.sources)} if self.sources is not None else n_of

    def least_clients(self) -> int:
        return self.spec.min_clients

    def train(self, rnd: int, sampled: list[str], global_w: dict, payloads: dict, fold) -> list[Reply]:
        """Lines 8-22 over TRAIN messages; a round with fewer valid replies than min_clients fails."""
        replies, self._t_up, self._t_down = self._train(rnd, global_w, sampled, payloads, self._node_of)
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
        self._payloads = payloads
        self._replies = [dataclasses.replace(r, weights={}) for r in replies]
        return self._replies

    def round_record(self, rnd: int) -> dict:
        rec = {
            "wire_bytes_up": self._q_up + self._t_up,
            "wire_bytes_down": self._q_down + self._t_down,
            "eval_wire_bytes_up": self._e_up,
            "eval_wire_bytes_down": self._e_down,
            "clients": len(self._replies),
            **self.ledger.record(rnd),
            "query_timeout_s": self._timeouts.get("query"),
            "train_timeout_s": self._timeouts.get("train"),
        }
        for cid in self._uploads:
            rec[f"upload_bytes/{cid}"] = nbytes(self._uploads[cid])
            rec[f"payload_bytes/{cid}"] = nbytes(self._payloads.get(cid))
        return rec

    def client_states(self) -> dict:
        return {}  # client states live on the clients (Context.state, mirrored to their state-dir)

    def restore(self, checkpoints: RoundCheckpoints | None, ck: RoundCheckpoint | None) -> None:
        self._start = ck.round + 1 if ck is not None else 1

    def _run(self) -> FlowerResult:
        s = self.spec
        model = build_seeded_model(self.alg, s.backbone, s.num_classes, s.pretrained, s.seed, self.device)
        loop = RoundLoop(
            self.alg,
            model,
            self,
            self,  # evaluation on the sites (evaluate above)
            s.rounds,
            s.seed,
            s.client_fraction,
            RoundCheckpoints(self.checkpoint_path, self.device, self.log),
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
            extra={**res.extra, "refused": self.ledger.refused, "dropped": self.ledger.dropped, "engine": "flower"},
        )
        self.report.result(result)
        return result


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
    FlowerServer(grid, spec, report_dir=report_dir(spec.work_dir, context.run_id)).run()


__all__ = ["FlowerServer", "app"]
