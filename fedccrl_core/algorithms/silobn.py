"""SiloBN (Andreux et al., MICCAI DART/DCL 2020, "Siloed Federated Learning for Multi-Centric
Histopathology Datasets"), as the FedFD-A paper uses it (fedfd-a.txt section 4.1, Table 1): "SiloBN
only preserves BN statistics" locally; the BN affine parameters gamma, beta and every other
parameter are aggregated with FedAvg (Eq. 2).

Local training is cross-entropy (Eq. 1) with the paper's SGD setting (LocalBNParams, fedccrl_core/algorithm_params/local_bn.py).
The global model evaluates the held-out domain with the global statistics mu_G, sigma_G, the Eq. 2
average of the clients' local running statistics (section 3.1; Table 3 (a), "Inference: global
statistics"). SiloBN's own paper instead re-estimates the statistics on the new center's data, which
would need target data.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from fedccrl_core.algorithm_params.local_bn import SiloBNParams
from fedccrl_core.algorithms.local_bn import LocalBNAlgorithm


class SiloBN(LocalBNAlgorithm):
    name = "silobn"
    Params = SiloBNParams
    framework = "silobn"
