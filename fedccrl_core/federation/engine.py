"""The in-process engine: Algorithm 1's round loop with all clients in one process.

Every round is checkpointed atomically; a rerun resumes after the last complete round and, since
every random draw is derived from (seed, round, client), ends with the same metrics as an
uninterrupted run (on the CPU).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from fedccrl_core.algorithms.base import Algorithm, Reply
from fedccrl_core.federation.concurrent import Interleaver, Task
from fedccrl_core.checkpoint import atomic_torch_save
from fedccrl_core.evaluation import accuracy
from fedccrl_core.federation.client import ClientData, ClientState
from fedccrl_core.seeding import derive_seed, numpy_rng, seed_everything, torch_generator


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("params.yaml: train.device is 'cuda' but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"params.yaml: train.device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


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


def concurrent_width(setting: int | str, device: torch.device, n_clients: int, alg: Algorithm) -> int:
    """How many clients train at once (params.yaml train.concurrent_clients). 'auto': 1 on the CPU (the
    cores are already busy with one client), up to 4 on CUDA, where one client's batch of 32 leaves the
    GPU mostly idle (4 is a starting point, not a measured optimum). Algorithms that override
    `local_train` have no step generator to interleave and always run one client at a time."""
    if setting == "auto":
        width = 4 if device.type == "cuda" else 1
    elif isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        width = setting
    else:
        raise ValueError(f"params.yaml: train.concurrent_clients must be 'auto' or an integer >= 1, got {setting!r}")
    if type(alg).local_train is not Algorithm.local_train:
        return 1
    return max(1, min(width, n_clients))


def sample_clients(client_ids: list[str], fraction: float, seed: int, rnd: int) -> list[str]:
    if not 0 < fraction <= 1:
        raise ValueError(f"params.yaml: train.client_fraction must be in (0, 1], got {fraction}")
    k = max(1, round(fraction * len(client_ids)))
    if k == len(client_ids):
        return list(client_ids)
    idx = numpy_rng(seed, "sample", rnd).choice(len(client_ids), size=k, replace=False)
    return [client_ids[i] for i in sorted(idx)]


@dataclass
class EvalSets:
    """Source validation (union of every client's val split) and the held-out target domain."""

    val_x: torch.Tensor
    val_y: torch.Tensor
    target_x: torch.Tensor
    target_y: torch.Tensor
    batch_size: int = 256


@dataclass
class RunResult:
    history: list[dict]
    final_weights: dict
    best_weights: dict
    best_round: int
    resumed_from: int = 0
    extra: dict = field(default_factory=dict)


def _weighted_mean(replies: list[Reply], key: str) -> float | None:
    vals = [(r.metrics[key], r.n) for r in replies if key in r.metrics]
    if not vals:
        return None
    return sum(v * n for v, n in vals) / sum(n for _, n in vals)


class InProcessEngine:
    def __init__(self, algorithm: Algorithm, model: torch.nn.Module, clients: list[ClientData], evalsets: EvalSets,
                 rounds: int, seed: int, client_fraction: float = 1.0, checkpoint_path: str | Path | None = None,
                 on_round: Callable[[dict], None] | None = None, run_info: dict | None = None,
                 log=lambda msg: print(msg, file=sys.stderr, flush=True), concurrent_clients: int | str = "auto"):
        self.alg, self.model, self.clients = algorithm, model, {c.client_id: c for c in clients}
        self.concurrent_clients = concurrent_clients
        self._interleaver: Interleaver | None = None
        self.evalsets, self.rounds, self.seed = evalsets, rounds, seed
        self.client_fraction = client_fraction
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        self.on_round = on_round or (lambda rec: None)
        self.run_info = dict(run_info or {})
        self.log = log
        self.device = next(model.parameters()).device

    # ---- checkpoints ------------------------------------------------------------------
    def _load_checkpoint(self):
        if self.checkpoint_path is None or not self.checkpoint_path.is_file():
            return None
        try:
            ck = torch.load(self.checkpoint_path, map_location=self.device, weights_only=False)
        except Exception as e:
            self.log(f"checkpoint {self.checkpoint_path} unreadable ({e.__class__.__name__}); starting from round 1")
            return None
        if ck.get("run_info") != self.run_info:
            self.log(f"checkpoint {self.checkpoint_path} belongs to another configuration; starting from round 1")
            return None
        own = self.model.state_dict()
        if set(ck["global"]) != set(own) or any(ck["global"][k].shape != own[k].shape for k in own):
            self.log(f"checkpoint {self.checkpoint_path} does not fit this model; starting from round 1")
            return None
        return ck

    def _save_checkpoint(self, rnd, global_w, best_w, best_round, best_val, states, history):
        if self.checkpoint_path is None:
            return
        atomic_torch_save({"round": rnd, "global": global_w, "best": best_w, "best_round": best_round,
                           "best_val": best_val, "states": {k: s.to_dict() for k, s in states.items()},
                           "history": history, "run_info": self.run_info,
                           "server_state": self.alg.server_state()}, self.checkpoint_path)

    # ---- several clients at once (federation/concurrent.py) ----------------------------
    def _interleaved(self, width: int) -> Interleaver:
        if self._interleaver is None or self._interleaver.width != width:
            self._interleaver = Interleaver(self.model, width, self.device)
        return self._interleaver

    def _client_args(self, rnd, cid, states, global_w, payload) -> tuple:
        """One client's local-training arguments after the model, with its per-(seed, round, client)
        generators: the same in the sequential and the interleaved mode."""
        return (self.clients[cid], states[cid], global_w, payload,
                torch_generator(self.seed, "augment", rnd, cid, device=self.device),
                numpy_rng(self.seed, "shuffle", rnd, cid))

    def _local_replies(self, rnd, sampled, states, global_w, payloads):
        """Algorithm 1 lines 8-22: each sampled client's Reply, in order; one client after another, or
        several interleaved (federation/concurrent.py; the same replies)."""
        width = concurrent_width(self.concurrent_clients, self.device, len(sampled), self.alg)
        if width > 1:
            def starter(cid):
                return lambda model: self.alg.local_train_steps(
                    model, *self._client_args(rnd, cid, states, global_w, payloads.get(cid)))
            yield from self._interleaved(width).run(
                [Task(cid, derive_seed(self.seed, "local", rnd, cid), starter(cid)) for cid in sampled])
            return
        for cid in sampled:
            seed_everything(derive_seed(self.seed, "local", rnd, cid))
            yield self.alg.local_train(self.model, *self._client_args(rnd, cid, states, global_w, payloads.get(cid)))

    # ---- Algorithm 1 ------------------------------------------------------------------
    def run(self) -> RunResult:
        ids = sorted(self.clients)
        seed_everything(derive_seed(self.seed, "init"))
        global_w = {k: v.detach().clone() for k, v in self.model.state_dict().items()}  # line 1
        states = {cid: ClientState() for cid in ids}
        history, best_w, best_round, best_val, start = [], global_w, 0, -1.0, 1
        ck = self._load_checkpoint()
        if ck is not None:
            global_w, best_w, best_round, best_val = ck["global"], ck["best"], ck["best_round"], ck["best_val"]
            states = {k: ClientState.from_dict(v) for k, v in ck["states"].items()}
            history, start = ck["history"], ck["round"] + 1
            self.alg.load_server_state(ck.get("server_state") or {})
            self.log(f"resuming from checkpoint after round {ck['round']}")
        w_bytes = nbytes(global_w)
        for rnd in range(start, self.rounds + 1):  # line 2
            t0 = time.perf_counter()
            sampled = sample_clients(ids, self.client_fraction, self.seed, rnd)
            uploads = {cid: self.alg.client_upload(self.clients[cid], numpy_rng(self.seed, "upload", rnd, cid))
                       for cid in ids}  # lines 3-6: every client's statistics enter the pool
            payloads = self.alg.server_payloads(uploads)  # line 7
            replies = []
            for j, (cid, reply) in enumerate(zip(sampled, self._local_replies(rnd, sampled, states, global_w,
                                                                              payloads))):  # lines 8-22
                replies.append(reply)
                self.log(f"round {rnd}/{self.rounds} client {j + 1}/{len(sampled)} {cid}: "
                         f"loss {reply.metrics.get('loss', float('nan')):.4f} acc {reply.metrics['train_acc']:.3f}")
            global_w = self.alg.aggregate(global_w, replies)  # line 23, Eq. 2
            self.model.load_state_dict(global_w)
            ev = self.evalsets
            val_acc = accuracy(self.model, ev.val_x, ev.val_y, ev.batch_size, self.alg.local.mean, self.alg.local.std,
                               fast=self.alg.local.fast)
            tgt_acc = accuracy(self.model, ev.target_x, ev.target_y, ev.batch_size, self.alg.local.mean,
                               self.alg.local.std, fast=self.alg.local.fast)
            if val_acc > best_val:  # training-domain validation (DomainBed)
                best_val, best_round = val_acc, rnd
                best_w = {k: v.detach().clone() for k, v in global_w.items()}
            rec = {"round": rnd, "val_acc": val_acc, "target_acc": tgt_acc,
                   "seconds": time.perf_counter() - t0,
                   "bytes_up": len(replies) * w_bytes + sum(nbytes(u) for u in uploads.values()),
                   "bytes_down": len(replies) * w_bytes + sum(nbytes(payloads.get(c)) for c in sampled)}
            for key in sorted({k for r in replies for k in r.metrics}):
                rec[key] = _weighted_mean(replies, key)
            for r in replies:
                rec[f"train_acc/{r.client_id}"] = r.metrics["train_acc"]
            history.append(rec)
            self.log(f"round {rnd}/{self.rounds}: val_acc {val_acc:.4f} target_acc {tgt_acc:.4f} "
                     f"({rec['seconds']:.1f}s)")
            self.on_round(rec)  # log first: a crash before the checkpoint re-logs identical values
            self._save_checkpoint(rnd, global_w, best_w, best_round, best_val, states, history)
        return RunResult(history, global_w, best_w, best_round, resumed_from=start - 1)
