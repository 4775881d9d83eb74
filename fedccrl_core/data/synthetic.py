"""The embedded `synthetic` dataset: a tiny PACS-like domain-generalization benchmark, generated offline.

Six shape classes appear in four domains that differ in *style* the way PACS's domains do:

- photo:   smooth two-colour gradient background with low-frequency blotches and sensor noise;
           the shape is filled with a varied colour and shaded by a directional light; no outline.
- art:     the whole canvas is brush strokes in a limited warm palette; the shape is painted with
           strokes of a contrasting warm tone; no outline.
- cartoon: plain pastel background; flat bright fill; thick dark outline.
- sketch:  white paper; the shape is only a black outline of jittery, doubled pencil strokes.

Every image draws its class's shape at a random position, scale and rotation, on a 64x64 canvas
(PIL ImageDraw + numpy), saved as PNG under `<domain>/<class>/<i>.png`. Generation is
deterministic: image i of (domain d, class c) uses numpy's Generator seeded with
SeedSequence([seed, d, c, i]), so the same `dataset.seed` gives byte-identical files regardless of
generation order. The tree then goes through the same validate and partition path as real data.

Shapes are drawn upright +-26 degrees (MAX_ROTATION), 15-25 px in radius, so that ~40 images per
class and domain are enough for a small CNN at 32 px to learn the classes. The shift is real and,
as in PACS, uneven: with a tiny CNN trained 20 epochs on three domains (seed 0, 32 px), in-domain
validation accuracy was 0.72-0.86 while the held-out domain scored photo 0.59, art 0.40,
cartoon 0.83 (flat fills + outlines: the "easy" target, like PACS photo), sketch 0.46 (chance
0.17). tests/test_data_synthetic.py pins the art case.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import colorsys
import itertools
import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

DOMAINS = ("photo", "art", "cartoon", "sketch")  # registry order = held-out index order
CLASSES = ("circle", "square", "triangle", "star", "cross", "ring")
IMAGES_PER_CLASS = 40  # per class per domain: 240 per domain, 960 in all
CANVAS = 64
MAX_ROTATION = np.pi / 7  # +-25.7 degrees around the upright pose

_WARM = np.array(
    [
        (178, 34, 34),
        (230, 115, 0),
        (204, 153, 51),
        (160, 82, 45),
        (240, 190, 60),
        (128, 0, 32),
        (240, 128, 96),
        (210, 180, 140),
    ],
    dtype=np.float64,
)


# ---------------------------------------------------------------- shapes
def _circle(n: int, radius: float = 1.0) -> np.ndarray:
    t = np.linspace(0.0, 2 * np.pi, n, endpoint=False)
    return radius * np.stack([np.cos(t), np.sin(t)], axis=1)


def _shape_contours(cls: str) -> list[np.ndarray]:
    """Unit-size closed contours (first = outer boundary, others = holes), centred at 0."""
    if cls == "circle":
        return [_circle(40)]
    if cls == "ring":
        return [_circle(40), _circle(32, 0.55)]
    if cls == "square":
        return [_circle(4, 1.0) @ np.array([[0.7071, -0.7071], [0.7071, 0.7071]]).T]
    if cls == "triangle":
        return [_circle(3, 1.1) @ np.array([[0.0, 1.0], [-1.0, 0.0]]).T]
    if cls == "star":
        pts = _circle(10, 1.1) @ np.array([[0.0, 1.0], [-1.0, 0.0]]).T
        pts[1::2] *= 0.42
        return [pts]
    if cls == "cross":
        w = 0.34
        return [
            np.array(
                [
                    (w, -1),
                    (w, -w),
                    (1, -w),
                    (1, w),
                    (w, w),
                    (w, 1),
                    (-w, 1),
                    (-w, w),
                    (-1, w),
                    (-1, -w),
                    (-w, -w),
                    (-w, -1),
                ],
                dtype=np.float64,
            )
        ]
    raise ValueError(f"unknown synthetic class {cls!r}")


def _place(cls: str, rng: np.random.Generator) -> list[np.ndarray]:
    """Random scale, rotation and position of a class's contours, in pixel coordinates."""
    r = rng.uniform(15.0, 25.0)
    theta = rng.uniform(-MAX_ROTATION, MAX_ROTATION)
    cx, cy = rng.uniform(r + 3, CANVAS - r - 3, size=2)
    rot = np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
    return [c @ rot.T * r + np.array([cx, cy]) for c in _shape_contours(cls)]


