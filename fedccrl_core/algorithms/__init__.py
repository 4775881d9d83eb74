"""Algorithm registry: name -> class, derived from the one list of algorithms, fedccrl_core/algorithm_params/
__init__.py's PARAMS: each algorithm's `Params` names its class ("module:Class", `HParams.algorithm`), imported
here explicitly (no import side effects), and checked to be an Algorithm of that name whose `Params` is that class.

Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import importlib

from fedccrl_core.algorithm_params import PARAMS
from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms.base import Algorithm
from fedccrl_core.foundation.hparams import HParams


def algorithm_class(name: str) -> type[Algorithm]:
    """The class of the registered algorithm `name`: the one its Params names. ValueError for a name PARAMS lacks;
    ImportError for a Params whose `algorithm` is not an Algorithm named `name` with these Params."""
    if name not in PARAMS:
        raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(PARAMS)}")
    params = PARAMS[name]
    where = f"{params.__module__}.{params.__qualname__}.algorithm = {params.algorithm!r}"
    module, _, qualname = params.algorithm.partition(":")
    if not module or not qualname:
        raise ImportError(f"{where}: name the algorithm class as 'module:Class'")
    cls = getattr(importlib.import_module(module), qualname, None)
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ImportError(f"{where}: not an Algorithm class")
    if cls.name != name or cls.Params is not params:
        raise ImportError(
            f"{where}: {cls.__qualname__} has name {cls.name!r} and Params {cls.Params.__qualname__}; registered as "
            f"{name!r} with {params.__qualname__}"
        )
    return cls


ALGORITHMS: dict[str, type[Algorithm]] = {name: algorithm_class(name) for name in PARAMS}


def load_model(path, map_location: str = "cpu"):
    """checkpoint.load_model with every registered algorithm's model builder (FedSR's head, FedIIR's buffers, ...)."""
    from fedccrl_core.learning import model_file as checkpoint

    return checkpoint.load_model(path, map_location, {name: cls.build_model for name, cls in ALGORITHMS.items()})


def build_algorithm(name: str, local: LocalConfig, hparams: HParams | dict | None = None) -> Algorithm:
    """The registered algorithm `name` (train.algorithms, `--algorithm`, a Flower spec's) with these settings."""
    return algorithm_class(name)(local, hparams)


__all__ = ["ALGORITHMS", "algorithm_class", "build_algorithm", "load_model"]
