"""mkdocs hooks (mkdocs.yml `hooks:`): text generated from the code at build time instead of committed.

A line `<!-- module-docstring: fedccrl_core.algorithms.fedfd -->` in a page becomes that module's docstring, as
written (a plain-text block: the docstrings lay out their equations line by line), read without importing it; the
line `<!-- fedccrl-variant-switches -->` becomes FedCCRL's table of variant switches, from their declarations.

The hyperparameters page is made from the registry of algorithms (fedccrl_core/algorithm_params/__init__.py's
PARAMS, each algorithm's `Params`), so the tables cannot drift from the code and a new algorithm's table needs no
edit here: `python scripts/mkdocs_hooks.py` prints the same text.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = "hyperparameters.md"
DOCSTRING = re.compile(r"^<!-- module-docstring: ([\w.]+) -->$", re.M)
SWITCHES = "<!-- fedccrl-variant-switches -->"  # FedCCRL's variant switches, from their declarations


def module_docstring(dotted: str) -> str:
    path = ROOT.joinpath(*dotted.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        raise ValueError(f"{path.relative_to(ROOT)} has no module docstring")
    return doc


def hyperparameters_markdown() -> str:
    from fedccrl_core.algorithm_params import PARAMS
    from fedccrl_core.foundation.hparams import markdown

    return markdown(dict(PARAMS))


def on_files(files, config):
    from mkdocs.structure.files import File

    stale = files.get_file_from_path(GENERATED)  # a copy written by hand into docs/ never wins
    if stale is not None:
        files.remove(stale)
    files.append(File.generated(config, GENERATED, content=hyperparameters_markdown()))
    return files


def on_page_markdown(markdown, page, config, files):
    if SWITCHES in markdown:
        from fedccrl_core.algorithm_params.fedccrl import switches_markdown

        markdown = markdown.replace(SWITCHES, switches_markdown())
    return DOCSTRING.sub(
        lambda m: f"```text\n{module_docstring(m[1])}\n```\n\n*From the docstring of `{m[1]}`.*", markdown
    )


if __name__ == "__main__":  # the hyperparameters page, as the docs site shows it
    print(hyperparameters_markdown(), end="")
