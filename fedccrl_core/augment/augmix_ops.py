"""The AugMix operation set O and one chain step over a batch (FedCCRL Alg. 3 lines 7-9, augmix.py): image i gets
op[i] with its parameter, all images at once.

O is the AugMix paper's operation set ("we adopt the same set of operations O as described in
[8]"): autocontrast, equalize, posterize, rotate, solarize, shear_x, shear_y, translate_x,
translate_y. The "all ops" extension (color, contrast, brightness, sharpness) is left out, as
the AugMix paper does, because those overlap ImageNet-C's corruptions.
The reference code's AugMix (augmix_batch.py) also draws from ALL_OPS: O plus those four (color, contrast,
brightness, sharpness).

Parameters are raw: degrees (rotate, counter-clockwise about the image center), shear factor, signed pixels,
bits kept (posterize), threshold (solarize), and the signed factor offset of the four color ops.
Geometric ops resample bilinearly and fill the uncovered area with 0 (black), which is what
the reference gets from PIL (``Image.rotate``/``Image.transform`` with no fillcolor). (The
authors' FedCCRL code instead calls torchvision's AugMix, whose fill is also 0.)

Vectorization. In one step every image has exactly one op id (or IDENTITY when its chain is unused
or shorter); the four pixel ops are all per-channel 256-entry lookup
tables, so they run as ONE batched table lookup (histogram by scatter_add, cumsum, gather),
and the five geometric ops are all affine maps, so they run as ONE batched affine
resampling (sampling grid from a per-image matrix, then ``grid_sample``). ``torch.where``
routes each image to its op's result. No Python loop over samples, no data-dependent shapes, no host sync, all
randomness from the optional ``torch.Generator`` (on x's device). On the CPU only, where a
host read costs nothing, each op family runs on just the images that selected it (about a
quarter of the stacked chains per step) instead of on all of them; the result is identical.

Departures, numerics: the reference keeps PIL uint8 images between ops. Here the pixel ops
read the image quantized to 8 bits (round(255 x)) and output multiples of 1/255 exactly like
PIL, while geometric ops keep float precision (no rounding after the bilinear resampling).
On the interior the geometric ops match PIL within one gray level; on the outermost pixel
grid_sample blends with the 0 fill where PIL decides per output pixel.
The four color ops (augmix_batch.py) stay in float too (torchvision rounds or truncates each op's result to
uint8); color and contrast use torchvision's gray 0.2989 R + 0.587 G + 0.114 B (not truncated), sharpness its
3x3 kernel [[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13 with the border pixels kept.

Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fedccrl_core.foundation import fastpath

# The AugMix operation set O (Hendrycks et al. 2020), in the reference code's order.
OPS = (
    "autocontrast",
    "equalize",
    "posterize",
    "rotate",
    "solarize",
    "shear_x",
    "shear_y",
    "translate_x",
    "translate_y",
)
AUTOCONTRAST, EQUALIZE, POSTERIZE, ROTATE, SOLARIZE, SHEAR_X, SHEAR_Y, TRANSLATE_X, TRANSLATE_Y = range(9)
IDENTITY = -1  # op id of an unused chain slot or of a step beyond a chain's depth
LUT_OPS = (AUTOCONTRAST, EQUALIZE, POSTERIZE, SOLARIZE)
GEOMETRIC_OPS = (ROTATE, SHEAR_X, SHEAR_Y, TRANSLATE_X, TRANSLATE_Y)
# torchvision's all_ops=True set (the reference code's AugMix): O plus the four ImageNet-C-overlapping ops
ALL_OPS = (*OPS, "brightness", "color", "contrast", "sharpness")
BRIGHTNESS, COLOR, CONTRAST, SHARPNESS = range(len(OPS), len(ALL_OPS))
COLOR_OPS = (BRIGHTNESS, COLOR, CONTRAST, SHARPNESS)


def _is_any(op: torch.Tensor, op_ids: tuple[int, ...]) -> torch.Tensor:
    """op in op_ids, elementwise: one lookup in a membership table over ALL_OPS, made once per device."""
    return _membership(tuple(op_ids), op.device)[op]


@functools.lru_cache(maxsize=32)
def _membership(op_ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[len(ALL_OPS)] bool, True at op_ids. Its blocking host-to-device copy happens once, on the first call."""
    table = torch.zeros(len(ALL_OPS), dtype=torch.bool)
    table[list(op_ids)] = True
    return table.to(device)


