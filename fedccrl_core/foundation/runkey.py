"""A run's key: the hash of everything that determines it (params as written, the manifest, the training code).
It names the run's round checkpoint (a checkpoint is resumed only by the same run) and the sweep's parent run.

The training code is the library minus what training never runs: `viz` (figures over saved runs). The
benchmarks live outside the library (benchmarks/), so editing them, a figure or the serving side leaves every
resumable checkpoint valid.

Floor 0 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def params_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


NOT_TRAINING = ("viz", "outcomes")  # fedccrl_core's subpackages that training does not run


def training_sources() -> tuple[Path, list[Path]]:
    """The library's root and the sources a training run executes (every .py of fedccrl_core outside
    NOT_TRAINING), sorted."""
    import fedccrl_core

    root = Path(fedccrl_core.__file__).parent
    return root, sorted(f for f in root.rglob("*.py") if f.relative_to(root).parts[0] not in NOT_TRAINING)


def code_hash() -> str:
    """Hash of the training code: a round checkpoint is only resumed by the same code."""
    root, files = training_sources()
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]
