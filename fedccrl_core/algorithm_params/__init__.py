"""The registry of algorithms: PARAMS, algorithm name -> its hyperparameters (`train.<algorithm>` of params.yaml),
without torch. It is the one list of algorithms (docs/contributing.md, "Add an algorithm").

One module per algorithm holds its pydantic `Params` (fields with the paper equations they come from), which names
its algorithm class (`HParams.algorithm`, "module:Class"); `train` holds the settings every algorithm shares
(TrainSettings, LocalConfig). params.yaml's validation (pipeline/fedccrl_pipeline/params.py) reads the
declarations from here, so a stage that trains nothing validates the whole file without importing torch;
fedccrl_core/algorithms/__init__.py derives ALGORITHMS (name -> class) from it, and the docs' hyperparameter
tables are generated from it (scripts/mkdocs_hooks.py).


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from fedccrl_core.algorithm_params.ccst import CCSTParams
from fedccrl_core.algorithm_params.fedadg import FedADGParams
from fedccrl_core.algorithm_params.fedalign import FedAlignParams
from fedccrl_core.algorithm_params.fedavg import FedAvgParams
from fedccrl_core.algorithm_params.fedccrl import FedCCRLParams
from fedccrl_core.algorithm_params.fedfd import FDParams
from fedccrl_core.algorithm_params.fedfd_a import FedFDAParams
from fedccrl_core.algorithm_params.fediir import FedIIRParams
from fedccrl_core.algorithm_params.fedomg import FedCCRLOMGParams, FedOMGParams
from fedccrl_core.algorithm_params.fedprox import FedProxParams
from fedccrl_core.algorithm_params.fedsr import FedSRParams
from fedccrl_core.algorithm_params.ga import GAParams
from fedccrl_core.algorithm_params.local_bn import FedBNParams, SiloBNParams
from fedccrl_core.foundation.hparams import HParams

# algorithm name -> its train.<name> declaration, in the order the docs and `--algorithm` listings show
PARAMS: dict[str, type[HParams]] = {
    "fedccrl": FedCCRLParams,
    "fedavg": FedAvgParams,
    "fedprox": FedProxParams,
    "ccst": CCSTParams,
    "fedadg": FedADGParams,
    "ga": GAParams,
    "fedsr": FedSRParams,
    "fediir": FedIIRParams,
    "fedalign": FedAlignParams,
    "fedbn": FedBNParams,
    "silobn": SiloBNParams,
    "fedfd": FDParams,
    "fedfd_a": FedFDAParams,
    "fedomg": FedOMGParams,
    "fedccrl_omg": FedCCRLOMGParams,
}
