"""The registry of algorithms' hyperparameters: PARAMS, algorithm name -> its `train.<algorithm>` declaration of
params.yaml, without torch (docs/contributing.md, "Add an algorithm").

One module per algorithm holds its pydantic `Params` (fields with the paper equations they come from); `train`
holds the settings every algorithm shares (TrainSettings, LocalConfig). params.yaml's validation
(pipeline/fedccrl_pipeline/params.py) reads the declarations from here, so a stage that trains nothing validates the
whole file without importing torch, and the docs' hyperparameter tables are generated from it
(scripts/mkdocs_hooks.py). The classes are registered by name in fedccrl_core/algorithms/__init__.py (REGISTERED),
in the same order; tests/test_params_registry.py checks that the two lists agree.


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
