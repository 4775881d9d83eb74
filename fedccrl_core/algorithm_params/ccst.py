"""train.ccst: CCST's hyperparameters (Chen et al., ccst.txt); the algorithm is fedccrl_core/algorithms/ccst.py.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import ClassVar, Literal

from fedccrl_core.foundation.hparams import HParams, hp


class CCSTParams(HParams):
    """train.ccst (ccst.txt)."""

    dp_refusal: ClassVar[str] = (
        "CCST uploads its clients' style banks (per-image AdaIN statistics, Alg. 1), which train.privacy neither "
        "clips nor noises"
    )

    style_type: Literal["overall", "single"] = hp("overall", "overall = Eq. 8 (Table 1's best) | single = Eq. 6-7")
    K: int = hp(3, "augmentation level, K in 1..N clients (Alg. 1); Table 1's setting Overall, K = 3", ge=1)
    J: int | None = hp(None, "single mode: styles per client; null = ceil(n_i / 32) (Sec. 4.2)", ge=1)
    adain_weights: str | dict[str, str] | None = hp(
        None,
        "the pretrained AdaIN VGG encoder and decoder (pytorch-AdaIN's vgg_normalised.pth, decoder.pth): "
        "{vgg: <path|url>, decoder: <path|url>} or one combined file; 'random' = seeded random weights, "
        "for tests only; required when ccst is trained",
    )
    adain_sha256: str | dict[str, str] | None = hp(
        None, "sha256 of adain_weights, in the same shape (a string or {vgg, decoder}); required with adain_weights"
    )

    def selected_problems(self, key: str) -> list[str]:
        if self.adain_weights is None:
            return [
                f"params.yaml: key '{key}.adain_weights': got None; CCST needs the AdaIN weights: set it to "
                "{vgg: <path|url>, decoder: <path|url>} (or one combined file) and adain_sha256 to their sha256"
            ]
        return []
