"""train.fedprox: FedProx's hyperparameters; the algorithm is fedccrl_core/algorithms/fedprox.py.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from fedccrl_core.foundation.hparams import HParams, hp


class FedProxParams(HParams):
    """train.fedprox."""

    mu: float = hp(0.01, "their Eq. 2: proximal term weight; the FedCCRL reference's FedProx default 0.01", ge=0)
