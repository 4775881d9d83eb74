"""The in-process engine: Algorithm 1's round loop (federation/loop.py) with every client in this
process. `InProcessTransport` is the only part that differs from the Flower ServerApp: it calls each
client's `client_upload` / `local_train` directly and keeps the clients' states.

Client state (Adam moments and LR schedule, FedBN/SiloBN's local BN layers in `extra`) follows
`train.client_state`:
  persistent  (default; the reference FedCCRL code keeps one optimizer per client across rounds)
              a client's state is loaded only when it is sampled: from memory, or, once a checkpoint
              holds it, from its record in a round's state file (federation/checkpoints.py); after
              training it is appended to this round's state file and leaves memory; under train.privacy the
              state files go when the run ends (RoundCheckpoints.drop_client_states: they were never released);
  stateless   a fresh optimizer and schedule every round (cross-device FL, FedDG-Bench); nothing
              per client is kept or checkpointed.


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from fedccrl_core.algorithms.base import Algorithm
from fedccrl_core.federation.checkpoints import RoundCheckpoint, RoundCheckpoints
from fedccrl_core.federation.concurrent import Interleaver, Task
from fedccrl_core.federation.loop import EvalSets, RoundLoop, RunResult
from fedccrl_core.federation.round_record import RoundRecord, SpentRecord
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.seeding import derive_seed, numpy_rng, seed_everything, torch_generator
from fedccrl_core.learning.clients import ClientData, ClientState
from fedccrl_core.privacy.charged import ChargedRelease


def concurrent_width(setting: int | str, device: torch.device, n_clients: int, alg: Algorithm) -> int:
    """How many clients train at once (params.yaml train.concurrent_clients). 'auto': 1 on the CPU (the
    cores are already busy with one client), up to 4 on CUDA, where one client's batch of 32 leaves the
    GPU mostly idle (4 is a starting point, not a measured optimum). Algorithms that override
    `local_train` have no step generator to interleave and always run one client at a time."""
    width = (4 if device.type == "cuda" else 1) if setting == "auto" else int(setting)  # >= 1: params.yaml's schema
    if type(alg).local_train is not Algorithm.local_train:
        return 1
    return max(1, min(width, n_clients))


class InProcessTransport:
    def __init__(
        self,
        algorithm: Algorithm,
        model: torch.nn.Module,
        clients: list[ClientData],
        seed: int,
        concurrent_clients: int | str = "auto",
        client_state: str = "persistent",
        log: Callable[[str], None] = print,
        rounds: int = 0,
    ):
        self.alg, self.model, self.seed, self.log, self.rounds = algorithm, model, seed, log, rounds
        self.clients = {c.client_id: c for c in clients}
        self.ids = sorted(self.clients)
        self.concurrent_clients, self.client_state = concurrent_clients, client_state
        self.device = next(model.parameters()).device
        self._interleaver: Interleaver | None = None
        self._states: dict[str, ClientState] = {}  # in memory: never checkpointed, or trained this round
        self._trained: list[str] = []
        self._checkpoints: RoundCheckpoints | None = None

    # ---- client state -------------------------------------------------------------------------
    def restore(self, checkpoints: RoundCheckpoints | None, ck: RoundCheckpoint | None) -> None:
        self._checkpoints, self._states = checkpoints, {}
        if ck is not None and ck.states is not None:  # a checkpoint of the single-file format (before state files)
            self._states = {k: ClientState.from_dict(v) for k, v in ck.states.items()}

    def _state(self, cid: str) -> ClientState:
        if self.client_state == "stateless":
            return ClientState()
        if cid not in self._states:
            saved = self._checkpoints.load_client(cid) if self._checkpoints is not None else None
            self._states[cid] = ClientState.from_dict(saved) if saved is not None else ClientState()
        return self._states[cid]

    def client_states(self) -> dict[str, dict]:
        """The states of this round's clients that are not yet in a state file (no checkpoint: none)."""
        if self.client_state == "stateless" or self._checkpoints is None:
            return {}
        return {cid: self._states.pop(cid).to_dict() for cid in self._trained if cid in self._states}

    # ---- the two client-side phases -----------------------------------------------------------
    def collect_uploads(self, rnd: int, charged: ChargedRelease | None = None) -> dict:
        """Lines 3-6: every client's statistics enter the pool. `charged` is not checked here: in-process, a client's
        data cannot change within a run, so known_n are the sizes its uploads use, and no release exceeds it."""
        return {
            cid: (
                self.alg.client_upload(self.clients[cid], numpy_rng(self.seed, "upload", rnd, cid))
                if self.alg.upload_wanted(cid)
                else None
            )
            for cid in self.ids
        }

    def announced_n(self, sampled):
        return {cid: self.alg.sample_count(self.clients[cid]) for cid in sampled}

    def known_n(self):
        return self.announced_n(self.ids)

    def least_clients(self) -> int:
        return len(self.ids)  # every client answers in-process

    def train(self, rnd, sampled, global_w, payloads, fold):
        replies = []
        for j, reply in enumerate(self._local_replies(rnd, sampled, global_w, payloads)):
            fold(reply)  # Eq. 2 streamed: this client's weights are summed now, not kept
            replies.append(dataclasses.replace(reply, weights={}))
            cid = reply.client_id
            if self._checkpoints is not None and self.client_state == "persistent" and cid in self._states:
                self._checkpoints.write_client(cid, rnd, self._states.pop(cid).to_dict())  # leaves memory now
            self.log(
                f"round {rnd}/{self.rounds} client {j + 1}/{len(sampled)} {reply.client_id}: "
                + contract.reply_summary(reply.metrics)
            )
        self._trained = list(sampled)
        return replies

    def round_record(self, rnd: int) -> dict:
        return {}

    def _interleaved(self, width: int) -> Interleaver:
        if self._interleaver is None or self._interleaver.width != width:
            self._interleaver = Interleaver(self.model, width, self.device)
        return self._interleaver

    def _client_args(self, rnd, cid, global_w, payload) -> tuple:
        """One client's local-training arguments after the model, with its per-(seed, round, client)
        generators: the same in the sequential and the interleaved mode."""
        return (
            self.clients[cid].resident(),
            self._state(cid),
            global_w,
            payload,  # lazy: its images now
            torch_generator(self.seed, "augment", rnd, cid, device=self.device),
            numpy_rng(self.seed, "shuffle", rnd, cid),
        )

    def _local_replies(self, rnd, sampled, global_w, payloads):
        """Algorithm 1 lines 8-22: each sampled client's Reply, in order; one client after another, or
        several interleaved (federation/concurrent.py; the same replies)."""
        width = concurrent_width(self.concurrent_clients, self.device, len(sampled), self.alg)
        if width > 1:

            def starter(cid):
                return lambda model: self.alg.local_train_steps(
                    model, *self._client_args(rnd, cid, global_w, payloads.get(cid))
                )

            yield from self._interleaved(width).run(
                [Task(cid, derive_seed(self.seed, "local", rnd, cid), starter(cid)) for cid in sampled]
            )
            return
        for cid in sampled:
            seed_everything(derive_seed(self.seed, "local", rnd, cid))
            yield self.alg.local_train(self.model, *self._client_args(rnd, cid, global_w, payloads.get(cid)))


