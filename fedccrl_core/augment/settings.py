"""M's settings (Eq. 3: CCDT/MixStyle, Alg. 2; DIFP/AugMix, Alg. 3), declared once, without torch: params.yaml
validates train.fedccrl through them (FedCCRLParams inherits them) in stages that import no torch.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import Literal, get_args

from fedccrl_core.foundation.hparams import HParams, hp

# The reference switches of M: auto (follow train.fedccrl.variant), the paper's reading, the reference code's
AugmixReading = Literal["auto", "per_sample", "batch"]
MixstyleVarReading = Literal["auto", "population", "unbiased"]
PoolDrawReading = Literal["auto", "with_replacement", "reference"]
# train.fedccrl.<key>: (the paper's reading, the reference code's)
AUGMENT_SWITCHES: dict[str, tuple[str, ...]] = {
    "augmix": get_args(AugmixReading)[1:],
    "mixstyle_var": get_args(MixstyleVarReading)[1:],
    "pool_draw": get_args(PoolDrawReading)[1:],
}


class AugmentParams(HParams):
    """M's settings (Eq. 3, Alg. 2-3), declared once: the augmentation keys of params.yaml `train.fedccrl`, which
    FedCCRLParams (fedccrl_core/algorithm_params/fedccrl.py) inherits. A switch left `auto` is read from
    train.fedccrl.variant by FedCCRL before M runs; M alone reads `auto` as the paper's reading."""

    alpha: float = hp(0.1, "Alg. 2 (CCDT/MixStyle): lambda ~ Beta(alpha, alpha); Sec. 4.2 alpha = 0.1", gt=0)
    beta: float = hp(
        1.0, "Alg. 3 (DIFP/AugMix): Dirichlet(beta) chain weights and m ~ Beta(beta, beta); Sec. 4.2 beta = 1.0", gt=0
    )
    severity: int = hp(
        3, "Alg. 3: AugMix operation severity; not stated, AugMix's (Hendrycks et al.) default 3", ge=1, le=10
    )
    ccdt: bool = hp(True, "Table 2 ablation: CCDT (MixStyle from the pool) in M")
    difp: bool = hp(True, "Table 2 ablation: DIFP (per-sample AugMix) in M")
    augmix: AugmixReading = hp(
        "auto",
        "Alg. 3: per_sample = each sample its own k ~ U{1,2,3} chains over the 9 ops of O | batch = torchvision's "
        "AugMix() on the batch tensor: one op chain for the whole batch (only the mixing weights per sample), always "
        "3 chains of depth 1-3, all 13 ops, magnitudes from the first 3 bins of linspace(0, max, 10), input cut to "
        "8 bits (reference algorithm/client/fedccrl.py:154-165)",
    )
    mixstyle_var: MixstyleVarReading = hp(
        "auto",
        "Eq. 7: population = divided by HW | unbiased = torch.var's default, divided by HW - 1 "
        "(reference model/models.py:272)",
    )
    pool_draw: PoolDrawReading = hp(
        "auto",
        "Alg. 2 line 5: with_replacement = each sample draws on its own | reference = B distinct rows when the pool "
        "holds at least B, with replacement otherwise (reference algorithm/client/fedccrl.py:55-63)",
    )
    augmix_impl: Literal["tensor", "pil"] = hp(
        "tensor",
        "how augmix per_sample runs, not what it draws: tensor = "
        "batched on the device | pil = PIL per sample on the host "
        "(augment/augmix_pil.py); `fedccrl-bench speed` says which is "
        "faster on a device",
    )
    uint8_wrap: bool = hp(
        False,
        "reference algorithm/client/fedccrl.py:157-159 casts MixStyle's output to uint8 "
        "unclamped (values outside [0, 1] wrap mod 256, -0.3 -> 180): a defect, off even in variant "
        "reference; true reproduces it",
    )

    def reading(self, key: str) -> str:
        """The reading M runs for switch `key`: its value, or the paper's when `auto`."""
        value: str = getattr(self, key)
        return AUGMENT_SWITCHES[key][0] if value == "auto" else value
