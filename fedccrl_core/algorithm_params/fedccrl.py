"""train.fedccrl: FedCCRL's hyperparameters (fedccrl-v2.txt) and its `variant` switches (paper | reference);
the algorithm is fedccrl_core/algorithms/fedccrl.py, docs/algorithms/fedccrl.md lists the switches.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import ClassVar, Literal, get_args

from fedccrl_core.augment.settings import AUGMENT_SWITCHES, AugmentParams
from fedccrl_core.foundation.hparams import hp

# The switches of train.fedccrl: auto (follow `variant`), the paper's reading, the reference code's
ForwardReading = Literal["auto", "joint", "per_view"]  # one pass on the 3B concatenation | three passes (BN per view)
LClsReading = Literal["auto", "mean", "sum"]  # Eq. 16's 1/3 | the sum of the three CEs
SupconReading = Literal["auto", "paper", "self_positive"]  # Eq. 11's P(i) without i | i its own positive, mean over 2B
UploadReading = Literal["auto", "ceil", "floor_unbiased"]  # Eq. 8 | floor(r n) rows with the unbiased std
LastBatchReading = Literal["auto", "skip_single", "keep"]  # skip a last batch of 1 | keep every batch
# train.fedccrl.<key>: (the paper's reading, the reference code's), chosen by `variant` when `auto`; M's own
# switches (augmix, mixstyle_var, pool_draw) are declared with M (fedccrl_core/augment/settings.py)
VARIANT_SWITCHES: dict[str, tuple[str, ...]] = {
    "forward": get_args(ForwardReading)[1:],
    "l_cls": get_args(LClsReading)[1:],
    "supcon": get_args(SupconReading)[1:],
    **AUGMENT_SWITCHES,
    "upload": get_args(UploadReading)[1:],
    "last_batch": get_args(LastBatchReading)[1:],
}
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


class FedCCRLParams(AugmentParams):
    """train.fedccrl (fedccrl-v2.txt): M's settings (inherited from AugmentParams) and the rest."""

    uploads_statistics: ClassVar[bool] = True  # Eq. 8's rows every round: train.privacy.statistics must noise them

    r: float = hp(
        0.1, "Eq. 8: share of a client's per-sample statistics uploaded each round; Table 1 caption r = 0.1", gt=0, le=1
    )
    tau: float = hp(0.1, "Eq. 11: SupCon temperature; Sec. 4.2 tau = 0.1", gt=0)
    lambda1: float = hp(0.1, "Eq. 15: weight of L_RA; not stated, the reference implementation's 0.1", ge=0)
    lambda2: float = hp(0.1, "Eq. 15: weight of L_JS; not stated, the reference implementation's 0.1", ge=0)
    l_ra: bool = hp(True, "Table 2 ablation: L_RA in Eq. 15")
    l_js: bool = hp(True, "Table 2 ablation: L_JS in Eq. 15")
    # the paper's reading or the reference code's: each switch is auto (follow `variant`) or a reading
    variant: Variant = hp(
        "paper",
        "paper = Eq. 3-16 and Alg. 1-3 | reference = the authors' code (SanphouWang/FedCCRL at 60b2d9b) behind Table 1",
    )
    forward: ForwardReading = hp(
        "auto",
        "Eq. 4: joint = the three views through h in one 3B batch | per_view = three passes, clean first, so "
        "BatchNorm normalizes each view by its own batch and updates its running statistics three times a step "
        "(reference algorithm/client/fedccrl.py:74-86)",
    )
    l_cls: LClsReading = hp(
        "auto",
        "Eq. 16: mean = 1/3 of the three cross-entropies | sum = the three summed, so L_CLS weighs 3x against "
        "lambda1 L_RA and lambda2 L_JS (reference algorithm/client/fedccrl.py:76, :86)",
    )
    supcon: SupconReading = hp(
        "auto",
        "Eq. 11: paper = P(i) without i, max subtracted before the log-sum-exp | self_positive = the same-label "
        "mask keeps its diagonal (i its own positive), the mean runs over all 2B anchors, no max subtracted "
        "(reference algorithm/client/fedccrl.py:137-145)",
    )
    upload: UploadReading = hp(
        "auto",
        "Eq. 8: ceil = ceil(r n_i) rows | floor_unbiased = floor(r n_i) rows, the first of a freshly shuffled pass "
        "each round, with the unbiased std (reference algorithm/client/fedccrl.py:21-44)",
    )
    last_batch: LastBatchReading = hp(
        "auto",
        "skip_single = a last batch of 1 skipped (BatchNorm) | keep = every batch, as a DataLoader without "
        "drop_last (reference algorithm/client/fedavg.py:20-22)",
    )


def switches_markdown() -> str:
    """docs/algorithms/fedccrl.md's table of the variant switches, generated from the declarations above when the
    site is built (scripts/mkdocs_hooks.py): each switch's two readings and its source."""
    rows = [
        "| Switch (`train.fedccrl.`) | `paper` | `reference` | the readings and their source |",
        "|---|---|---|---|",
    ]
    fields = FedCCRLParams.model_fields
    for key, (paper, reference) in VARIANT_SWITCHES.items():
        rows.append(f"| `{key}` | `{paper}` | `{reference}` | {(fields[key].description or '').replace('|', '/')} |")
    uint8 = (fields["uint8_wrap"].description or "").replace("|", "/")
    rows.append(f"| `uint8_wrap` | `false` | `false` | {uint8} |")
    return "\n".join(rows)