class InProcessEngine:
    """RoundLoop over an InProcessTransport, built by federation/driver.py `train`. Its three parts are named
    here, so that a subclass can replace one (the scale benchmark times each phase of a round)."""

    transport_class: type[InProcessTransport] = InProcessTransport
    checkpoints_class: type[RoundCheckpoints] = RoundCheckpoints
    loop_class: type[RoundLoop] = RoundLoop

    def __init__(
        self,
        algorithm: Algorithm,
        model: torch.nn.Module,
        clients: list[ClientData],
        evalsets: EvalSets,
        rounds: int,
        seed: int,
        client_fraction: float = 1.0,
        checkpoint_path: str | Path | None = None,
        on_round: Callable[[RoundRecord | SpentRecord], None] | None = None,
        run_info: dict | None = None,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
        concurrent_clients: int | str = "auto",
        client_state: str = "persistent",
    ):
        self.alg, self.model = algorithm, model
        device = next(model.parameters()).device
        self.transport = self.transport_class(
            algorithm, model, clients, seed, concurrent_clients, client_state, log, rounds
        )
        self.checkpoints = self.checkpoints_class(checkpoint_path, device, log) if checkpoint_path else None
        self.loop = self.loop_class(
            algorithm,
            model,
            self.transport,
            evalsets,
            rounds,
            seed,
            client_fraction,
            self.checkpoints,
            on_round,
            run_info,
            log,
            engine="inprocess",
        )

    def run(self) -> RunResult:
        return self.loop.run()
