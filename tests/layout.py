"""The project's packages, as pyproject.toml's [tool.setuptools.packages.find] finds them: each source root of
`where` (the repository, pipeline/, serving/, benchmarks/) holds top-level packages named as `include` says, and a
module's path below its source root is its import path: pipeline/fedccrl_pipeline/train.py is fedccrl_pipeline.train."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIND = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
ROOTS = [REPO / where for where in FIND["where"]]  # the source roots
TOP = {  # import name -> folder
    init.parent.name: init.parent
    for root in ROOTS
    for pattern in FIND["include"]
    for init in sorted(root.glob(f"{pattern}/__init__.py"))
}


def module_name(path: Path) -> str:
    """The import name of a project file (an absolute path): its path below its package's source root."""
    (folder,) = [f for f in TOP.values() if path.is_relative_to(f)]
    parts = path.with_suffix("").relative_to(folder.parent).parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
