"""Serving preprocessing: exactly the training eval transform, parameterized only by the ONNX metadata.

file -> load_rgb -> resize_u8(S) -> normalize_u8(mean, std) -> float32 [3, S, S]
(fedccrl_core.data.images and fedccrl_core.learning.statistics: the functions the shards were built and the
model was evaluated with). A model whose recorded resize policy is not this installation's
RESIZE_POLICY is refused, since its inputs would not match what it was trained on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from fedccrl_core.data.images import RESIZE_POLICY, load_rgb, resize_u8
from fedccrl_core.data.tree import not_regular
from fedccrl_core.foundation.errors import FedCCRLError
from fedccrl_serving.metadata import ServingMetadata


def check_resize_policy(meta: ServingMetadata, source: str) -> None:
    if meta.resize != RESIZE_POLICY:
        raise FedCCRLError(
            f"{source}: the model was trained with resize policy {meta.resize!r}, but this "
            f"installation implements {RESIZE_POLICY!r}; refusing to serve with a different transform"
        )


def load_u8(path: str | os.PathLike, size: int) -> np.ndarray:
    """One file -> uint8 [S, S, 3]; raises DataError naming the file when it cannot be decoded
    (or when it is not a regular file: it is then never opened)."""
    why = not_regular(path)
    if why:
        raise FedCCRLError(f"{path}: {why}")
    return resize_u8(load_rgb(path), size)


def normalize(batch_u8: np.ndarray, meta: ServingMetadata) -> np.ndarray:
    """uint8 [N, S, S, 3] -> the model input: float32 [N, 3, S, S] normalized with the model's mean/std.

    numpy, not torch (serving imports no torch): the same float32 operations in the same order as
    fedccrl_core.learning.statistics.normalize_u8, x = (u8 / 255 - mean) / std; tests/test_serving.py pins the parity."""
    x = np.ascontiguousarray(batch_u8).transpose(0, 3, 1, 2).astype(np.float32) / np.float32(255.0)
    mean = np.asarray(meta.mean, dtype=np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(meta.std, dtype=np.float32).reshape(1, -1, 1, 1)
    return np.ascontiguousarray((x - mean) / std, dtype=np.float32)


def _try_load(path, size):
    try:
        return load_u8(path, size), None
    except Exception as e:  # one bad file is an error record, never the end of the run
        msg = str(e).splitlines()[0] if str(e) else e.__class__.__name__
        prefix = f"{path}: "
        return None, (msg[len(prefix) :] if msg.startswith(prefix) else msg)


def preprocess_files(paths: Sequence[Path], meta: ServingMetadata, workers: int = 1):
    """Decode a batch of files. Returns (x float32 [M, 3, S, S], indices of the M good files,
    {index: reason} of the bad ones). Decoding runs in `workers` threads (PIL releases the GIL)."""
    if workers > 1 and len(paths) > 1:
        pool = ThreadPoolExecutor(max_workers=workers)
        try:
            results = list(pool.map(lambda p: _try_load(p, meta.image_size), paths))
        finally:  # interrupted (Ctrl-C, --deadline): the queued files are dropped, not decoded first
            pool.shutdown(wait=False, cancel_futures=True)
    else:
        results = [_try_load(p, meta.image_size) for p in paths]
    good = [i for i, (u8, _) in enumerate(results) if u8 is not None]
    errors = {i: err for i, (_, err) in enumerate(results) if err is not None}
    size = meta.image_size
    batch = np.stack([results[i][0] for i in good]) if good else np.zeros((0, size, size, 3), np.uint8)
    return normalize(batch, meta), good, errors
