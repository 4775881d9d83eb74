"""Algorithm registry: name -> class, from the explicit imports below (no import side effects, no names resolved
at run time). REGISTERED lists the classes in the order of fedccrl_core/algorithm_params/__init__.py's PARAMS,
the torch-free list of their hyperparameters that params.yaml's validation reads; tests/test_params_registry.py
checks that the two agree (the same names, each class's `Params` the one registered under its name).

Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms.base import Algorithm
from fedccrl_core.algorithms.ccst import CCST
from fedccrl_core.algorithms.fedadg import FedADG
from fedccrl_core.algorithms.fedalign import FedAlign
from fedccrl_core.algorithms.fedavg import FedAvg
from fedccrl_core.algorithms.fedbn import FedBN
from fedccrl_core.algorithms.fedccrl import FedCCRL
from fedccrl_core.algorithms.fedfd import FedFD
from fedccrl_core.algorithms.fedfd_a import FedFDA
from fedccrl_core.algorithms.fediir import FedIIR
from fedccrl_core.algorithms.fedomg import FedCCRLOMG, FedOMG
from fedccrl_core.algorithms.fedprox import FedProx
from fedccrl_core.algorithms.fedsr import FedSR
from fedccrl_core.algorithms.ga import GA
from fedccrl_core.algorithms.silobn import SiloBN
from fedccrl_core.foundation.hparams import HParams

REGISTERED: tuple[type[Algorithm], ...] = (
    FedCCRL,
    FedAvg,
    FedProx,
    CCST,
    FedADG,
    GA,
    FedSR,
    FedIIR,
    FedAlign,
    FedBN,
    SiloBN,
    FedFD,
    FedFDA,
    FedOMG,
    FedCCRLOMG,
)

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in REGISTERED}


def algorithm_class(name: str) -> type[Algorithm]:
    """The class of the registered algorithm `name`; ValueError naming the registered ones for any other name."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def load_model(path, map_location: str = "cpu"):
    """checkpoint.load_model with every registered algorithm's model builder (FedSR's head, FedIIR's buffers, ...)."""
    from fedccrl_core.learning import model_file as checkpoint

    return checkpoint.load_model(path, map_location, {name: cls.build_model for name, cls in ALGORITHMS.items()})


def build_algorithm(name: str, local: LocalConfig, hparams: HParams | dict | None = None) -> Algorithm:
    """The registered algorithm `name` (train.algorithms, `--algorithm`, a Flower spec's) with these settings."""
    return algorithm_class(name)(local, hparams)


__all__ = ["ALGORITHMS", "REGISTERED", "algorithm_class", "build_algorithm", "load_model"]
