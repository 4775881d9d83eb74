"""AugMix (Alg. 3) per sample with PIL on the host: `train.fedccrl.augmix_impl: pil`.

The same reading as `augmix.augmix` (per sample: k ~ U{1,2,3} chains, w ~ Dirichlet(beta), chains of
depth U{1,2,3} over the 9 ops O, levels u ~ U[0.1, severity], m ~ Beta(beta, beta), x_hat = m x +
(1 - m) sum_i w_i chain_i(x)), run as the AugMix reference code runs it: PIL ImageOps / Image.transform on
the 8-bit image, one sample at a time. The two implementations draw different random numbers (this one
from a numpy Generator seeded by one draw of the run's torch Generator), so a run's numbers depend on
which one ran; their output distributions agree (tests/test_augment.py compares per-op statistics).

Which is faster depends on the device and image size: on the CPU at 32 px the batched tensor path is
about 2x faster, at 224 px PIL is (measured by `fedccrl-bench speed`, which picks the faster for its fast side
with `fastest`). Training never picks by itself: the choice is a param, so a run's numbers do not depend
on how busy the machine was when it started.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image, ImageOps

from fedccrl_core.augment.augmix_ops import OPS

IMPLS = ("tensor", "pil")


def pil_op(img: Image.Image, op: str, level: float, sign: float) -> Image.Image:
    """One AugMix operation on a PIL image; level u in [0.1, severity], magnitudes as the AugMix
    reference: int(u * M / 10) or u * M / 10 (see augment/augmix.py)."""
    w, h = img.size
    if op == "autocontrast":
        return ImageOps.autocontrast(img)
    if op == "equalize":
        return ImageOps.equalize(img)
    if op == "posterize":
        return ImageOps.posterize(img, 4 - int(level * 4 / 10))
    if op == "solarize":
        return ImageOps.solarize(img, 256 - int(level * 256 / 10))
    if op == "rotate":
        return img.rotate(sign * int(level * 30 / 10), resample=Image.Resampling.BILINEAR)
    affine = {
        "shear_x": (1, sign * level * 0.3 / 10, 0, 0, 1, 0),
        "shear_y": (1, 0, 0, sign * level * 0.3 / 10, 1, 0),
        "translate_x": (1, 0, sign * int(level * (w / 3) / 10), 0, 1, 0),
        "translate_y": (1, 0, 0, 0, 1, sign * int(level * (h / 3) / 10)),
    }[op]
    return img.transform((w, h), Image.Transform.AFFINE, affine, resample=Image.Resampling.BILINEAR)


def host_augmix(img_u8: np.ndarray, beta: float, severity: int, rng: np.random.Generator) -> np.ndarray:
    """Alg. 3 on ONE uint8 HWC image with PIL; returns float32 HWC in [0, 1]."""
    pil = Image.fromarray(img_u8)
    k = int(rng.integers(1, 4))  # line 4
    weights = rng.dirichlet([beta] * k)  # line 5
    mix = np.zeros(img_u8.shape, dtype=np.float32)
    for i in range(k):
        chain = pil
        for _ in range(int(rng.integers(1, 4))):  # op1, op2.op1 or op3.op2.op1
            op = OPS[int(rng.integers(len(OPS)))]
            chain = pil_op(chain, op, rng.uniform(0.1, severity), -1.0 if rng.uniform() < 0.5 else 1.0)
        mix += weights[i] * (np.asarray(chain, dtype=np.float32) / 255.0)  # line 10
    m = rng.beta(beta, beta)  # line 12
    return np.clip(m * (img_u8.astype(np.float32) / 255.0) + (1 - m) * mix, 0.0, 1.0)  # line 13


def augmix_pil(
    x: torch.Tensor, beta: float = 1.0, severity: int = 3, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Alg. 3 per sample with PIL: x [B, C, H, W] in [0, 1] (any device) -> x_hat on x's device."""
    if x.dim() != 4:
        raise ValueError(f"augmix_pil expects a [B, C, H, W] batch, got shape {tuple(x.shape)}")
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=x.device).item())
    rng = np.random.default_rng(seed)
    u8 = torch.round(x.detach().float().clamp(0, 1) * 255.0).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    out = np.stack([host_augmix(np.ascontiguousarray(img), beta, severity, rng) for img in u8])
    return torch.from_numpy(out).permute(0, 3, 1, 2).to(device=x.device, dtype=x.dtype)


def fastest(
    candidates: dict[str, Callable[[], object]],
    repeats: int = 3,
    timer: Callable[[], float] = time.perf_counter,
    sync: Callable[[], None] = lambda: None,
) -> tuple[str, dict[str, float]]:
    """The candidate with the smallest best-of-`repeats` time (after one untimed warm call), and every
    candidate's seconds; ties go to the first listed."""
    seconds = {}
    for name, run in candidates.items():
        run()
        sync()
        best = float("inf")
        for _ in range(repeats):
            t0 = timer()
            run()
            sync()
            best = min(best, timer() - t0)
        seconds[name] = best
    return min(seconds, key=lambda n: (seconds[n], list(candidates).index(n))), seconds


def probe_augmix_impl(
    device: torch.device, size: int, batch: int, beta: float = 1.0, severity: int = 3, repeats: int = 3
) -> tuple[str, dict[str, float]]:
    """Time both per-sample implementations on a [batch, 3, size, size] batch on `device`; the faster one."""
    from fedccrl_core.augment.augmix import augmix

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.rand((batch, 3, size, size), generator=g, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    return fastest(
        {"tensor": lambda: augmix(x, beta, severity, g), "pil": lambda: augmix_pil(x, beta, severity, g)},
        repeats,
        sync=sync,
    )
