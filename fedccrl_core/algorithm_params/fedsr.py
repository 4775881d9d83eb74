"""train.fedsr: FedSR's hyperparameters; the algorithm is fedccrl_core/algorithms/fedsr.py.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import Literal

from fedccrl_core.foundation.hparams import HParams, hp


class FedSRParams(HParams):
    """train.fedsr."""

    alpha_l2r: float = hp(
        0.01, "weight of l_L2R: official README (PACS run) --L2R_coeff 0.01; FedCCRL reference 1e-2", ge=0
    )
    alpha_cmi: float = hp(
        0.001, "weight of l_CMI: official README (PACS run) --CMI_coeff 0.001 (argparse default 5e-4)", ge=0
    )
    z_dim: int | None = hp(
        None, "size of z; null = the encoder's feature dim (1280 for MobileNetV3-Large), as in the official code", ge=1
    )
    l2r: Literal["norm", "squared"] = hp(
        "norm",
        "l_L2R: norm = the official code's mean ||z|| (Table 1 was tuned "
        "with it); squared = the paper's printed E||z||^2",
    )
