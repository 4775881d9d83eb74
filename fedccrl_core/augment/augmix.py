"""DIFP: per-sample AugMix on the device (FedCCRL Alg. 3; Hendrycks et al., ICLR 2020).

FedCCRL v2 calls this step AugMix, v1 calls it DIFP (Domain-Invariant Feature Perturbation).
For EVERY sample x of a batch in [0, 1], independently (Alg. 3):

    k ~ U{1, 2, 3}                                   line 4: number of chains
    (w_1..w_k) ~ Dirichlet(beta, ..., beta)          line 5
    chain_i: op1, op2, op3 ~ U(O); one of op1, op2∘op1, op3∘op2∘op1, uniformly   lines 7-9
    x_aug = sum_i w_i chain_i(x)                     line 10
    m ~ Beta(beta, beta)                             line 12
    x_hat = m x + (1 - m) x_aug                      line 13

Magnitudes follow the AugMix reference code (google-research/augmix, augmentations.py): a
level u ~ U[0.1, severity] is drawn per operation application (``sample_level``), then
int_parameter(u, M) = int(u * M / 10) and float_parameter(u, M) = u * M / 10 (``op_magnitude``):
    rotate      int(u*30/10) degrees, random sign, around the image center
    shear_x/y   u*0.3/10, random sign, PIL AFFINE (1, s, 0, 0, 1, 0) / (1, 0, 0, s, 1, 0):
                sheared about the top-left corner, as PIL's transform does
    translate   int(u*(size/3)/10) pixels, random sign (size = width for x, height for y)
    posterize   keep 4 - int(u*4/10) bits
    solarize    invert values >= 256 - int(u*256/10)
    autocontrast, equalize: no magnitude (PIL ImageOps semantics, per channel)
The operation set O, how a chain step applies them to every image at once, and their numerics are
augmix_ops.py's.

All draws are made per sample up front (``sample_augmix_plan``), the up-to-3 chains of all samples are
stacked into one [3B, C, H, W] tensor, and the chain steps run for all of them at once, only 3
times (one per depth step; augmix_ops.py ``_apply_step``).

Where the authors' FedCCRL code differs from Alg. 3 (we follow Alg. 3): it calls torchvision's
``AugMix()`` on the whole batch (one chain draw per batch), with its defaults mixture_width=3
(k fixed at 3, not k ~ U{1,2,3}) and all_ops=True (adds the four ImageNet-C-overlapping ops).
AugMix's own code weights the ORIGINAL by 1 - m and the mix by m; Alg. 3 weights the original
by m. With m ~ Beta(beta, beta) symmetric, the two have the same distribution.
The reference code's form (params.yaml train.fedccrl.augmix: batch) is augmix_batch.py.

Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .augmix_ops import IDENTITY, OPS, _apply_step
from .ccdt import sample_beta, sample_dirichlet

MAX_CHAINS = 3  # Alg. 3 line 4: k ~ U{1, 2, 3}
MAX_DEPTH = 3  # Alg. 3 lines 7-9: op1, op2∘op1 or op3∘op2∘op1


@dataclass
class AugMixPlan:
    """Every random draw of Alg. 3 for a batch of B samples (S = MAX_CHAINS, D = MAX_DEPTH).

    op [S, B, D] long: op id of chain slot s, sample b, step d; IDENTITY where s >= k_b or
    d >= depth. magnitude [S, B, D]: that op's parameter (signed degrees, shear factor, signed
    pixels, bits kept, solarize threshold; 0 for autocontrast/equalize). weight [B, S]: the
    Dirichlet weights w, 0 on unused slots. m [B]: the Beta weight of the original image.
    """

    op: torch.Tensor
    magnitude: torch.Tensor
    weight: torch.Tensor
    m: torch.Tensor


def op_magnitude(op: torch.Tensor, level: torch.Tensor, sign: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Map a level u in [0.1, severity] (and a sign in {-1, +1}) to each op's parameter."""
    zero = torch.zeros_like(level)
    by_op = torch.stack(
        [
            zero,  # autocontrast
            zero,  # equalize
            4.0 - torch.floor(level * 4.0 / 10.0),  # posterize: bits kept
            sign * torch.floor(level * 30.0 / 10.0),  # rotate: degrees
            256.0 - torch.floor(level * 256.0 / 10.0),  # solarize: threshold
            sign * level * 0.3 / 10.0,  # shear_x
            sign * level * 0.3 / 10.0,  # shear_y
            sign * torch.floor(level * (width / 3.0) / 10.0),  # translate_x: pixels
            sign * torch.floor(level * (height / 3.0) / 10.0),  # translate_y: pixels
        ]
    )
    return by_op.gather(0, op.clamp_min(0).unsqueeze(0)).squeeze(0) * (op >= 0)