def _mask(contours: list[np.ndarray]) -> np.ndarray:
    m = Image.new("L", (CANVAS, CANVAS), 0)
    d = ImageDraw.Draw(m)
    d.polygon([tuple(p) for p in contours[0]], fill=255)
    for hole in contours[1:]:
        d.polygon([tuple(p) for p in hole], fill=0)
    return np.asarray(m, dtype=np.float64)[..., None] / 255.0


def _hsv(h: float, s: float, v: float) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(h % 1.0, s, v)) * 255.0


def _closed(c: np.ndarray) -> list[tuple[float, float]]:
    return [tuple(p) for p in np.vstack([c, c[:1]])]


# ---------------------------------------------------------------- domain styles
def _low_freq(rng: np.random.Generator, amp: float) -> np.ndarray:
    field = rng.normal(0.0, 1.0, size=(4, 4, 3))
    chans = [
        np.asarray(
            Image.fromarray(field[..., k].astype(np.float32), "F").resize((CANVAS, CANVAS), Image.Resampling.BILINEAR)
        )
        for k in range(3)
    ]
    return np.stack(chans, axis=2) * amp


def _photo(cls: str, rng: np.random.Generator) -> Image.Image:
    yy, xx = np.mgrid[0:CANVAS, 0:CANVAS] / (CANVAS - 1)
    a = rng.uniform(0, 2 * np.pi)
    t = np.cos(a) * xx + np.sin(a) * yy
    t = ((t - t.min()) / (np.ptp(t) + 1e-9))[..., None]
    h = rng.uniform()
    c0 = _hsv(h, rng.uniform(0.2, 0.5), rng.uniform(0.45, 0.85))
    c1 = _hsv(h + rng.uniform(-0.12, 0.12), rng.uniform(0.2, 0.5), rng.uniform(0.45, 0.85))
    bg = c0 * (1 - t) + c1 * t + _low_freq(rng, 12.0)
    m = _mask(_place(cls, rng))
    # the object's colour is set off from the background: another hue, and darker or brighter
    v = rng.uniform(0.1, 0.3) if rng.uniform() < 0.5 else rng.uniform(0.9, 1.0)
    fill = _hsv(h + 0.5 + rng.uniform(-0.2, 0.2), rng.uniform(0.5, 1.0), v)
    la = rng.uniform(0, 2 * np.pi)  # directional light over the shape
    light = (np.cos(la) * (xx - 0.5) + np.sin(la) * (yy - 0.5))[..., None]
    shaded = fill * (1.0 + 0.7 * light) + 20.0 * light + _low_freq(rng, 6.0)
    img = bg * (1 - m) + shaded * m + rng.normal(0.0, 5.0, size=(CANVAS, CANVAS, 3))
    return Image.fromarray(np.clip(np.rint(img), 0, 255).astype(np.uint8), "RGB")


def _strokes(
    draw: ImageDraw.ImageDraw,
    rng: np.random.Generator,
    palette: np.ndarray,
    n: int,
    base_angle: float,
    width: tuple[int, int],
    length: tuple[float, float],
) -> None:
    rows = palette.tolist()  # plain floats: the same products and clipping as numpy's, a fraction of the time
    for _ in range(n):
        x, y = rng.uniform(-4, CANVAS + 4, size=2).tolist()
        ang = base_angle + rng.normal(0.0, 0.35)
        ln = rng.uniform(*length)
        row, gain = rows[rng.integers(len(rows))], rng.uniform(0.8, 1.1)
        col = tuple(int(min(max(v * gain, 0.0), 255.0)) for v in row)
        draw.line(
            [(x, y), (x + ln * math.cos(ang), y + ln * math.sin(ang))],
            fill=col,
            width=int(rng.integers(width[0], width[1] + 1)),
        )


def _art(cls: str, rng: np.random.Generator) -> Image.Image:
    k = rng.permutation(len(_WARM))
    bg_pal = _WARM[k[:3]]
    # the shape is painted in one warm tone pushed much darker or much lighter than the background
    base = _WARM[k[3]]
    tone = base * 0.35 if rng.uniform() < 0.5 else base + (255.0 - base) * 0.7
    fg_pal = np.stack([tone, tone * 0.9, np.clip(tone * 1.1, 0, 255)])
    bg = Image.new("RGB", (CANVAS, CANVAS), tuple(int(v) for v in bg_pal[0]))
    _strokes(ImageDraw.Draw(bg), rng, bg_pal, 80, rng.uniform(0, np.pi), (3, 6), (6.0, 14.0))
    fg = Image.new("RGB", (CANVAS, CANVAS), tuple(int(v) for v in fg_pal[0]))
    _strokes(ImageDraw.Draw(fg), rng, fg_pal, 50, rng.uniform(0, np.pi), (2, 4), (4.0, 9.0))
    m = _mask(_place(cls, rng))
    img = np.asarray(bg, dtype=np.float64) * (1 - m) + np.asarray(fg, dtype=np.float64) * m
    return Image.fromarray(np.clip(np.rint(img), 0, 255).astype(np.uint8), "RGB")


