"""The ServerApp: the Flower Transport of Algorithm 1's round loop, for any fedccrl_core algorithm.

The round loop itself is fedccrl_core/federation/loop.py (RoundLoop), the one the in-process engine
drives too; `FlowerServer` only moves its uploads, payloads, weights and replies as messages:
  1. QUERY every connected SuperNode; each answers with its client id, n_i and its upload
     (lines 3-6; FedCCRL: F_i as an ArrayRecord). Uploads are checked (messages.validate_upload) and
     must share one signature (keys, dtypes, row shapes); a misfit is refused, and so is a client that
     is not a source of this run (`shards.client_ids`: not of the held-out domain, and for a feddg_bench
     partition one with training rows outside it), so only those clients are sampled.
  2. (RoundLoop: sample clients, `alg.server_payloads(uploads)`, line 7) a TRAIN message per sampled client: global weights + its payload (FedCCRL: F_pool minus F_i).
  3. check every reply against the global weights' keys/shapes/dtypes (finite floats, n_i as
     announced) - a malformed reply is logged and refused, never aggregated - then
     `alg.aggregate` (line 23, Eq. 2) over the valid replies in client-id order.
  4. (RoundLoop: evaluate, the record, checkpoint) the record gets this transport's fields: wire bytes
     (`wire_bytes_up/down`, Flower's serialized messages; `bytes_up/down` count the arrays, as in-process),
     clients, refused and dropped counts, and per-client upload/payload sizes.

Evaluation is central: the ServerApp reads the held-out domain's shard and the source clients' val
splits from `spec.shards` (the research setting, where the server operator holds the benchmark;
it keeps val/target accuracy identical to the in-process engine). Clients never send images.

Faults: a SuperNode that does not answer within the phase's timeout (or that leaves) is dropped from
the round; the round goes on if at least `min_clients` clients remain, and otherwise fails with a
message that names the missing clients. Every dropped client is in the round's record
(`dropped_clients`: client id, node id, phase, reason `timeout` | `disconnected` | `error`, detail) and
so in MLflow (pipeline/tracking.py). A phase's timeout scales with the measured reply times: the
spec's `query_timeout_s` / `train_timeout_s` until a reply of that phase has been timed, then
max(timeout_floor_s, timeout_factor x the slowest reply of that phase so far) (`reply_timeout`). A SuperNode that comes back (a new node id, same client
id) is used from the next round on. A rerun resumes after the last checkpointed round (the
checkpoint is the in-process engine's format minus client states, which live on the clients).

Outputs: the checkpoint (`spec.checkpoint`, default <work_dir>/checkpoint.pt) and, per Flower run,
<work_dir>/run-<run id>/: rounds.jsonl (one record per finished round, read by the launcher and
logged to MLflow), status.json (running | completed | failed | stopped), server.log and result.pt
(the RunResult fields). Per-run folders keep a stopped run's late writes away from its rerun.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp

from fedccrl_core import contract
from fedccrl_core.algorithms import LocalConfig, Reply, build_algorithm
from fedccrl_core.checkpoint import atomic_torch_save
from fedccrl_core.fsio import write_text
from fedccrl_core.evaluation import accuracy
from fedccrl_core.federation.checkpoints import RoundCheckpoints
from fedccrl_core.federation.engine import resolve_device
from fedccrl_core.federation.loop import EvalSets, RoundLoop, nbytes
from fedccrl_core.procs import die_with_parent
from fedccrl_flower import messages as M
from fedccrl_flower.settings import FlowerSettings

app = ServerApp()
if Path(sys.argv[0]).name.startswith(("flwr-", "flower-")):  # a process Flower started to run this app:
    die_with_parent()  # it ends with the process that started it (fedccrl_core/procs.py), never orphaned


class RoundFailure(RuntimeError):
    """A round that cannot complete (too few clients); the run stops with this message."""


@dataclass
class ServerSpec:
    """Everything the ServerApp needs; travels as JSON in the run config (`spec`)."""

    algorithm: str
    local: dict                     # LocalConfig fields
    hparams: dict
    backbone: str
    num_classes: int
    seed: int
    held_out: str                   # the held-out (target) domain
    shards: str                     # server-side copy of the shards, for evaluation
    work_dir: str
    pretrained: str = "none"
    client_fraction: float = 1.0
    device: str = "auto"
    eval_batch_size: int = 256
    # params.yaml train.flower's waits (fedccrl_flower/settings.py declares each, with its default and meaning)
    min_clients: int = FlowerSettings.model_fields["min_clients"].default
    num_clients: int = FlowerSettings.model_fields["num_clients"].default  # 0: min_clients
    wait_for_clients_s: float = FlowerSettings.model_fields["wait_for_clients_s"].default
    query_timeout_s: float = FlowerSettings.model_fields["query_timeout_s"].default
    train_timeout_s: float = FlowerSettings.model_fields["train_timeout_s"].default
    timeout_factor: float = FlowerSettings.model_fields["timeout_factor"].default
    timeout_floor_s: float = FlowerSettings.model_fields["timeout_floor_s"].default
    poll_s: float = 0.5
    checkpoint: str = ""            # "" = <work_dir>/checkpoint.pt
    client_state: str = "persistent"  # params.yaml train.client_state: persistent | stateless
    run_info: dict = field(default_factory=dict)

    FROM_SETTINGS = ("min_clients", "num_clients", "wait_for_clients_s", "query_timeout_s", "train_timeout_s",
                     "timeout_factor", "timeout_floor_s")  # the fields above, as train.flower gives them

    @property
    def rounds(self) -> int:
        return int(self.local["rounds"])

    @classmethod
    def from_dict(cls, d: dict) -> "ServerSpec":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"server spec: unknown field(s) {unknown}")
        return cls(**d)

    def client_spec(self) -> dict:
        """The part a client needs (sent in every CONFIG record; no paths of the server)."""
        core = {"algorithm": self.algorithm, "local": self.local, "hparams": self.hparams, "backbone": self.backbone,
                "num_classes": self.num_classes, "seed": self.seed, "held_out": self.held_out, "device": self.device,
                "client_state": self.client_state}
        key = hashlib.sha256(json.dumps({**core, "run_info": self.run_info}, sort_keys=True, default=str).encode())
        return {**core, "state_key": key.hexdigest()[:16]}


def _answered(replies: dict[int, Message]) -> set[str]:
    """Client ids that sent a query reply with content (well-formed or not)."""
    out = set()
    for r in replies.values():
        try:
            if r.has_content() and M.INFO in r.content:
                out.add(str(r.content[M.INFO][M.F_CLIENT_ID]))
        except (KeyError, TypeError):
            pass
    return out


def load_evalsets(shards: str, held_out: str, batch_size: int, device) -> EvalSets:
    """Source validation (every source client's val split) and the held-out domain's test set."""
    import numpy as np

    from fedccrl_core.data.shards import client_ids, load_client, load_domain_test, load_manifest
    from fedccrl_core.federation.client import ClientData

    manifest = load_manifest(shards)
    vals = [load_client(shards, cid, exclude_domain=held_out) for cid in client_ids(manifest, held_out)]
    val = [ClientData.from_numpy(s.client_id, s.domain, s.val_x, s.val_y, s.val_x[:0], s.val_y[:0], device)
           for s in vals]
    tx, ty = load_domain_test(shards, held_out)
    target = ClientData.from_numpy("target", held_out, tx, ty, tx[:0], ty[:0], device)
    return EvalSets(torch.cat([c.train_x for c in val]), torch.cat([c.train_y for c in val]),
                    target.train_x, torch.from_numpy(np.asarray(ty, dtype=np.int64)).to(device), batch_size)


class FlowerServer:
    def __init__(self, grid: Grid, spec: ServerSpec, report_dir: str | Path | None = None,
                 log: Callable[[str], None] | None = None, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic):
        self.grid, self.spec = grid, spec
        self.work = Path(report_dir) if report_dir else Path(spec.work_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.checkpoint_path = Path(spec.checkpoint) if spec.checkpoint else Path(spec.work_dir) / "checkpoint.pt"
        self._log_file = open(self.work / contract.FLOWER_LOG_FILE, "a", buffering=1)
        self.log = log or self._default_log
        self.sleep, self.clock = sleep, clock
        local = dict(spec.local)
        local["mean"], local["std"] = tuple(local["mean"]), tuple(local["std"])
        self.alg = build_algorithm(spec.algorithm, LocalConfig(**local), spec.hparams)
        self.device = resolve_device(spec.device)
        self.client_spec_json = json.dumps(spec.client_spec(), sort_keys=True)
        self.client_of_node: dict[int, str] = {}  # last client id each node answered with
        self.refused: list[dict] = []  # replies that arrived malformed
        self.dropped: list[dict] = []  # clients that did not answer, were unavailable or raised
        self.slowest: dict[str, float] = {}  # phase -> the slowest reply time measured so far (s)
        self._timeouts: dict[str, float] = {}  # phase -> the timeout its last exchange used
        self.sources: set[str] | None = None  # the run's source clients (shards.client_ids), set by _run

    def _default_log(self, msg: str) -> None:
        line = f"[fedccrl server] {msg}"
        print(line, flush=True)
        self._log_file.write(f"{time.strftime('%H:%M:%S')} {line}\n")

    # ---- status and outputs -------------------------------------------------------------------
    def _status(self, status: str, **extra) -> None:
        write_text(self.work / contract.FLOWER_STATUS_FILE,
                   json.dumps({"status": status, "time": time.time(), **extra}))

    def _append_record(self, rec: dict) -> None:
        with open(self.work / contract.FLOWER_ROUNDS_FILE, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())

    # ---- messaging ----------------------------------------------------------------------------
    def _config(self, rnd: int, cid: str | None = None) -> ConfigRecord:
        cfg = {M.F_SPEC: self.client_spec_json, M.F_ROUND: rnd}
        if cid is not None:
            cfg[M.F_CLIENT_ID] = cid
        return ConfigRecord(cfg)

    def reply_timeout(self, phase: str) -> float:
        """How long a phase ("query" | "train") waits for its replies: the spec's fixed timeout until a
        reply of that phase has been timed, then max(floor, factor x the slowest reply so far)."""
        s = self.spec
        if phase not in self.slowest:
            return s.query_timeout_s if phase == "query" else s.train_timeout_s
        return max(s.timeout_floor_s, s.timeout_factor * self.slowest[phase])

    def _exchange(self, messages: list[Message], phase: str, label: str,
                  done_early: Callable[[set[int], dict[int, Message]], bool] | None = None):
        """Push, then pull replies until all are in, the phase's timeout passes, the pending nodes left
        the SuperLink, or `done_early` says the rest is not needed. Returns ({node: reply},
        {missing node: (reason, detail)}) with reason "timeout" or "disconnected". Every reply's time
        (push to pull) feeds `reply_timeout`."""
        dst = [m.metadata.dst_node_id for m in messages]
        timeout = self._timeouts[phase] = self.reply_timeout(phase)
        t_push = self.clock()
        ids = list(self.grid.push_messages(messages))
        pending = {mid: node for mid, node in zip(ids, dst) if mid}
        missing: dict[int, tuple[str, str]] = {}
        for node in {n for mid, n in zip(ids, dst) if not mid}:
            self.log(f"{label}: message to node {node} could not be pushed")
            missing[node] = ("disconnected", "the SuperLink did not take the message")
        replies: dict[int, Message] = {}
        deadline, next_check = t_push + timeout, t_push + 2.0
        while pending:
            for r in self.grid.pull_messages(list(pending)):
                node = pending.pop(r.metadata.reply_to_message_id, None)
                if node is not None:
                    replies[node] = r
                    if not r.has_error():
                        self.slowest[phase] = max(self.slowest.get(phase, 0.0), self.clock() - t_push)
            if not pending or (done_early and done_early(set(pending.values()), replies)):
                break
            now = self.clock()
            if now >= deadline:
                break
            if now >= next_check:
                alive = set(self.grid.get_node_ids())
                for mid in [m for m, n in pending.items() if n not in alive]:
                    self.log(f"{label}: node {pending[mid]} left the SuperLink")
                    missing[pending.pop(mid)] = ("disconnected", f"left the SuperLink after {now - t_push:.1f}s")
                next_check = now + 2.0
            self.sleep(self.spec.poll_s)
        for node in pending.values():
            missing[node] = ("timeout", f"no {phase} reply within {timeout:.1f}s")
        return replies, missing

    def _dropped(self, rnd: int, client: str | None, node: int, phase: str, reason: str, detail: str) -> None:
        """One client dropped from round `rnd`: in the round's record (`dropped_clients`) and the log."""
        self.dropped.append({"round": rnd, "client": client, "node": node, "phase": phase, "reason": reason,
                             "detail": detail})
        self.log(f"round {rnd}: {client or 'unknown client'} (node {node}) dropped in the {phase} phase: "
                 f"{reason} ({detail})")

    def _dropped_text(self, rnd: int) -> str:
        return "; ".join(f"{d['client'] or 'node ' + str(d['node'])}: {d['reason']} in {d['phase']} ({d['detail']})"
                         for d in self.dropped if d["round"] == rnd) or "none"

    def _wait_for_nodes(self, rnd: int, want: int) -> list[int]:
        s = self.spec
        deadline = self.clock() + s.wait_for_clients_s
        while True:
            nodes = sorted(self.grid.get_node_ids())
            if len(nodes) >= want or (self.clock() >= deadline and len(nodes) >= s.min_clients):
                return nodes
            if self.clock() >= deadline:
                raise RoundFailure(f"round {rnd}: {len(nodes)} SuperNode(s) connected after "
                                   f"{s.wait_for_clients_s:.0f}s, fewer than train.flower.min_clients = "
                                   f"{s.min_clients}")
            self.sleep(1.0)

    def _refuse(self, rnd: int, who: str, reason: str) -> None:
        """A reply that arrived but cannot be used (malformed arrays, wrong client, ...)."""
        self.refused.append({"round": rnd, "client": who, "reason": reason})
        self.log(f"round {rnd}: REFUSED reply of {who}: {reason}")

    @staticmethod
    def _error_reason(reply: Message) -> tuple[str, str]:
        """An error reply: the node is gone (Flower's NODE_UNAVAILABLE, ...: "disconnected") or its
        ClientApp raised ("error")."""
        e = reply.error
        kind = "disconnected" if e.code in (ErrorCode.NODE_UNAVAILABLE, ErrorCode.MESSAGE_UNAVAILABLE,
                                            ErrorCode.REPLY_MESSAGE_UNAVAILABLE) else "error"
        return kind, f"{e.reason} (code {e.code})"

    # ---- round phases -------------------------------------------------------------------------
    def _query(self, rnd: int, nodes: list[int]):
        """Lines 3-6: uploads of every responsive client, keyed by client id (sorted)."""
        config = self._config(rnd)
        config[M.F_SKIP_UPLOAD] = json.dumps(sorted(c for c in set(self.client_of_node.values())
                                                    if not self.alg.upload_wanted(c)))
        msgs = [Message(RecordDict({M.CONFIG: config}), dst_node_id=n, message_type=M.QUERY,
                        group_id=str(rnd)) for n in nodes]
        down = sum(M.content_nbytes(m.content) for m in msgs)

        def done_early(pending_nodes, replies):  # a restarted client answered from its new node
            answered = _answered(replies)
            return all(self.client_of_node.get(n) in answered for n in pending_nodes)

        t0 = time.perf_counter()
        replies, missing = self._exchange(msgs, "query", f"round {rnd} query", done_early)
        self.log(f"round {rnd}: query to {len(nodes)} node(s), {len(replies)} replied in "
                 f"{time.perf_counter() - t0:.1f}s")
        up = sum(M.content_nbytes(r.content) for r in replies.values() if r.has_content())
        failed = dict(missing)  # node -> (reason, detail): dropped unless its client answered from another node
        uploads, node_of, n_of, sigs = {}, {}, {}, {}
        for node in sorted(replies):
            r = replies[node]
            who = f"node {node}" + (f" ({self.client_of_node[node]})" if node in self.client_of_node else "")
            if r.has_error():
                failed[node] = self._error_reason(r)
                continue
            try:
                info = r.content[M.INFO]
                cid, n = str(info[M.F_CLIENT_ID]), int(info[M.F_N])
                if n < 1:
                    raise M.MalformedUpdate(f"n_i = {n}")
                upload = M.record_to_arrays(r.content[M.UPLOAD], f"upload of {cid}") if M.UPLOAD in r.content else None
                M.validate_upload(upload, f"upload of {cid}")
            except (M.MalformedUpdate, KeyError, TypeError, ValueError) as e:
                self._refuse(rnd, who, f"malformed query reply: {e}")
                continue
            if self.sources is not None and cid not in self.sources:  # e.g. a held-out domain's client
                self._refuse(rnd, who, f"client {cid} is not a source client of held-out {self.spec.held_out} "
                                       f"(it holds no training rows outside it)")
                continue
            if cid in node_of:
                self.log(f"round {rnd}: client {cid} answered from nodes {node_of[cid]} and {node}; "
                         f"using {node_of[cid]}")
                continue
            self.client_of_node[node] = cid
            uploads[cid], node_of[cid], n_of[cid], sigs[cid] = upload, node, n, M.upload_signature(upload)
        consensus = M.consensus_signature(sigs)
        for cid in sorted(uploads):
            if sigs[cid] is not None and sigs[cid] != consensus:
                self._refuse(rnd, cid, f"upload {sigs[cid]} does not match the other clients' {consensus}")
                for d in (uploads, node_of, n_of):
                    d.pop(cid)
        answered = _answered(replies)  # refused clients answered: refused, not dropped
        for node in sorted(failed):
            cid = self.client_of_node.get(node)
            if cid is not None and cid in answered:  # a restarted client answered from its new node
                self.log(f"round {rnd}: stale node {node} of {cid} did not answer ({failed[node][0]})")
                continue
            self._dropped(rnd, cid, node, "query", *failed[node])
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
        t0 = time.perf_counter()
        replies, missing = self._exchange(msgs, "train", f"round {rnd} train")
        self.log(f"round {rnd}: train to {len(msgs)} client(s), {len(replies)} replied in "
                 f"{time.perf_counter() - t0:.1f}s")
        cid_of = {node_of[c]: c for c in sampled}
        for node in sorted(missing):
            self._dropped(rnd, cid_of[node], node, "train", *missing[node])
        up = sum(M.content_nbytes(r.content) for r in replies.values() if r.has_content())
        reference = {k: v.detach().cpu() for k, v in global_w.items()}
        valid = []
        for node, r in replies.items():
            cid = cid_of[node]
            if r.has_error():
                self._dropped(rnd, cid, node, "train", *self._error_reason(r))
                continue
            try:
                info = r.content[M.INFO]
                n = info[M.F_N]
                if str(info[M.F_CLIENT_ID]) != cid:
                    raise M.MalformedUpdate(f"answers as {info[M.F_CLIENT_ID]}, expected {cid}")
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:  # the algorithm's n_i (Eq. 2)
                    raise M.MalformedUpdate(f"n_i = {n!r} is not a positive integer")
                arrays = M.record_to_arrays(r.content[M.WEIGHTS], f"weights of {cid}")
                weights = M.validate_weights(arrays, reference, f"weights of {cid}")
                metrics = M.metrics_from_record(r.content[M.METRICS], f"metrics of {cid}")
                if contract.TRAIN_ACC not in metrics and self.alg.local.privacy is None:  # train.privacy: none sent
                    raise M.MalformedUpdate(f"metrics of {cid} lack {contract.TRAIN_ACC}")
                upload = (M.record_to_arrays(r.content[M.UPLOAD], f"train upload of {cid}")
                          if M.UPLOAD in r.content else None)
                M.validate_upload(upload, f"train upload of {cid}")
            except (M.MalformedUpdate, KeyError, TypeError, ValueError) as e:
                self._refuse(rnd, cid, str(e))
                continue
            up_t = None if upload is None else {k: torch.from_numpy(v).to(self.device) for k, v in upload.items()}
            valid.append(Reply(cid, {k: v.to(self.device) for k, v in weights.items()}, n, metrics, up_t))
            self.log(f"round {rnd}: {cid}: {contract.reply_summary(metrics)}")
        sigs = {r.client_id: None if r.upload is None else  # summed element-wise: full shapes must agree
                tuple(sorted((k, str(v.dtype), tuple(v.shape)) for k, v in r.upload.items())) for r in valid}
        consensus = M.consensus_signature(sigs)
        for r in list(valid):  # uploads are summed together: one signature (keys, dtypes, shapes)
            if sigs[r.client_id] != consensus:
                self._refuse(rnd, r.client_id, f"train upload {sigs[r.client_id]} does not match the others' {consensus}")
                valid.remove(r)
        valid.sort(key=lambda r: r.client_id)
        return valid, up, down

    # ---- Algorithm 1 --------------------------------------------------------------------------
    def run(self) -> dict:
        try:
            self._status("running")
            result = self._run()
            self._status("completed", round=result["history"][-1]["round"] if result["history"] else 0)
            return result
        except (SystemExit, KeyboardInterrupt) as e:  # `flwr stop` / a signal
            self.log(f"stopped ({e.__class__.__name__})")
            self._status("stopped", error=f"the ServerApp was stopped ({e.__class__.__name__})")
            raise
        except BaseException as e:
            msg = str(e) if isinstance(e, RoundFailure) else f"{e.__class__.__name__}: {e}"
            self.log(f"FAILED: {msg}\n{traceback.format_exc()}")
            self._status("failed", error=msg)
            raise
        finally:
            self._log_file.close()

    # ---- the Transport of the round loop (fedccrl_core/federation/loop.py) -------------------
    def collect_uploads(self, rnd: int) -> dict:
        """Lines 3-6 over QUERY messages; a round with fewer than min_clients answers fails."""
        s = self.spec
        nodes = self._wait_for_nodes(rnd, max(s.num_clients, s.min_clients) if rnd == self._start else s.min_clients)
        uploads, self._node_of, self._n_of, self._q_up, self._q_down = self._query(rnd, nodes)
        if len(uploads) < s.min_clients:
            raise RoundFailure(f"round {rnd}: only {len(uploads)} client(s) answered "
                               f"({', '.join(uploads) or 'none'}), fewer than train.flower.min_clients = "
                               f"{s.min_clients}; dropped: {self._dropped_text(rnd)}")
        self._uploads = uploads
        return uploads

    def announced_n(self, sampled: list[str]) -> dict:
        return {cid: self._n_of[cid] for cid in sampled}

    def known_n(self) -> dict:
        """The sizes announced in the last query (none before round 1's): train.privacy's budget check."""
        return dict(getattr(self, "_n_of", None) or {})

    def train(self, rnd: int, sampled: list[str], global_w: dict, payloads: dict, fold) -> list[Reply]:
        """Lines 8-22 over TRAIN messages; a round with fewer valid replies than min_clients fails."""
        replies, self._t_up, self._t_down = self._train(rnd, global_w, sampled, payloads, self._node_of)
        need = min(self.spec.min_clients, len(sampled))
        if len(replies) < need:
            got = {r.client_id for r in replies}
            raise RoundFailure(f"round {rnd}: {len(replies)} valid update(s) ({', '.join(sorted(got)) or 'none'}), "
                               f"fewer than train.flower.min_clients = {self.spec.min_clients}; no reply or refused: "
                               f"{', '.join(c for c in sampled if c not in got)}; dropped: {self._dropped_text(rnd)}")
        for r in replies:  # client-id order
            fold(r)
        self._payloads = payloads
        self._replies = [dataclasses.replace(r, weights={}) for r in replies]
        return self._replies

    def round_record(self, rnd: int) -> dict:
        rec = {"wire_bytes_up": self._q_up + self._t_up, "wire_bytes_down": self._q_down + self._t_down,
               "clients": len(self._replies), "refused": sum(1 for x in self.refused if x["round"] == rnd),
               "dropped": sum(1 for x in self.dropped if x["round"] == rnd),
               "dropped_clients": [{k: v for k, v in x.items() if k != "round"} for x in self.dropped
                                   if x["round"] == rnd],
               "refused_clients": [{k: v for k, v in x.items() if k != "round"} for x in self.refused
                                   if x["round"] == rnd],
               "query_timeout_s": self._timeouts.get("query"), "train_timeout_s": self._timeouts.get("train")}
        for cid in self._uploads:
            rec[f"upload_bytes/{cid}"] = nbytes(self._uploads[cid])
            rec[f"payload_bytes/{cid}"] = nbytes(self._payloads.get(cid))
        return rec

    def client_states(self) -> dict:
        return {}  # client states live on the clients (Context.state, mirrored to their state-dir)

    def restore(self, checkpoints, ck) -> None:
        self._start = ck["round"] + 1 if ck is not None else 1

    def _run(self) -> dict:
        from fedccrl_core.data.shards import client_ids, load_manifest

        s = self.spec
        self.sources = set(client_ids(load_manifest(s.shards), s.held_out))  # feddg_bench: the non-empty clients
        evalsets = load_evalsets(s.shards, s.held_out, s.eval_batch_size, self.device)
        torch.manual_seed(s.seed)  # as pipeline/train.py builds the model for the in-process engine
        model = self.alg.build_model(s.backbone, s.num_classes, s.pretrained, self.alg.hp).to(self.device)
        loop = RoundLoop(self.alg, model, self, evalsets, s.rounds, s.seed, s.client_fraction,
                         RoundCheckpoints(self.checkpoint_path, self.device, self.log), self._append_record,
                         s.run_info, self.log, engine="flower")
        res = loop.run()
        result = {"history": res.history, "final_weights": res.final_weights, "best_weights": res.best_weights,
                  "best_round": res.best_round, "resumed_from": res.resumed_from,
                  "extra": {"refused": self.refused, "dropped": self.dropped, "engine": "flower"}}
        atomic_torch_save(result, self.work / contract.FLOWER_RESULT_FILE)
        return result


@app.main()
def main(grid: Grid, context: Context) -> None:
    raw = context.run_config.get(M.RUN_SPEC, "")
    if not raw:
        print("fedccrl ServerApp: the run config has no 'spec'; start runs with fedccrl_flower.run "
              "(or flwr run --run-config <spec.toml>)", file=sys.stderr, flush=True)
        raise SystemExit(2)
    spec = ServerSpec.from_dict(json.loads(str(raw)))
    FlowerServer(grid, spec, report_dir=report_dir(spec.work_dir, context.run_id)).run()


def report_dir(work_dir: str | Path, run_id: int) -> Path:
    return contract.flower_report_dir(work_dir, run_id)


__all__ = ["FlowerServer", "RoundFailure", "ServerSpec", "app", "load_evalsets"]
