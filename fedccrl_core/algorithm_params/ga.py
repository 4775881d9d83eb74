"""train.ga: GA's hyperparameters; the algorithm is fedccrl_core/algorithms/ga.py.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import ClassVar, Literal

from fedccrl_core.foundation.hparams import HParams, hp


class GAParams(HParams):
    """train.ga."""

    dp_refusal: ClassVar[str] = (
        "GA weighs the clients by their generalization gaps, its own rule instead of Eq. 2; DP-FedAvg replaces Eq. 2 "
        "only"
    )

    step_size: float = hp(
        0.05,
        "d, decayed linearly over rounds: FedCCRL reference GA server default "
        "(--step_size 0.05); the GA reference's argparse default is 0.2",
        gt=0,
        le=1,
    )
    gap_data: Literal["val", "train"] = hp(
        "val", "data of each client's generalization gap: val = the GA reference (each site's val split)"
    )
