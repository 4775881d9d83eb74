"""Streamed bytes: the chunk size for hashing, downloading and extracting; sha256 of a file, and a file refused when
it is not the one named by its digest; sizes in MB.

Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import hashlib
import os

from fedccrl_core.foundation.errors import DataError

CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fmt_mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def require_sha256(path: str | os.PathLike, want: str | None, where: str) -> None:
    """DataError naming `where` and both digests when the file at `path` does not have sha256 `want`: refused."""
    got = sha256_file(path)
    if got != want:
        raise DataError(f"{where}: refused: its sha256 is {got}, expected {want}")
