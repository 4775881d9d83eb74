"""Every algorithm's hyperparameters (`train.<algorithm>` of params.yaml), by algorithm name, without torch.

One module per algorithm holds its pydantic `Params` (fields with the paper equations they come from); `train`
holds the settings every algorithm shares (TrainSettings, LocalConfig). The algorithms (fedccrl_core/algorithms/)
train with these declarations; params.yaml's validation (pipeline/fedccrl_pipeline/params.py) reads them from here, so a stage that
trains nothing validates the whole file without importing torch. fedccrl_core/algorithms/__init__.py checks that
its ALGORITHMS lists the same names, in the same order, with the same `Params`.


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
from fedccrl_core.algorithm_params.local_bn import LocalBNParams
from fedccrl_core.foundation.hparams import HParams

# algorithm name -> its train.<name> declaration, in the registry's order (FedBN and SiloBN share LocalBNParams)
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
    "fedbn": LocalBNParams,
    "silobn": LocalBNParams,
    "fedfd": FDParams,
    "fedfd_a": FedFDAParams,
    "fedomg": FedOMGParams,
    "fedccrl_omg": FedCCRLOMGParams,
}
