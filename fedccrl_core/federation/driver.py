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
