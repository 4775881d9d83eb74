"""Streamed bytes: the chunk size for hashing, downloading and extracting; sha256 of a file; sizes in MB.

Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import hashlib
import os

CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fmt_mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
