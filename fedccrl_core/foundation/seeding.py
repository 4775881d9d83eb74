"""Every random draw is derived from (seed, round, client, ...) so a resumed run replays exactly.

Floor 0 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def derive_seed(seed: int, *keys) -> int:
    h = hashlib.sha256(repr((int(seed), *tuple(str(k) for k in keys))).encode()).digest()
    return int.from_bytes(h[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's global generators. torch's CPU generator, and the CUDA ones once
    CUDA is initialized: `torch.manual_seed` before that queues a lazy CUDA seeding with a formatted
    stack trace per call (0.3 ms, and a list that grows with every call of a CPU-only run; a cost paid
    per client and round). The engine moves the model to the device before any seeding it relies on."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def numpy_rng(seed: int, *keys) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, *keys))


def torch_generator(seed: int, *keys, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(seed, *keys))
    return g
