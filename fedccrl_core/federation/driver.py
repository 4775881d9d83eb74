"""One held-out training on the in-process engine, set up in one place: `HeldOutRun` describes it (the built
algorithm and model, the source clients, the evaluation sets, the run's settings), `train` runs it and returns
the engine's `RunResult`. The train stage (jobs.py `run_one`), the benchmarks, the scripts and the tests (but
the engine's own) train through `train`; `build_seeded_model` builds the model as every run does (the Flower
ServerApp included).

A caller that needs the engine's parts replaced (the scale benchmark times each phase of a round, a test counts
the uploads) passes `engine=`, a subclass of `InProcessEngine` that names its own parts (`transport_class`,
`checkpoints_class`, `loop_class`).


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fedccrl_core.algorithms.base import Algorithm
from fedccrl_core.federation.engine import InProcessEngine
from fedccrl_core.federation.loop import EvalSets, RunResult
from fedccrl_core.federation.round_record import RoundRecord, SpentRecord
from fedccrl_core.learning.clients import ClientData
from fedccrl_core.learning.models import FedModel


def build_seeded_model(
    alg: Algorithm, backbone: str, num_classes: int, pretrained: str, seed: int, device="cpu"
) -> FedModel:
    """The run's model: torch's global generator seeded with the run seed, then `alg.build_model`, on `device`."""
    torch.manual_seed(seed)
    model = alg.build_model(backbone, num_classes, pretrained, alg.hp)
    model.to(device)  # in place: a module moves its own parameters
    return model


@dataclass(frozen=True)
class HeldOutRun:
    """One held-out training: what the in-process engine trains and evaluates, and the run's settings
    (params.yaml train.client_fraction, train.concurrent_clients, train.client_state). `checkpoint_path`:
    the round checkpoint (federation/checkpoints.py), None for none; `run_info`: what a checkpoint must
    match to be resumed."""

    algorithm: Algorithm
    model: torch.nn.Module
    clients: list[ClientData]
    evalsets: EvalSets  # EvalSets.for_target
    rounds: int
    seed: int
    client_fraction: float = 1.0
    checkpoint_path: str | Path | None = None
    concurrent_clients: int | str = "auto"
    client_state: str = "persistent"
    run_info: dict | None = None


def load_clients(shards: Path, pools: Path, domains: list[str], device) -> list[ClientData]:
    """The clients of `domains` in the shard folder `shards`, each with its statistics pool from `pools` (a mixed
    client without its rows of another domain), images read when sampled."""
    from fedccrl_core.data.manifest import MIXED, load_manifest
    from fedccrl_core.data.pools import STALE, load_pool
    from fedccrl_core.data.shards import load_client
    from fedccrl_core.learning.clients import ClientData

    clients = []
    for entry in load_manifest(shards).clients:
        held_out = [d for d in (entry.domain_counts or {entry.domain: 1}) if d not in domains]
        if entry.domain != MIXED and entry.domain not in domains:
            continue
        s = load_client(shards, entry.id, exclude_domain=held_out[0] if held_out else None, mmap=True)
        if not len(s.train_y):
            continue  # a mixed client holding only the held-out domain
        mu, sigma = load_pool(pools, entry.id)
        if s.train_rows is not None:
            mu, sigma = mu[s.train_rows], sigma[s.train_rows]
        if len(mu) != len(s.train_y):
            raise ValueError(
                f"{pools}/{entry.id}.npz: {len(mu)} statistics for {len(s.train_y)} training samples ({STALE})"
            )
        clients.append(
            ClientData.from_numpy(
                s.client_id, s.domain, s.train_x, s.train_y, s.val_x, s.val_y, device, mu, sigma, lazy=True
            )
        )  # images read when sampled: memory flat in the clients
    return clients


@dataclass(frozen=True)
class RunData:
    """The data of one held-out run on this machine: the source clients (with their statistics pools) and the
    evaluation sets (their val splits and the held-out domain's images)."""

    clients: list[ClientData]
    evalsets: EvalSets

    @classmethod
    def load(
        cls,
        shards: Path,
        pools: Path,
        target: str,
        device,
        batch_size: int = 256,
        sources: list[str] | None = None,
        private: bool = False,
    ) -> RunData:
        """From the shard and pool folders: the clients of `sources` (default: every domain but `target`) and the
        evaluation sets, the target's images as EvalSets keeps them (its one copy): under train.privacy (`private`)
        its val rows only (shards.held_out_parts)."""
        from fedccrl_core.data.manifest import load_manifest
        from fedccrl_core.data.shards import load_domain_test

        if sources is None:
            sources = [d for d in load_manifest(shards).domains if d != target]
        clients = load_clients(Path(shards), Path(pools), sources, device)
        tx, ty = load_domain_test(shards, target, private)
        return cls(clients, EvalSets.for_target(clients, tx, ty, batch_size, device))


def held_out_run(
    alg: Algorithm,
    data: RunData,
    backbone: str,
    num_classes: int,
    pretrained: str,
    seed: int,
    device,
    rounds: int,
    **settings,
) -> HeldOutRun:
    """The run of `alg` on `data`: its model seeded as every run's (`build_seeded_model`), `settings` HeldOutRun's
    other fields (client_fraction, checkpoint_path, concurrent_clients, client_state, run_info)."""
    model = build_seeded_model(alg, backbone, num_classes, pretrained, seed, device)
    return HeldOutRun(alg, model, data.clients, data.evalsets, rounds, seed, **settings)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def train(
    run: HeldOutRun,
    on_round: Callable[[RoundRecord | SpentRecord], None] | None = None,
    log: Callable[[str], None] = _stderr,
    engine: type[InProcessEngine] = InProcessEngine,
) -> RunResult:
    """Train `run` on the in-process engine (or on `engine`, a subclass with parts of its own). `on_round`
    receives each round's record as it is logged; `log` every progress line."""
    return engine(
        run.algorithm,
        run.model,
        run.clients,
        run.evalsets,
        run.rounds,
        run.seed,
        run.client_fraction,
        run.checkpoint_path,
        on_round=on_round,
        run_info=run.run_info,
        log=log,
        concurrent_clients=run.concurrent_clients,
        client_state=run.client_state,
    ).run()
