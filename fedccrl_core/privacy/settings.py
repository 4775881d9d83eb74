"""params.yaml `train.privacy.*`: differential privacy on both upload channels, declared once (typed, bounded,
with sources). Off by default: `enabled: false` is the paper's protocol, bit for bit. No torch here: every stage
validates params.yaml with this model before it does any work (pipeline/fedccrl_pipeline/params.py).

Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import math
import os
from typing import Annotated, Literal

from pydantic import Field, field_validator

from fedccrl_core.foundation.hparams import Declared, validate


class BudgetExhausted(Exception):
    """A release would take epsilon past train.privacy.max_epsilon; the round loop stops before it."""


Range = Annotated[list[float], Field(min_length=2, max_length=2)]
# train.privacy.noise_seed is refused unless this variable is 1: a seeded run says, where it is started, that it is not
# private
NOT_PRIVATE_VARIABLE = "FEDCCRL_NOT_PRIVATE"
# a seeded run's mark, where it reports epsilon and in every file it leaves: its epsilon does not apply
NOT_PRIVATE_MARK = "not private (noise_seed)"


class PrivacySettings(Declared):
    """params.yaml `train.privacy.*`.

    Unit of privacy: one training image, neighbouring datasets differ by replacing it (dp_accounting's
    REPLACE_ONE). The statistics channel releases that image's (mu, sigma) row (Eq. 6-7) when Eq. 8 samples it;
    the weights channel releases the aggregate of the sampled clients' clipped updates, where replacing an image
    (or a whole client's data) moves the client's clipped update by at most 2 S.
    """

    enabled: bool = Field(False, description="false = no clipping, no noise, no accounting (the paper's protocol)")
    statistics: bool = Field(
        True,
        description="clip + noise each released (mu, sigma) row (Gaussian mechanism, "
        "Dwork & Roth 2014 Thm. A.1) when enabled",
    )
    weights: bool = Field(True, description="client-level DP-FedAvg (McMahan et al., ICLR 2018, Alg. 1) when enabled")
    delta: float = Field(1e-5, gt=0, lt=1, description="the delta at which epsilon is reported and bounded")
    max_epsilon: float = Field(
        0.0, ge=0, description="stop before a release that would make epsilon exceed it; 0 = no limit"
    )
    max_sweep_epsilon: float = Field(
        0.0,
        ge=0,
        description="refuse, before the sweep trains anything, a sweep (train.held_out x train.algorithms x "
        "train.seeds on the same clients) whose per-image epsilon, composed over every run that trains on the "
        "image's domain, would exceed it (privacy/sweep_epsilon.py), and a command whose runs would take the "
        "study's epsilon per image (every release of every run on the same images, privacy/study_ledger.py) past "
        "it; 0 = no limit",
    )
    study: str = Field(
        "",
        max_length=200,
        description="a name that starts a new study on the same images on purpose (privacy/study_ledger.py): its "
        'ledger starts from zero and max_sweep_epsilon counts only its releases; "" = the images\' own study '
        "(new images are a new study by themselves)",
    )
    study_dir: str = Field(
        "",
        max_length=4096,
        description="the folder of the study ledgers (one <study>.jsonl per study, every run's releases); "
        "\"\" = .fedccrl/studies in the project's root, which DVC's --queue and --temp copies share; a relative "
        "path is taken from the project's root",
    )
    stats_release: Literal["rows", "moments"] = Field(
        "rows",
        description="rows: each of Eq. 8's k_i rows clipped and noised; moments: the noisy sums of those "
        "k_i clipped rows and of their squares, from which k_i rows are drawn per coordinate (a Gaussian of that "
        "mean and variance, post-processing); the same sampling, the same accounting",
    )
    stats_noise_multiplier: float = Field(
        1.0,
        gt=0,
        description="z_s: noise std per coordinate = z_s x the "
        "release's L2 sensitivity (rows: the diameter of the clipping box; "
        "moments: that of the box of (row, row squared))",
    )
    stats_mu_range: Range = Field(
        [-2.2, 2.7],
        description="clip each channel mean to [lo, hi]: the range of a "
        "normalized pixel under ImageNet's mean/std ((0 - 0.485)/0.229, (1 - 0.406)/0.225)",
    )
    stats_sigma_range: Range = Field([0.0, 1.5], description="clip each channel std to [lo, hi]")
    weights_clip: float = Field(
        1.0,
        gt=0,
        description="S: each client's update w_i - w (every floating-point "
        "entry of the state dict, one vector) is clipped to L2 norm S (McMahan et al. 2018)",
    )
    weights_noise_multiplier: float = Field(
        1.0,
        gt=0,
        description="z: Gaussian noise of std z S / m is added to "
        "the mean of the m sampled clients' clipped updates (McMahan et al. "
        "2018, fixed denominator)",
    )
    noise_seed: int | None = Field(
        None,
        description="TESTS ONLY: draw the noise and the privacy sampling from this "
        "seed instead of the operating system's entropy; the run is then NOT private "
        "(anyone with params.yaml removes the noise) and every report says so; refused unless "
        "FEDCCRL_NOT_PRIVATE=1 is in the environment",
    )

    @field_validator("noise_seed")
    @classmethod
    def _seeded_only_on_request(cls, v):
        if v is not None and os.environ.get(NOT_PRIVATE_VARIABLE) != "1":
            raise ValueError(
                f"a seeded noise is not private (anyone who reads the params file removes it): it is for tests only, "
                f"and needs {NOT_PRIVATE_VARIABLE}=1 in the environment to say so; remove the key for a private run"
            )
        return v

    @field_validator("stats_mu_range", "stats_sigma_range")
    @classmethod
    def _ordered(cls, v):
        if not (math.isfinite(v[0]) and math.isfinite(v[1]) and v[0] < v[1]):
            raise ValueError(f"must be [lo, hi] with lo < hi, finite; got {v}")
        return v

    @field_validator("stats_sigma_range")
    @classmethod
    def _sigma_nonnegative(cls, v):
        if v[0] < 0:
            raise ValueError(f"a standard deviation is >= 0; got lo = {v[0]}")
        return v

    @property
    def seeded(self) -> bool:
        """The noise is drawn from `noise_seed` (tests only): not private."""
        return self.enabled and self.noise_seed is not None

    def noise_source(self) -> str:
        """How the run's noise was drawn, as every report states it (MLflow tag, round log, audit table)."""
        if not self.enabled:
            return "off"
        if self.seeded:
            return f"seeded by train.privacy.noise_seed = {self.noise_seed}: NOT PRIVATE (tests only)"
        return "OS entropy: private, not bit-reproducible"

    def not_private_mark(self) -> str | None:
        """What marks a seeded run (MLflow tag and param, history.json, model meta, ONNX metadata): None for a
        run that is private or has no DP at all."""
        return NOT_PRIVATE_MARK if self.seeded else None

    @property
    def on_statistics(self) -> bool:
        return self.enabled and self.statistics

    @property
    def on_weights(self) -> bool:
        return self.enabled and self.weights

    def stats_sensitivity(self, channels: int) -> float:
        """L2 sensitivity of one released row under REPLACE_ONE: the diameter of the clipping box of its
        `channels` means and `channels` stds."""
        (a, b), (c, d) = self.stats_mu_range, self.stats_sigma_range
        return math.sqrt(channels * (b - a) ** 2 + channels * (d - c) ** 2)

    def moments_sensitivity(self, channels: int) -> float:
        """L2 sensitivity of the stacked sums (sum of rows, sum of squared rows) under REPLACE_ONE: one row moves
        each coordinate of the first by at most its range and of the second by the range of its square."""

        def sq_range(lo, hi):
            return max(lo * lo, hi * hi) - (0.0 if lo <= 0.0 <= hi else min(lo * lo, hi * hi))

        (a, b), (c, d) = self.stats_mu_range, self.stats_sigma_range
        return math.sqrt(channels * ((b - a) ** 2 + (d - c) ** 2 + sq_range(a, b) ** 2 + sq_range(c, d) ** 2))

    def unprotected(self, algorithm: str, uploads_statistics: bool) -> list[tuple[str, str]]:
        """(key, why) for every channel `algorithm` releases that this setting leaves without its mechanism:
        under train.privacy every release is noised and counted, or refused ([] when off)."""
        if not self.enabled:
            return []
        out = []
        if uploads_statistics and not self.statistics:
            out.append(
                (
                    "train.privacy.statistics",
                    f"{algorithm} uploads statistics rows every round (Eq. 8): with "
                    "DP on and statistics: false they would leave exact while epsilon is reported; set "
                    "statistics: true",
                )
            )
        if not self.weights:
            out.append(
                (
                    "train.privacy.weights",
                    f"{algorithm} releases its weights every round: with DP on and "
                    "weights: false they would leave unnoised while epsilon is reported; set weights: true",
                )
            )
        return out

    @classmethod
    def from_mapping(cls, d: dict | None) -> PrivacySettings:
        return validate(cls, dict(d or {}), prefix="train.privacy")
