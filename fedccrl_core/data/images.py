"""Image decoding and THE resize policy of the project.

`load_rgb` turns any image file PIL can read into an 8-bit RGB PIL image, or raises DataError
naming the file. `resize_u8` is the one preprocessing resize of the project: the reference
implementation's `transforms.Resize((S, S))` on a PIL image, i.e. a direct resize to S x S with
PIL's BILINEAR filter (antialiased when shrinking) and no crop. The partition stage, the training
eval transform and ONNX serving all use this function, so the policy lives only here.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from fedccrl_core.foundation.errors import DataError

RESIZE_POLICY = "resize SxS bilinear (PIL, antialiased), no crop, RGB uint8"

# Names that are not samples at any level of an image tree (compared in lower case): OS thumbnails and folder
# settings, and the folder of resource forks that macOS zips carry (data/tree.py walks with this rule).
IGNORED_NAMES = frozenset({"thumbs.db", "desktop.ini", "__macosx"})


def is_ignored_name(name: str) -> bool:
    """Hidden files (.DS_Store, ._foo from macOS zips), OS thumbnails and __MACOSX are not samples."""
    return name.startswith(".") or name.lower() in IGNORED_NAMES


def _to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode -> RGB. Alpha is composited on white; 16-bit grey is scaled, not clipped."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode == "P":
        # palette images with a transparency entry carry alpha
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
        mode = img.mode
        if mode == "RGB":
            return img
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        a = np.asarray(img).astype(np.float64)
        # I;16* is 16-bit; "I" (32-bit int) comes from 16-bit PNGs in older Pillow: scale 0..65535
        hi = 65535.0 if (mode.startswith("I;16") or a.max(initial=0) > 255) else 255.0
        g = np.clip(np.rint(a * (255.0 / hi)), 0, 255).astype(np.uint8)
        return Image.fromarray(np.repeat(g[..., None], 3, axis=2), "RGB")
    if mode == "F":
        g = np.clip(np.rint(np.asarray(img, dtype=np.float64)), 0, 255).astype(np.uint8)
        return Image.fromarray(np.repeat(g[..., None], 3, axis=2), "RGB")
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    # L, 1, CMYK, YCbCr, HSV, RGBX ...
    return img.convert("RGB")


def _reason(path: Path, e: BaseException) -> str:
    if isinstance(e, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return f"decompression bomb refused ({e})"
    try:
        if path.stat().st_size == 0:
            return "zero-byte file"
    except OSError as se:
        return f"unreadable file ({se.strerror})"
    if isinstance(e, UnidentifiedImageError):
        return "not an image (format not recognized)"
    msg = str(e).splitlines()[0] if str(e) else e.__class__.__name__
    return f"corrupt or truncated image ({msg})"


def load_rgb(path: str | os.PathLike) -> Image.Image:
    """Decode `path` fully into an 8-bit RGB PIL image.

    Handles CMYK, grey (L, 1, I;16 16-bit), alpha (RGBA, LA: composited on white), palette images
    (P, with transparency), and the EXIF orientation tag. Keeps PIL's MAX_IMAGE_PIXELS
    decompression-bomb limit and turns its warning into an error. Raises DataError naming the file
    for a zero-byte, non-image, corrupt or truncated file (the pixel data is decoded with .load(),
    not just verify()'d).
    """
    path = Path(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                im.load()
                upright: Image.Image = im
                try:
                    upright = ImageOps.exif_transpose(im)
                except Exception:  # a broken EXIF block does not spoil valid pixels
                    pass
                rgb = _to_rgb(upright)
                rgb.load()
                if rgb is upright:
                    rgb = upright.copy()
    except (
        OSError,
        ValueError,
        SyntaxError,
        EOFError,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
        MemoryError,
    ) as e:
        # OSError covers UnidentifiedImageError, "image file is truncated", broken data streams
        raise DataError(f"{path}: {_reason(path, e)}") from e
    if rgb.size[0] < 1 or rgb.size[1] < 1:
        raise DataError(f"{path}: empty image ({rgb.size[0]}x{rgb.size[1]})")
    return rgb


def resize_u8(img: Image.Image, size: int) -> np.ndarray:
    """RESIZE_POLICY: RGB PIL image -> np.uint8 [size, size, 3], direct bilinear resize, no crop."""
    if img.mode != "RGB":
        img = _to_rgb(img)
    if img.size != (size, size):
        img = img.resize((size, size), Image.Resampling.BILINEAR)
    out = np.asarray(img, dtype=np.uint8)
    return np.ascontiguousarray(out)


def decode_resized(path: str | os.PathLike, size: int) -> np.ndarray:
    """load_rgb + resize_u8: a file -> uint8 [size, size, 3] (the preprocessing of every stage)."""
    return resize_u8(load_rgb(path), size)


# ---- parallel decoding (validate: check every file; partition: decode + resize once) ----

DEFAULT_WORKERS = 2  # the brief's pool of 2; FEDCCRL_DATA_WORKERS overrides
_INLINE_BELOW = 2000  # fewer items: decode in-process (starting a pool costs more than it saves)


def default_workers() -> int:
    env = os.environ.get("FEDCCRL_DATA_WORKERS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise DataError(f"FEDCCRL_DATA_WORKERS must be an int, got {env!r}") from None
    return max(1, min(DEFAULT_WORKERS, os.cpu_count() or 1))


def _strip_path(path: str, e: DataError) -> str:
    msg = str(e)
    return msg[len(path) + 2 :] if msg.startswith(path + ": ") else msg


def _check_one(path: str) -> tuple[str | None, str | None]:
    """Worker: (None if the file decodes else the reason, sha256 of the file's bytes or None)."""
    import hashlib

    try:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        return f"unreadable file ({e.strerror})", None
    try:
        load_rgb(path)
        return None, digest
    except DataError as e:
        return _strip_path(path, e), digest


def _decode_one(args: tuple[str, int]):
    path, size = args
    try:
        return decode_resized(path, size), None
    except DataError as e:
        return None, _strip_path(path, e)


def pool_map(fn, items: list, workers: int | None, label: str, progress: bool, inline_below: int | None = None):
    """Ordered map of fn (a module-level function) over items with a process pool; progress on stderr
    (fedccrl_core/foundation/progress.py). Fewer than `inline_below` items (default: decoding's break-even) run in-process."""
    from fedccrl_core.foundation.progress import progress as counter

    n = len(items)
    workers = default_workers() if workers is None else max(1, workers)
    with counter(n, label, progress) as bar:
        if workers == 1 or n < (_INLINE_BELOW if inline_below is None else inline_below):
            for it in items:
                yield fn(it)
                bar.update(1)
            return
        import multiprocessing as mp

        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        ctx = mp.get_context(method)
        chunk = max(1, min(64, n // (workers * 8) or 1))
        with ctx.Pool(workers) as pool:
            for r in pool.imap(fn, items, chunksize=chunk):
                yield r
                bar.update(1)


def check_images(
    paths: list[str | os.PathLike], workers: int | None = None, progress: bool = True, label: str = "validate"
) -> list[tuple[str | None, str | None]]:
    """Decode every file with load_rgb; per path (None if good else the reason, sha256 of its bytes)."""
    return list(pool_map(_check_one, [str(p) for p in paths], workers, label, progress))


def decode_images(
    paths: list[str | os.PathLike], size: int, workers: int | None = None, progress: bool = True, label: str = "decode"
):
    """Yield (uint8 [size,size,3] or None, reason or None) per path, in order (load_rgb + resize_u8)."""
    yield from pool_map(_decode_one, [(str(p), size) for p in paths], workers, label, progress)
