"""Algorithm registry: name -> class. Every algorithm is listed here explicitly (no import side effects).

Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from fedccrl_core.algorithm_params import PARAMS
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

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls
    for cls in (
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
}
if {n: cls.Params for n, cls in ALGORITHMS.items()} != PARAMS or list(ALGORITHMS) != list(PARAMS):
    raise ImportError(
        "fedccrl_core.algorithm_params.PARAMS (params.yaml's validation) must list the algorithms of "
        "ALGORITHMS, in its order, each with its class's Params"
    )


def load_model(path, map_location: str = "cpu"):
    """checkpoint.load_model with every registered algorithm's model builder (FedSR's head, FedIIR's buffers, ...)."""
    from fedccrl_core.learning import model_file as checkpoint

    return checkpoint.load_model(path, map_location, {name: cls.build_model for name, cls in ALGORITHMS.items()})


def build_algorithm(name: str, local: LocalConfig, hparams: HParams | dict | None = None) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(
            f"params.yaml: train.algorithms has unknown algorithm {name!r}; choose from {', '.join(ALGORITHMS)}"
        )
    return ALGORITHMS[name](local, hparams)


__all__ = ["ALGORITHMS", "build_algorithm", "load_model"]
