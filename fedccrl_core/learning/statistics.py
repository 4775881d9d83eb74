"""Channel-wise sample statistics, FedCCRL Eq. 6-7, and the eval/train normalization.

Every statistic in this project is taken on the *normalized* tensor
x = (u8 / 255 - mean) / std, i.e. after the training resize and normalization.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import functools

import torch

from fedccrl_core.foundation.imagenet_stats import IMAGENET_MEAN, IMAGENET_STD


def per_channel(values, like: torch.Tensor) -> torch.Tensor:
    """[1, C, 1, 1] constant on like's device and dtype. Built once per (values, device, dtype) and kept: the
    blocking host-to-device copy that makes it happens on the first call only, so a training step dispatches no
    op for it (and the tensor is complete before any CUDA stream reads it)."""
    return _constant(tuple(float(v) for v in values), like.device, like.dtype)


@functools.lru_cache(maxsize=64)
def _constant(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).view(1, -1, 1, 1).to(device)


def normalize_u8(images_u8: torch.Tensor, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> torch.Tensor:
    """uint8 NHWC or NCHW images -> float32 NCHW normalized tensor. NHWC is detected by a last dim of 3."""
    x = images_u8
    if x.dim() == 4 and x.shape[-1] == 3 and x.shape[1] != 3:
        x = x.permute(0, 3, 1, 2)
    x = x.float().div_(255.0)
    return normalize(x, mean, std)


def denormalize(x: torch.Tensor, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> torch.Tensor:
    """Inverse of the normalization: normalized NCHW -> [0, 1] range (not clamped)."""
    return x * per_channel(std, x) + per_channel(mean, x)


def normalize(x01: torch.Tensor, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> torch.Tensor:
    """[0, 1] NCHW -> normalized: the inverse of `denormalize`."""
    return (x01 - per_channel(mean, x01)) / per_channel(std, x01)


def channel_stats(x: torch.Tensor, eps: float = 1e-6, unbiased: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample, per-channel mean and std of x [B, C, H, W].

    Eq. 6: mu(x)_c = 1/(HW) sum_{h,w} x_{c,h,w}
    Eq. 7: sigma(x)_c = sqrt(1/(HW) sum_{h,w} (x_{c,h,w} - mu(x)_c)^2)   (population std)
    eps is added inside the square root (as MixStyle does) so that sigma > 0 for flat images.
    unbiased=True divides by HW - 1 instead (torch.var's default, which the reference code uses:
    SanphouWang/FedCCRL 60b2d9b model/models.py:272, algorithm/client/fedccrl.py:29).
    Returns (mu [B, C], sigma [B, C]).
    """
    mu = x.mean(dim=(2, 3))
    var = x.var(dim=(2, 3), unbiased=unbiased)
    return mu, (var + eps).sqrt()
