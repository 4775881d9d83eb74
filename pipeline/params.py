"""params.yaml access with one clear error line naming the key."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

_MISSING = object()


class ParamError(ValueError):
    """A bad params.yaml entry. str(err) is one line naming the key."""


def load_params(path: str | Path = "params.yaml") -> dict:
    path = Path(path)
    if not path.is_file():
        raise ParamError(f"{path}: params file not found (run from the repository root)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ParamError(f"{path}: not valid YAML ({e.__class__.__name__})") from e
    if not isinstance(data, dict):
        raise ParamError(f"{path}: top level must be a mapping of stage groups")
    return data


def get(params: dict, key: str, types: type | tuple[type, ...] | None = None, default: Any = _MISSING,
        choices: tuple | None = None) -> Any:
    """Dotted lookup: get(p, "train.rounds", int). Raises ParamError naming the key."""
    node: Any = params
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            if default is not _MISSING:
                return default
            raise ParamError(f"params.yaml: missing key '{key}'")
        node = node[part]
    if types is not None:
        ok_types = types if isinstance(types, tuple) else (types,)
        # bool is an int in Python; never accept it for a numeric key
        if (isinstance(node, bool) and bool not in ok_types) or not isinstance(node, ok_types):
            names = " or ".join(t.__name__ for t in ok_types)
            raise ParamError(f"params.yaml: key '{key}' must be {names}, got {type(node).__name__} {node!r}")
    if choices is not None and node not in choices:
        raise ParamError(f"params.yaml: key '{key}' is {node!r}; choose one of {', '.join(map(str, choices))}")
    return node


def check_sweep(params: dict) -> None:
    """train.algorithms, train.seeds and train.held_out (the DVC matrix of the train stage): non-empty lists
    without repeats (a repeat would train and log the same run twice), held_out of indices >= 0."""
    for key, kind in (("train.algorithms", str), ("train.seeds", int), ("train.held_out", int)):
        values = get(params, key, list)
        if not values:
            raise ParamError(f"params.yaml: key '{key}' must be a non-empty list, got {values!r}")
        bad = [v for v in values if not isinstance(v, kind) or isinstance(v, bool)]
        if bad:
            raise ParamError(f"params.yaml: key '{key}' must list {kind.__name__} values, got {bad[0]!r}")
        repeats = sorted({repr(v) for v in values if values.count(v) > 1})
        if repeats:
            raise ParamError(f"params.yaml: key '{key}' lists {', '.join(repeats)} more than once "
                             "(each entry is one DVC stage and one MLflow run)")
    negative = [h for h in get(params, "train.held_out", list) if h < 0]
    if negative:
        raise ParamError(f"params.yaml: key 'train.held_out' holds indices into the manifest's domains, "
                         f"which start at 0; got {negative[0]}")
