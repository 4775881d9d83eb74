"""params.yaml read as DVC reads it (YAML 1.2, ruamel.yaml's safe loader), and one key set as `dvc exp run -S` sets
it; the file's typed model is params.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ruamel.yaml import YAML, YAMLError

from fedccrl_core.foundation.errors import ParamError


def read_yaml(path: str | Path = "params.yaml") -> dict:
    path = Path(path)
    if not path.is_file():
        raise ParamError(f"{path}: params file not found (run from the repository root)")
    try:
        data = parse_yaml(path.read_text())
    except YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ParamError(f"{path}: not valid YAML ({e.__class__.__name__}{where})") from e
    if not isinstance(data, dict):
        raise ParamError(f"{path}: top level must be a mapping of stage groups")
    return data


def parse_yaml(text: str) -> Any:
    """YAML text read as DVC reads params.yaml, with ruamel.yaml's safe loader (YAML 1.2: `1e-3` is the float
    0.001, `yes` a string, a repeated key an error); ruamel's YAMLError when it is not YAML."""
    return YAML(typ="safe").load(text)


def set_key(params: dict, dotted: str, value: Any) -> None:
    """Set params.yaml's key `dotted` (`train.fedccrl.r`) in `params` to `value`, as `dvc exp run -S` does. The key
    must exist: a typo is a ParamError naming it, not a new entry that nothing reads."""
    *head, last = dotted.split(".")
    node: Any = params
    for h in head:
        node = node.get(h) if isinstance(node, dict) else None
    if not isinstance(node, dict) or last not in node:
        raise ParamError(f"params.yaml has no key '{dotted}'")
    node[last] = value
