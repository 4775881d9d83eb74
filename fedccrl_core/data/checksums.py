"""Streamed bytes: the chunk size for hashing, downloading and extracting; sha256 of a file; sizes in MB.

Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import hashlib
import os

from fedccrl_core.foundation.errors import DataError

CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_sha256_format(sha: str, what: str) -> str:
    s = sha.strip().lower()
    if len(s) != 64 or any(c not in "0123456789abcdef" for c in s):
        raise DataError(f"params.yaml: {what} must be 64 hex digits, got {sha!r}")
    return s


def fmt_mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
