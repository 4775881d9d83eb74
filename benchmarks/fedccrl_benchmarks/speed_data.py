"""The generated data of `fedccrl-bench speed`: the embedded synthetic dataset's renderer, resized to the bench's
size; client i draws from source domain i mod 3, the target is sketch.

Floor 5 (docs/architecture.md, "Layers"): research tooling, imported by no product module."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedccrl_benchmarks.speed_config import PACS_VAL_FRACTION, BenchConfig


def generate(n: int, domain_index: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n synthetic images of one domain (classes in turn), uint8 NHWC at size x size, and labels."""
    from PIL import Image

    from fedccrl_core.data.synthetic import CLASSES, DOMAINS, image_rng, render

    images, labels = np.empty((n, size, size, 3), dtype=np.uint8), np.empty(n, dtype=np.int64)
    for i in range(n):
        c = i % len(CLASSES)
        img = render(DOMAINS[domain_index], CLASSES[c], image_rng(seed, domain_index, c, i))
        if img.size != (size, size):
            img = img.resize((size, size), Image.Resampling.BILINEAR)
        images[i], labels[i] = np.asarray(img), c
    return images, labels


@dataclass
class BenchData:
    train: list[tuple[np.ndarray, np.ndarray]]  # per client
    val: list[tuple[np.ndarray, np.ndarray]]
    target: tuple[np.ndarray, np.ndarray]
    num_classes: int


def make_data(cfg: BenchConfig) -> BenchData:
    """Client i draws from source domain i mod 3 (photo, art, cartoon); the target is sketch."""
    from fedccrl_core.data.synthetic import CLASSES

    n_val = max(2, math.ceil(cfg.images_per_client * PACS_VAL_FRACTION))
    train, val = [], []
    for i in range(cfg.clients):
        x, y = generate(cfg.images_per_client + n_val, i % 3, cfg.size, cfg.seed + 1000 * (i // 3))
        train.append((x[n_val:], y[n_val:]))
        val.append((x[:n_val], y[:n_val]))
    return BenchData(train, val, generate(cfg.images_per_client, 3, cfg.size, cfg.seed), len(CLASSES))
