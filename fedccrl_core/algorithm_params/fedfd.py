"""train.fedfd: FedFD's hyperparameters (fedfd-a.txt section 3.2), the base of train.fedfd_a; the algorithm is
fedccrl_core/algorithms/fedfd.py.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from fedccrl_core.algorithm_params.local_bn import LocalBNParams
from fedccrl_core.foundation.hparams import hp


class FDParams(LocalBNParams):
    """train.fedfd (fedfd-a.txt section 3.2), and the base of train.fedfd_a."""

    framework: Literal["silobn", "fedbn", "fedavg"] = hp(
        "silobn", "the BN tensors kept local (Table 1); section 4.1 uses SiloBN"
    )
    lambda1: float = hp(0.1, "L_CACL weight, Eq. 5 (section 4.1); Eq. 5 weighs L_CE by 1 - lambda1", ge=0, le=1)
    lambda2: float = hp(4.0, "L_CAFL weight, Eq. 5 (section 4.1)", ge=0)
    cafl_reduction: Literal["mean", "sum"] = hp(
        "mean",
        "our choice: mean over feature dims (Eq. 3 / V); sum = Eq. 3 "
        "as printed collapses training at lambda2 4.0 (docs/algorithms/local-bn.md)",
    )
    statistics: Literal["mixed", "global", "instance"] = hp(
        "mixed", "Table 2 ablation: mixed (Eq. 2) | global (u = 0) | instance (u = 1)"
    )
    u_sampling: Literal["random", "fixed"] = hp(
        "random", "Table 2 ablation: random (u ~ U(u_low, u_high) per channel, Eq. 2) | fixed (u = u_fixed)"
    )
    u_low: float = hp(0.0, "Eq. 2: U(0, 1) (Table 9 tries U(0, 0.5), U(0.5, 1), U(-0.1, 1.1))")
    u_high: float = hp(1.0, "Eq. 2: U(0, 1); >= u_low")
    u_fixed: float = hp(0.5, "Table 2: 'Global & instance fixed: u = 0.5'")
    local_statistics: Literal["instance", "batch"] = hp(
        "instance", "section 3.2: instance (the paper's choice) | batch"
    )
    diversification: bool = hp(True, "false: L_CE only, the framework alone (Table 3 (c1) with the adapter)")

    @field_validator("u_high")
    @classmethod
    def _u_range(cls, v, info):
        low = info.data.get("u_low")
        if low is not None and low > v:
            raise ValueError(f"must be >= u_low ({low:g}): u ~ U(u_low, u_high), Eq. 2")
        return v
