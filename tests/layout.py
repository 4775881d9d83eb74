"""The project's packages: each top-level import name and the folder that holds it, as pyproject.toml's
[tool.setuptools] declares them (a folder named otherwise is mapped by `package-dir`)."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_SETUP = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGES: list[str] = _SETUP["packages"]
TOP = {p: _SETUP.get("package-dir", {}).get(p, p) for p in PACKAGES if "." not in p}  # import name -> folder


def module_name(path: Path) -> str:
    """The import name of a project file: pipeline/train.py -> fedccrl_pipeline.train."""
    folder, *rest = path.relative_to(REPO).with_suffix("").parts
    (top,) = [name for name, f in TOP.items() if f == folder]
    parts = [top, *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
