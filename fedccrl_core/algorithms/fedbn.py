"""FedBN (Li et al., ICLR 2021, "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization"), as the FedFD-A paper uses it (fedfd-a.txt section 4.1, Table 1): "FedBN retains both
BN statistics and affine parameters" locally; every other parameter is aggregated with FedAvg (Eq. 2).

Local training is cross-entropy (Eq. 1) with the paper's SGD setting (LocalBNParams, fedccrl_core/algorithm_params/local_bn.py).
The held-out domain has no BN layers of its own, so the global model's BN statistics and affine
parameters are the Eq. 2 average of the clients' local ones (see local_bn.py). FedBN itself
evaluates each client on its own domain with its own BN and never uploads BN layers; here they are
uploaded so that the server can form that global model.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from fedccrl_core.algorithm_params.local_bn import FedBNParams
from fedccrl_core.algorithms.local_bn import LocalBNAlgorithm


class FedBN(LocalBNAlgorithm):
    name = "fedbn"
    Params = FedBNParams
    framework = "fedbn"
