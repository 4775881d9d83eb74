"""train.fediir: FedIIR's hyperparameters; the algorithm is fedccrl_core/algorithms/fediir.py.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import ClassVar

from fedccrl_core.foundation.hparams import HParams, hp


class FedIIRParams(HParams):
    """train.fediir."""

    dp_refusal: ClassVar[str] = (
        "FedIIR uploads each client's mean classifier gradient beside its weights, which train.privacy neither clips "
        "nor noises, and its server keeps their moving average, a rule of its own beside Eq. 2"
    )

    gamma: float = hp(
        0.001,
        "gradient-alignment penalty weight: reference hparams_registry PACS 1e-3 (VLCS 5e-3, "
        "OfficeHome 5e-4); FedCCRL reference 0.001",
        ge=0,
    )
    ema: float = hp(
        0.95,
        "moving-average factor of the mean classifier gradient g_bar: reference and FedCCRL reference default 0.95",
        ge=0,
        le=1,
    )
