"""The reference code's AugMix: torchvision's, one op chain per batch.

The reference code's form is offered as a switch (params.yaml train.fedccrl.augmix: batch,
to reproduce the reference code's runs): ``augmix_batch`` draws as torchvision's ``AugMix()`` does on a batch tensor
(SanphouWang/FedCCRL 60b2d9b algorithm/client/fedccrl.py:154-165, torchvision defaults
severity=3, mixture_width=3, chain_depth=-1, alpha=1, all_ops=True, bilinear, fill 0):
    - k = 3 chains always, each of depth ~ U{1, 2, 3}; depth, ops, magnitudes and signs drawn
      ONCE for the whole batch; only the Dirichlet weights w and m are drawn per sample;
    - the op is uniform over 13 ops: O plus brightness, color, contrast, sharpness (ALL_OPS);
    - magnitude = linspace(0, max, 10)[bin], bin ~ U{0, .., severity - 1}: shear max 0.3,
      translate max size/3 (then int()), rotate max 30 degrees (float), brightness, color,
      contrast and sharpness max 0.9 (factor 1 + signed magnitude); posterize keeps
      4 - round(bin / 2.25) bits, solarize thresholds at linspace(255, 0, 10)[bin];
    - 8-bit in and out: the reference casts its input with .to(torch.uint8) and torchvision
      casts the mix back with truncation (``to_uint8_levels``, and floor at the output).

Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import Any

import torch

from .augmix import MAX_CHAINS, MAX_DEPTH, AugMixPlan, _augmix_with
from .augmix_ops import ALL_OPS, IDENTITY
from .ccdt import sample_beta, sample_dirichlet

MAGNITUDE_BINS = 10  # torchvision AugMix: linspace(0, max, 10), bin < severity


def batch_op_magnitude(
    op: torch.Tensor, level_bin: torch.Tensor, sign: torch.Tensor, height: int, width: int
) -> torch.Tensor:
    """torchvision AugMix's parameter of each op of ALL_OPS: linspace(0, max, 10)[bin], signed
    where the op is signed (0 for autocontrast, equalize and IDENTITY)."""
    frac = level_bin.to(torch.float32) / (MAGNITUDE_BINS - 1)  # linspace(0, max, 10)[bin] = max * frac
    zero = torch.zeros_like(frac)
    by_op = torch.stack(
        [
            zero,  # autocontrast
            zero,  # equalize
            4.0 - torch.round(level_bin.to(torch.float32) / ((MAGNITUDE_BINS - 1) / 4.0)),  # posterize: bits kept
            sign * 30.0 * frac,  # rotate: degrees
            255.0 * (1.0 - frac),  # solarize: threshold, linspace(255, 0, 10)
            sign * 0.3 * frac,  # shear_x
            sign * 0.3 * frac,  # shear_y
            sign * torch.trunc(width / 3.0 * frac),  # translate_x: int() pixels
            sign * torch.trunc(height / 3.0 * frac),  # translate_y
            *[sign * 0.9 * frac] * 4,  # brightness, color, contrast, sharpness: factor 1 + magnitude
        ]
    )
    return by_op.gather(0, op.clamp_min(0).unsqueeze(0)).squeeze(0) * (op >= 0)


def sample_batch_augmix_plan(
    batch: int,
    height: int,
    width: int,
    beta: float = 1.0,
    severity: int = 3,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> AugMixPlan:
    """torchvision AugMix's draws for a batch: 3 chains of depth U{1,2,3}, each step's op
    (uniform over ALL_OPS), magnitude bin (U{0..severity-1}) and sign shared by the whole batch;
    per sample only w ~ Dirichlet(beta, beta, beta) and m ~ Beta(beta, beta)."""
    if not 1 <= severity <= 10:
        raise ValueError(f"AugMix severity must be in [1, 10], got {severity}")
    S, D = MAX_CHAINS, MAX_DEPTH
    kw: dict[str, Any] = dict(generator=generator, device=device)
    depth = torch.randint(1, D + 1, (S,), **kw)
    op = torch.randint(0, len(ALL_OPS), (S, D), **kw)
    level_bin = torch.randint(0, severity, (S, D), **kw)
    sign = torch.where(torch.rand((S, D), **kw) < 0.5, -1.0, 1.0)
    op = torch.where(torch.arange(D, device=device)[None, :] < depth[:, None], op, torch.full_like(op, IDENTITY))
    magnitude = batch_op_magnitude(op, level_bin, sign, height, width)
    weight = sample_dirichlet(beta, (batch, S), **kw)  # all 3 chains used (mixture_width = 3)
    m = sample_beta(beta, beta, (batch,), **kw)  # weight of the original (torchvision's m[:, 0])
    return AugMixPlan(op[:, None, :].expand(S, batch, D), magnitude[:, None, :].expand(S, batch, D), weight, m)


def to_uint8_levels(x01: torch.Tensor, wrap: bool = False) -> torch.Tensor:
    """The reference's cast to 8 bits before AugMix, ``(x * 255).to(torch.uint8)``, as levels k/255:
    truncation toward zero, then clamped to [0, 255] (wrap=False), or wrapped mod 256 (wrap=True:
    what the CPU cast does to values outside [0, 1] after MixStyle, -0.3 -> 180/255; a defect of
    the reference, offered only as the explicit switch train.fedccrl.uint8_wrap)."""
    levels = torch.trunc(x01 * 255.0)
    levels = torch.remainder(levels, 256.0) if wrap else levels.clamp(0.0, 255.0)
    return levels / 255.0


def augmix_batch(
    x: torch.Tensor, beta: float = 1.0, severity: int = 3, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The reference code's AugMix on x [B, C, H, W] of 8-bit levels in [0, 1]: one op chain per
    batch (``sample_batch_augmix_plan``); the result is truncated to 8 bits as torchvision's is."""
    if x.dim() != 4:
        raise ValueError(f"augmix_batch expects a [B, C, H, W] batch, got shape {tuple(x.shape)}")
    b, _, h, w = x.shape
    plan = sample_batch_augmix_plan(b, h, w, beta, severity, generator, x.device)
    return (torch.floor(_augmix_with(x, plan, all_ops=True).float() * 255.0) / 255.0).to(x.dtype)
