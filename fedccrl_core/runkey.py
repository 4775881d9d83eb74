"""A run's key: the hash of everything that determines it (params as written, the manifest, the library's code).
It names the run's round checkpoint (a checkpoint is resumed only by the same run) and the sweep's parent run."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path


def params_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def code_hash() -> str:
    """Hash of the library's source: a round checkpoint is only resumed by the same code."""
    import fedccrl_core

    root = Path(fedccrl_core.__file__).parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]
