"""mkdocs hooks (mkdocs.yml `hooks:`): pages generated at build time instead of committed.

The hyperparameters page is made from the algorithms' declarations (`Params` in each module of
fedccrl_core/algorithms), so the tables cannot drift from the code: `python -m fedccrl_core.algorithms`
prints the same text.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = "hyperparameters.md"


def hyperparameters_markdown() -> str:
    if not sys.path or sys.path[0] != str(ROOT):   # this checkout's code, before any installed copy
        sys.path.insert(0, str(ROOT))
    from fedccrl_core.algorithms import ALGORITHMS
    from fedccrl_core.hparams import markdown

    return markdown({name: cls.Params for name, cls in ALGORITHMS.items()})


def on_files(files, config):
    from mkdocs.structure.files import File

    stale = files.get_file_from_path(GENERATED)   # a copy written by hand into docs/ never wins
    if stale is not None:
        files.remove(stale)
    files.append(File.generated(config, GENERATED, content=hyperparameters_markdown()))
    return files