# ---------------------------------------------------------------------------------------------
# Pixel ops as per-sample-channel lookup tables (PIL.ImageOps semantics)
# ---------------------------------------------------------------------------------------------
def _autocontrast_lut(hist: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """ImageOps.autocontrast (cutoff 0): map [lo, hi] linearly onto [0, 255], truncating."""
    present = hist > 0
    lo = present.float().argmax(dim=2, keepdim=True)
    hi = 255 - present.flip(2).float().argmax(dim=2, keepdim=True)
    span = (hi - lo).clamp_min(1).float()
    lut = torch.floor((values - lo) * 255.0 / span).clamp(0, 255)
    return torch.where(hi > lo, lut, values)


def _equalize_lut(hist: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """ImageOps.equalize: step = (n - h[last]) // 255; lut[i] = (step // 2 + sum_{j<i} h[j]) // step."""
    present = hist > 0
    last = 255 - present.flip(2).float().argmax(dim=2, keepdim=True)
    step = torch.floor((hist.sum(dim=2, keepdim=True) - hist.gather(2, last)) / 255.0)
    below = torch.cumsum(hist, dim=2) - hist
    lut = torch.floor((torch.floor(step / 2.0) + below) / step.clamp_min(1.0)).clamp(0, 255)
    return torch.where(step > 0, lut, values)


def _posterize_lut(bits: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """ImageOps.posterize: keep the top `bits` bits (values & ~(2^(8 - bits) - 1))."""
    bucket = torch.pow(2.0, 8.0 - bits)[:, None, None]
    return torch.floor(values / bucket) * bucket


def _solarize_lut(threshold: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """ImageOps.solarize: invert the values >= threshold."""
    return torch.where(values >= threshold[:, None, None], 255.0 - values, values)


def _lut_ops(y: torch.Tensor, op: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """Autocontrast/equalize/posterize/solarize, image i by op[i], on the 8-bit quantized image
    (any other op id gets the identity table, i.e. just the quantization)."""
    n, c, h, w = y.shape
    q = (y * 255.0).round_().clamp_(0.0, 255.0).long().view(n, c, h * w)  # the 8-bit image
    hist = torch.zeros((n, c, 256), device=y.device, dtype=torch.float32)
    hist.scatter_add_(2, q, torch.ones((), device=y.device, dtype=torch.float32).expand(q.shape))
    values = torch.arange(256, device=y.device, dtype=torch.float32).expand(n, c, 256)

    lut = values
    for op_id, table in (
        (AUTOCONTRAST, _autocontrast_lut(hist, values)),
        (EQUALIZE, _equalize_lut(hist, values)),
        (POSTERIZE, _posterize_lut(magnitude, values)),
        (SOLARIZE, _solarize_lut(magnitude, values)),
    ):
        lut = torch.where((op == op_id)[:, None, None], table, lut)
    return torch.gather((lut / 255.0).to(y.dtype), 2, q).view(n, c, h, w)


# ---------------------------------------------------------------------------------------------
# Geometric ops as one batched affine resampling
# ---------------------------------------------------------------------------------------------
def _affine_theta(op: torch.Tensor, magnitude: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Per-image inverse maps in normalized coordinates (F.affine_grid's theta with
    align_corners=False), [N, 2, 3].

    In pixel coordinates (pixel centers at i + 0.5, as in PIL) an output point (x, y) samples
    the input at (a x + b y + c, d x + e y + f), PIL's AFFINE data (a, b, c, d, e, f):
    rotate by t degrees counter-clockwise about (W/2, H/2) as PIL's Image.rotate, shear_x
    (1, s, 0, 0, 1, 0), shear_y (1, 0, 0, s, 1, 0), translate_x (1, 0, t, 0, 1, 0), translate_y
    (1, 0, 0, 0, 1, t); identity for every other op. Converted to normalized coordinates
    x_n = 2x/W - 1, y_n = 2y/H - 1.
    """
    mag = magnitude.to(torch.float32)
    one, zero = torch.ones_like(mag), torch.zeros_like(mag)
    rad = torch.deg2rad(torch.where(op == ROTATE, mag, zero))
    cos, sin = torch.cos(rad), torch.sin(rad)
    cx, cy = width / 2.0, height / 2.0
    is_rot = op == ROTATE
    a = torch.where(is_rot, cos, one)
    e = torch.where(is_rot, cos, one)
    b = torch.where(is_rot, -sin, torch.where(op == SHEAR_X, mag, zero))
    d = torch.where(is_rot, sin, torch.where(op == SHEAR_Y, mag, zero))
    c = torch.where(is_rot, cx - cos * cx + sin * cy, torch.where(op == TRANSLATE_X, mag, zero))
    f = torch.where(is_rot, cy - sin * cx - cos * cy, torch.where(op == TRANSLATE_Y, mag, zero))
    ratio = height / width
    row_x = torch.stack([a, b * ratio, a + b * ratio + 2.0 * c / width - 1.0], dim=1)
    row_y = torch.stack([d / ratio, e, d / ratio + e + 2.0 * f / height - 1.0], dim=1)
    return torch.stack([row_x, row_y], dim=1)


def _affine_grid(theta: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """F.affine_grid(theta, [N, C, H, W], align_corners=False) computed by broadcasting, [N, H, W, 2].

    Pixel centers at x_n = (2j + 1)/W - 1; grid = theta @ (x_n, y_n, 1). About 3x faster on the
    CPU than affine_grid, which runs a batched matmul with an inner dimension of 3.
    """
    x_n = (torch.arange(width, device=theta.device, dtype=theta.dtype) * 2.0 + 1.0) / width - 1.0
    y_n = (torch.arange(height, device=theta.device, dtype=theta.dtype) * 2.0 + 1.0) / height - 1.0
    t = theta[:, :, :, None, None]  # [N, 2, 3, 1, 1]
    grid = t[:, :, 0] * x_n + t[:, :, 1] * y_n[:, None] + t[:, :, 2]  # [N, 2, H, W]
    return grid.permute(0, 2, 3, 1)


def _geometric_ops(y: torch.Tensor, op: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """Rotate/shear/translate, image i by op[i] (bilinear, fill 0; identity map for other ops)."""
    _n, _c, h, w = y.shape
    grid = _affine_grid(_affine_theta(op, magnitude, h, w).to(y.dtype), h, w)
    return F.grid_sample(y, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _apply_family(y, op, magnitude, family_ops, family_fn, compact: bool) -> torch.Tensor:
    """Replace the images whose op is in ``family_ops`` by ``family_fn``'s result, others kept.

    compact=False (accelerators): run the family on the whole batch and pick with torch.where;
    shapes never depend on the draws, so there is no host sync. compact=True (CPU, where
    reading the selection costs nothing): run it only on the selected images (index_select /
    index_copy). Both give the same result because every op acts on each image alone.
    """
    selected = _is_any(op, family_ops)
    if not compact:
        return torch.where(selected[:, None, None, None], family_fn(y, op, magnitude), y)
    idx = selected.nonzero().squeeze(1)
    if idx.numel() == 0:
        return y
    out = family_fn(y.index_select(0, idx), op.index_select(0, idx), magnitude.index_select(0, idx))
    return y.index_copy_(0, idx, out)  # in place: callers pass a tensor they own


def _color_ops(y: torch.Tensor, op: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """Brightness/color/contrast/sharpness (torchvision's adjust_*), image i by op[i] with the
    factor 1 + magnitude[i]: a blend f y + (1 - f) d with d black, gray, the gray mean, or the
    3x3-smoothed image (border pixels kept). Any other op id leaves the image unchanged."""
    f = (1.0 + magnitude.to(y.dtype)).view(-1, 1, 1, 1)
    gray = 0.2989 * y[:, 0:1] + 0.587 * y[:, 1:2] + 0.114 * y[:, 2:3]
    kernel = y.new_ones(3, 3)
    kernel[1, 1] = 5.0
    kernel = (kernel / 13.0).expand(y.shape[1], 1, 3, 3)
    smooth = y.clone()
    smooth[:, :, 1:-1, 1:-1] = F.conv2d(y, kernel, groups=y.shape[1])
    out = y
    for op_id, degenerate in (
        (BRIGHTNESS, torch.zeros_like(gray)),
        (COLOR, gray),
        (CONTRAST, gray.mean(dim=(1, 2, 3), keepdim=True)),
        (SHARPNESS, smooth),
    ):
        out = torch.where((op == op_id)[:, None, None, None], (f * y + (1.0 - f) * degenerate).clamp(0.0, 1.0), out)
    return out


def _apply_step(
    y: torch.Tensor,
    op: torch.Tensor,
    magnitude: torch.Tensor,
    compact: bool | None = None,
    all_ops: bool = False,
) -> torch.Tensor:
    """One chain step: image i gets op[i] with magnitude[i] (IDENTITY leaves it unchanged).
    compact defaults to True on the CPU only (see ``_apply_family``); y may be overwritten.
    all_ops: op ids may also be the four COLOR_OPS (the reference code's torchvision AugMix)."""
    if compact is None:
        compact = fastpath.compacts(y.device)
    y = _apply_family(y, op, magnitude, LUT_OPS, _lut_ops, compact)
    y = _apply_family(y, op, magnitude, GEOMETRIC_OPS, _geometric_ops, compact)
    if all_ops:
        y = _apply_family(y, op, magnitude, COLOR_OPS, _color_ops, compact)
    return y


def apply_op(x: torch.Tensor, op: str | int, magnitude: float | torch.Tensor = 0.0) -> torch.Tensor:
    """Apply one op of ALL_OPS to every image of x [N, C, H, W] in [0, 1] with the raw parameter
    ``magnitude`` (scalar or [N]): degrees, shear factor, pixels, bits kept, threshold, or the
    signed factor offset of the four color ops."""
    op_id = ALL_OPS.index(op) if isinstance(op, str) else int(op)
    n = x.shape[0]
    ops = torch.full((n,), op_id, device=x.device, dtype=torch.long)
    mag = torch.as_tensor(magnitude, device=x.device, dtype=torch.float32).expand(n)
    return _apply_step(x.float().clone(), ops, mag, all_ops=op_id in COLOR_OPS).to(x.dtype)
