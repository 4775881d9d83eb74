"""FedCCRL's feature augmentation M = AugMix ∘ MixStyle (Eq. 3; v1: CCDT then DIFP): the composition of the
submodules ccdt (Alg. 2) and augmix (Alg. 3).

``fedccrl_augment`` takes a NORMALIZED batch (the training tensor of every backbone here) and:
  1. CCDT / MixStyle from the pool (Alg. 2, ``ccdt.py``) in normalized space. The per-channel
     affine normalization commutes with MixStyle (see ``ccdt.py``), so mixing in normalized or
     in pixel space is the same, and the pool holds normalized statistics anyway;
  2. denormalize -> clamp to [0, 1] -> DIFP / per-sample AugMix (Alg. 3, ``augmix.py``) ->
     renormalize.
Order: Eq. 3 writes M = AugMix ∘ MixStyle, i.e. MixStyle first, and Fig. 3 of both versions
shows (b) = MixStyle/CCDT(a), (c) = AugMix/DIFP(b). (v1 writes "CCDT ∘ DIFP" in its Eq. 3 but
its Fig. 3 has the same order; we follow v2 and the figures.) The clamp is needed because
MixStyle can move pixels out of [0, 1], and AugMix's ops are defined on images.

Ablation switches (Table 2): ``ccdt=False`` or ``difp=False`` makes that step the identity
(with ``difp=False`` nothing is denormalized or clamped). Two calls give X^(1) and X^(2) with
independent draws.

Reference-code switches, to reproduce the authors' code (docs/algorithms/fedccrl.md lists them):
``mixstyle_var``/``pool_draw`` (``ccdt.py``), ``augmix="batch"`` (``augmix_batch.augmix_batch``: its
input is cast to 8-bit levels as the reference does, ``augmix_batch.to_uint8_levels``) and
``uint8_wrap`` (the cast wraps mod 256 instead of the clamp: the reference's defect, off unless
asked for).


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import torch

from fedccrl_core.augment import augmix, augmix_batch, ccdt
from fedccrl_core.augment.settings import AugmentParams
from fedccrl_core.learning.statistics import IMAGENET_MEAN, IMAGENET_STD, denormalize, normalize


def fedccrl_augment(
    x_norm: torch.Tensor,
    pool_mu: torch.Tensor | None,
    pool_sigma: torch.Tensor | None,
    cfg: AugmentParams | None = None,
    generator: torch.Generator | None = None,
    mean=IMAGENET_MEAN,
    std=IMAGENET_STD,
) -> torch.Tensor:
    """M(X) = AugMix(MixStyle(X)) (Eq. 3) on a normalized batch [B, C, H, W]; returns a
    normalized batch. pool_mu/pool_sigma [P, C]: F_pool^i (may be None when cfg.ccdt is off)."""
    cfg = cfg if cfg is not None else AugmentParams()
    augmix_reading = cfg.reading("augmix")
    x = x_norm
    if cfg.ccdt:
        if pool_mu is None or pool_sigma is None:
            raise ValueError("ccdt=True needs the statistics pool (pool_mu, pool_sigma)")
        x = ccdt.ccdt(
            x,
            pool_mu,
            pool_sigma,
            cfg.alpha,
            generator,
            unbiased=cfg.reading("mixstyle_var") == "unbiased",
            pool_draw=cfg.reading("pool_draw"),
        )
    if cfg.difp:
        x01 = denormalize(x, mean, std)
        if augmix_reading == "batch" or cfg.uint8_wrap:  # the reference's (x * 255).to(torch.uint8)
            x01 = augmix_batch.to_uint8_levels(x01, wrap=cfg.uint8_wrap)
        else:
            x01 = x01.clamp(0.0, 1.0)
        if augmix_reading == "batch":
            x = augmix_batch.augmix_batch(x01, cfg.beta, cfg.severity, generator)
        elif cfg.augmix_impl == "pil":
            from fedccrl_core.augment.augmix_pil import augmix_pil

            x = augmix_pil(x01, cfg.beta, cfg.severity, generator)
        else:
            x = augmix.augmix(x01, cfg.beta, cfg.severity, generator)
        x = normalize(x, mean, std)
    return x