def _cartoon(cls: str, rng: np.random.Generator) -> Image.Image:
    bg = _hsv(rng.uniform(), rng.uniform(0.1, 0.3), rng.uniform(0.9, 1.0))
    img = Image.new("RGB", (CANVAS, CANVAS), tuple(int(v) for v in bg))
    d = ImageDraw.Draw(img)
    contours = _place(cls, rng)
    fill = tuple(int(v) for v in _hsv(rng.uniform(), rng.uniform(0.8, 1.0), rng.uniform(0.9, 1.0)))
    d.polygon([tuple(p) for p in contours[0]], fill=fill)
    for hole in contours[1:]:
        d.polygon([tuple(p) for p in hole], fill=tuple(int(v) for v in bg))
    ink = tuple(int(v) for v in rng.uniform(0, 40, size=3))
    for c in contours:
        d.line(_closed(c), fill=ink, width=3, joint="curve")
    return img


def _jitter_path(c: np.ndarray, rng: np.random.Generator, sigma: float) -> list[tuple[float, float]]:
    pts = np.vstack([c, c[:1]])
    dense = []
    for p, q in itertools.pairwise(pts):
        n = max(2, int(np.linalg.norm(q - p) / 2.0))
        dense.append(p + (q - p) * (np.arange(n) * (1.0 / n))[:, None])  # np.linspace(0, 1, n, endpoint=False)
    dense.append(pts[-1:])
    path = np.vstack(dense)
    path = path + rng.normal(0.0, sigma, size=path.shape)
    return list(map(tuple, path.tolist()))


def _sketch(cls: str, rng: np.random.Generator) -> Image.Image:
    paper = 255.0 - np.abs(rng.normal(0.0, 4.0, size=(CANVAS, CANVAS, 1))) * np.ones(3)
    img = Image.fromarray(np.clip(np.rint(paper), 0, 255).astype(np.uint8), "RGB")
    d = ImageDraw.Draw(img)
    for c in _place(cls, rng):
        for _ in range(2):  # doubled pencil strokes
            g = int(rng.uniform(0, 70))
            d.line(_jitter_path(c, rng, 0.7), fill=(g, g, g), width=1)
    return img


_STYLES = {"photo": _photo, "art": _art, "cartoon": _cartoon, "sketch": _sketch}


def render(domain: str, cls: str, rng: np.random.Generator) -> Image.Image:
    """One 64x64 RGB image of class `cls` in the style of `domain`."""
    if domain not in _STYLES:
        raise ValueError(f"unknown synthetic domain {domain!r}; choose one of {', '.join(DOMAINS)}")
    return _STYLES[domain](cls, rng)


def image_rng(seed: int, domain_index: int, class_index: int, i: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(seed), domain_index, class_index, i]))


def generate(
    out_dir: str | Path,
    seed: int = 0,
    images_per_class: int = IMAGES_PER_CLASS,
    domains: tuple[str, ...] = DOMAINS,
    classes: tuple[str, ...] = CLASSES,
    progress: bool = True,
    workers: int | None = None,
) -> int:
    """Write `<out_dir>/<domain>/<class>/<i:04d>.png`; return the number of images written. Each image has its own
    generator (`image_rng`), so the files are the same whatever the number of worker processes (default: one per
    core, fedccrl_core/data/images.py)."""
    from fedccrl_core.data.images import pool_map

    out = Path(out_dir)
    items = []
    for d in domains:
        di = DOMAINS.index(d)
        for c in classes:
            ci = CLASSES.index(c)
            (out / d / c).mkdir(parents=True, exist_ok=True)
            items += [
                (str(out / d / c / f"{i:04d}.png"), d, c, (int(seed), di, ci, i)) for i in range(images_per_class)
            ]
    # rendering costs about 2 ms an image: a pool pays from a few hundred images on
    return sum(pool_map(_write, items, workers, "synthetic", progress, inline_below=256))


def _write(item) -> int:
    path, domain, cls, key = item
    render(domain, cls, image_rng(*key)).save(path, format="PNG")
    return 1
