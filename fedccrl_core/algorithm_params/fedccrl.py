"""train.fedccrl: FedCCRL's hyperparameters (fedccrl-v2.txt) and its `variant` switches (paper | reference);
the algorithm is fedccrl_core/algorithms/fedccrl.py, docs/algorithms/fedccrl.md lists the switches.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import ClassVar, Literal, get_args

from fedccrl_core.foundation.hparams import HParams, hp

# The type of train.fedccrl.<key>: auto (follow `variant`), the paper's reading, the reference code's
Forward = Literal["auto", "joint", "per_view"]  # one pass on the 3B concatenation | three passes (BN per view)
LCls = Literal["auto", "mean", "sum"]  # Eq. 16's 1/3 | the sum of the three CEs
Supcon = Literal["auto", "paper", "self_positive"]  # Eq. 11's P(i) without i | i its own positive, mean over 2B
Augmix = Literal["auto", "per_sample", "batch"]  # Alg. 3 per sample | torchvision's AugMix on the batch tensor
MixstyleVar = Literal["auto", "population", "unbiased"]  # Eq. 7 | torch.var's default
PoolDraw = Literal["auto", "with_replacement", "reference"]  # Alg. 2 line 5 | distinct rows when the pool has >= B
Upload = Literal["auto", "ceil", "floor_unbiased"]  # Eq. 8 | floor(r n) rows with the unbiased std
LastBatch = Literal["auto", "skip_single", "keep"]  # skip a last batch of 1 | keep every batch
_SWITCH_TYPES = {
    "forward": Forward,
    "l_cls": LCls,
    "supcon": Supcon,
    "augmix": Augmix,
    "mixstyle_var": MixstyleVar,
    "pool_draw": PoolDraw,
    "upload": Upload,
    "last_batch": LastBatch,
}
# train.fedccrl.<key>: (the paper's reading, the reference code's), chosen by `variant` when `auto`
VARIANT_SWITCHES = {key: get_args(t)[1:] for key, t in _SWITCH_TYPES.items()}
Variant = Literal["paper", "reference"]
VARIANTS = get_args(Variant)


def resolve_variant(hp: FedCCRLParams) -> FedCCRLParams:
    """hp (validated: `variant` and each switch are Literals of FedCCRLParams) with every `auto` switch replaced
    by the reading of hp.variant."""
    variant = hp.variant
    resolved = {
        key: readings[VARIANTS.index(variant)]
        for key, readings in VARIANT_SWITCHES.items()
        if getattr(hp, key) == "auto"
    }
    out = hp.model_copy(update=resolved)
    if out.augmix_impl == "pil" and out.augmix != "per_sample":
        raise ValueError(
            f"params.yaml: train.fedccrl.augmix_impl pil implements augmix per_sample only, but augmix "
            f"is {out.augmix} (variant {variant}); use augmix_impl: tensor"
        )
    return out


class FedCCRLParams(HParams):
    """train.fedccrl (fedccrl-v2.txt)."""

    uploads_statistics: ClassVar[bool] = True  # Eq. 8's rows every round: train.privacy.statistics must noise them

    r: float = hp(
        0.1, "Eq. 8: share of a client's per-sample statistics uploaded each round; Table 1 caption r = 0.1", gt=0, le=1
    )
    alpha: float = hp(0.1, "Alg. 2 (CCDT/MixStyle): lambda ~ Beta(alpha, alpha); Sec. 4.2 alpha = 0.1", gt=0)
    beta: float = hp(
        1.0, "Alg. 3 (DIFP/AugMix): Dirichlet(beta) chain weights and m ~ Beta(beta, beta); Sec. 4.2 beta = 1.0", gt=0
    )
    severity: int = hp(
        3, "Alg. 3: AugMix operation severity; not stated, AugMix's (Hendrycks et al.) default 3", ge=1, le=10
    )
    tau: float = hp(0.1, "Eq. 11: SupCon temperature; Sec. 4.2 tau = 0.1", gt=0)
    lambda1: float = hp(0.1, "Eq. 15: weight of L_RA; not stated, the reference implementation's 0.1", ge=0)
    lambda2: float = hp(0.1, "Eq. 15: weight of L_JS; not stated, the reference implementation's 0.1", ge=0)
    ccdt: bool = hp(True, "Table 2 ablation: CCDT (MixStyle from the pool) in M")
    difp: bool = hp(True, "Table 2 ablation: DIFP (per-sample AugMix) in M")
    l_ra: bool = hp(True, "Table 2 ablation: L_RA in Eq. 15")
    l_js: bool = hp(True, "Table 2 ablation: L_JS in Eq. 15")
    # the paper's reading or the reference code's: each switch is auto (follow `variant`) or a reading
    variant: Variant = hp(
        "paper",
        "paper = Eq. 3-16 and Alg. 1-3 | reference = the authors' code (SanphouWang/FedCCRL at 60b2d9b) behind Table 1",
    )
    forward: Forward = hp(
        "auto",
        "Eq. 4: joint = one pass on the 3B concatenation | per_view = three "
        "passes, BN per view (reference algorithm/client/fedccrl.py:74-86)",
    )
    l_cls: LCls = hp(
        "auto", "Eq. 16: mean = 1/3 of the three CEs | sum (reference algorithm/client/fedccrl.py:76, :86)"
    )
    supcon: Supcon = hp(
        "auto",
        "Eq. 11: paper = P(i) without i | self_positive = i its own positive, "
        "mean over 2B anchors (reference algorithm/client/fedccrl.py:137-145)",
    )
    augmix: Augmix = hp(
        "auto",
        "Alg. 3: per_sample | batch = torchvision AugMix on the batch tensor, "
        "one op chain per batch (reference algorithm/client/fedccrl.py:154-165)",
    )
    mixstyle_var: MixstyleVar = hp(
        "auto", "Eq. 7: population | unbiased = torch.var's default (reference model/models.py:272)"
    )
    pool_draw: PoolDraw = hp(
        "auto",
        "Alg. 2 line 5: with_replacement | reference = distinct rows when "
        "the pool holds >= B (reference algorithm/client/fedccrl.py:55-63)",
    )
    upload: Upload = hp(
        "auto",
        "Eq. 8: ceil(r n_i) rows | floor_unbiased = floor(r n_i) rows, unbiased "
        "std (reference algorithm/client/fedccrl.py:21-44)",
    )
    last_batch: LastBatch = hp(
        "auto",
        "skip_single = a last batch of 1 skipped (BatchNorm) | keep = every batch (reference DataLoader, no drop_last)",
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
        "unclamped (values outside [0, 1] wrap mod 256): a defect, off even in variant "
        "reference; true reproduces it",
    )