def sample_augmix_plan(
    batch: int,
    height: int,
    width: int,
    beta: float = 1.0,
    severity: int = 3,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> AugMixPlan:
    """Draw, per sample, everything Alg. 3 samples (k, w, the chains, their ops and levels, m)."""
    if not 1 <= severity <= 10:
        raise ValueError(f"AugMix severity must be in [1, 10], got {severity}")
    S, D = MAX_CHAINS, MAX_DEPTH
    kw: dict[str, Any] = dict(generator=generator, device=device)
    k = torch.randint(1, S + 1, (batch,), **kw)  # line 4
    depth = torch.randint(1, D + 1, (S, batch), **kw)  # line 9: which of op1, op12, op123
    op = torch.randint(0, len(OPS), (S, batch, D), **kw)  # line 7
    level = 0.1 + (severity - 0.1) * torch.rand((S, batch, D), **kw)  # sample_level
    sign = torch.where(torch.rand((S, batch, D), **kw) < 0.5, -1.0, 1.0)

    slot_used = torch.arange(S, device=device)[:, None] < k[None, :]  # [S, B]
    step_used = torch.arange(D, device=device)[None, None, :] < depth[:, :, None]  # [S, B, D]
    op = torch.where(slot_used[:, :, None] & step_used, op, torch.full_like(op, IDENTITY))
    weight = sample_dirichlet(beta, (batch, S), slot_used.T, **kw)  # line 5
    m = sample_beta(beta, beta, (batch,), **kw)  # line 12
    return AugMixPlan(op, op_magnitude(op, level, sign, height, width), weight, m)


# ---------------------------------------------------------------------------------------------
# AugMix (Alg. 3)
# ---------------------------------------------------------------------------------------------
def _augmix_with(x: torch.Tensor, plan: AugMixPlan, all_ops: bool = False) -> torch.Tensor:
    """Alg. 3 lines 6-13 for given draws: x_hat = m x + (1 - m) sum_i w_i chain_i(x)."""
    S, B, D = plan.op.shape
    _, c, h, w = x.shape
    y = x.float()
    chains = y.repeat(S, 1, 1, 1)  # row s * B + b is chain slot s of sample b
    for step in range(D):
        chains = _apply_step(
            chains, plan.op[:, :, step].reshape(-1), plan.magnitude[:, :, step].reshape(-1), all_ops=all_ops
        )
    chains = chains.view(S, B, c, h, w)
    weight = plan.weight.to(y.dtype)
    x_aug = weight[:, 0, None, None, None] * chains[0]
    for slot in range(1, S):
        x_aug = x_aug + weight[:, slot, None, None, None] * chains[slot]
    m = plan.m.to(y.dtype).view(B, 1, 1, 1)
    return (m * y + (1.0 - m) * x_aug).clamp(0.0, 1.0).to(x.dtype)


def augmix(
    x: torch.Tensor,
    beta: float = 1.0,
    severity: int = 3,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Alg. 3, per sample: x [B, C, H, W] in [0, 1] -> x_hat [B, C, H, W] in [0, 1]."""
    if x.dim() != 4:
        raise ValueError(f"augmix expects a [B, C, H, W] batch, got shape {tuple(x.shape)}")
    b, _, h, w = x.shape
    plan = sample_augmix_plan(b, h, w, beta, severity, generator, x.device)
    return _augmix_with(x, plan)
