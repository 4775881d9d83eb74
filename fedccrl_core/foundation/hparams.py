"""Typed parameters, declared once: the base of every algorithm's hyperparameter declaration
(`Algorithm.Params`) and of the params.yaml schema (pipeline/fedccrl_pipeline/params.py), and the one place that turns a
validation failure into lines a user can act on.

A hyperparameter is declared with `hp(default, source, **bounds)`: its type is the annotation, its
default and allowed range sit beside it, and `source` (kept as the field's description) says where
the value comes from: the paper's equation or table, a reference implementation, or the reason for
our choice. params.yaml's `train.<algorithm>` groups, the documentation's hyperparameters page, the MLflow params and
the stages' validation all come from, or are tested against, these declarations.

Validation is strict: no silent coercion ("3" is not 3, true is not 1); an int is accepted where a
number is declared. Unknown keys are refused, so `lamda1` cannot pass as a typo of `lambda1`.


Floor 0 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, TypeVar, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

M = TypeVar("M", bound=BaseModel)  # the model `validate` checks data against, and returns an instance of


def _sha256_hex(v: str) -> str:
    s = v.strip().lower()
    if len(s) != 64 or any(c not in "0123456789abcdef" for c in s):
        raise ValueError("must be 64 hex digits (a sha256)")
    return s


Sha256 = Annotated[str, AfterValidator(_sha256_hex)]  # a sha256 in hex, read lower-case


class Declared(BaseModel):
    """Strict, closed, every default validated."""

    model_config = ConfigDict(strict=True, extra="forbid", validate_default=True)


class HParams(Declared):
    """An algorithm's hyperparameters (`train.<algorithm>` in params.yaml), frozen: validated once, then read as
    attributes (`alg.hp.lambda1`). An empty or null group takes every default."""

    model_config = ConfigDict(frozen=True)

    # Why train.privacy has no mechanism for what this algorithm releases ("" = it has: DP-FedAvg replaces Eq. 2 and
    # statistics rows are clipped and noised). Declared here, without torch, so that params.yaml's validation refuses
    # the combination before any run starts; the round loop checks the algorithm against it (federation/loop.py).
    dp_refusal: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _null_is_empty(cls, data):
        return {} if data is None else data

    @classmethod
    def sources(cls) -> dict[str, str]:
        return {name: f.description or "" for name, f in cls.model_fields.items()}

    def selected_problems(self, key: str) -> list[str]:
        """Problems that matter only when this algorithm is trained (listed in train.algorithms), one line
        each naming the key under `key` (= 'train.<name>'): a default that cannot run (CCST without
        AdaIN weights) must not fail the other algorithms' runs."""
        return []


def hp(default: Any, source: str, **bounds: Any) -> Any:
    """One hyperparameter: its default, its source (paper equation / table / reference code / our
    reason) and its bounds (gt, ge, lt, le, min_length, ...: pydantic's Field constraints)."""
    return Field(default, description=source, **bounds)


# ---- errors ------------------------------------------------------------------------------------------
_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "none_required": "null",
}


def _fields(model) -> dict:
    """A model's fields by the names params.yaml spells (alias or name); {} for anything that is not a model."""
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return {}
    return {(f.alias or n): f for n, f in model.model_fields.items()}


def _walk(data: Any, loc: tuple, model: type[BaseModel] | None = None) -> tuple[list, Any, bool]:
    """The data path of a pydantic error location (`e.errors()`' loc), the value found there and whether the key
    is present in the data. A part of the location is a key when the data has it or the model at that point
    declares it; any other part is pydantic's tag of a union member or validator ('int', 'literal[...]', ...)."""
    path, node, found, sub = [], data, True, model
    for part in loc:
        fields = _fields(sub)
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
            path.append(part)
            sub = next(iter(get_args(sub)), None) if get_origin(sub) is list else None  # list[M]: an item is an M
            continue
        elif isinstance(node, dict) and part in fields:
            node, found = None, False  # a declared key the data lacks
        else:
            continue  # a tag, or a location inside a value that is not a mapping
        path.append(part)
        f = fields.get(part)
        sub = f.annotation if f is not None else None
    return path, node, found


def dotted(path: list) -> str:
    """['train', 'held_out', 0] -> 'train.held_out[0]'."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _field(model: type[BaseModel] | None, path: list):
    """The FieldInfo at `path` inside `model` (through nested models), or None."""
    f = None
    for part in path:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        f = model.model_fields[part]
        ann = f.annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return f


def _num(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def describe_bounds(field) -> str:
    """'in (0, 1]', '>= 1', ... from a field's declared constraints ('' when it has none)."""
    lo = hi = None
    for m in getattr(field, "metadata", []):
        for name in ("gt", "ge", "lt", "le"):
            v = getattr(m, name, None)
            if v is not None:
                if name in ("gt", "ge"):
                    lo = (name, v)
                else:
                    hi = (name, v)
    if lo and hi:
        return f"in {'(' if lo[0] == 'gt' else '['}{_num(lo[1])}, {_num(hi[1])}{')' if hi[0] == 'lt' else ']'}"
    sym = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    return " and ".join(f"{sym[b[0]]} {_num(b[1])}" for b in (lo, hi) if b)


def _is_int(field, loc: tuple) -> bool:
    ann = getattr(field, "annotation", None)
    return ann is int or int in get_args(ann) or any(isinstance(p, str) and p.endswith("int") for p in loc)


def _expected(err: Mapping[str, Any], field) -> str:  # one of pydantic's ValidationError.errors()
    t, ctx = err["type"], err.get("ctx") or {}
    if t in _TYPE_WORDS:
        return _TYPE_WORDS[t]
    if t == "literal_error":
        return "one of " + ctx.get("expected", "").replace("'", "").replace(" or ", ", ")
    if t in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        bounds = describe_bounds(field) if field is not None else ""
        if not bounds:
            sym = {
                "greater_than": "> {gt}",
                "greater_than_equal": ">= {ge}",
                "less_than": "< {lt}",
                "less_than_equal": "<= {le}",
            }[t]
            bounds = sym.format(**{k: _num(v) for k, v in ctx.items()})
        kind = "an integer" if _is_int(field, tuple(err["loc"])) else "a number"
        return f"{kind} {bounds}"
    if t in ("too_short", "too_long"):
        lo = next((m.min_length for m in getattr(field, "metadata", []) if getattr(m, "min_length", None)), None)
        hi = next((m.max_length for m in getattr(field, "metadata", []) if getattr(m, "max_length", None)), None)
        if lo is not None and lo == hi:
            return f"must have exactly {lo} entries"
        n = ctx.get("min_length") if t == "too_short" else ctx.get("max_length")
        return f"must have at {'least' if t == 'too_short' else 'most'} {n} entr{'y' if n == 1 else 'ies'}"
    if t in ("value_error", "assertion_error"):
        msg = str(ctx.get("error", err["msg"]))
        return msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    return err["msg"]


class _Default:
    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return f"{self.value!r} (the default)"


def _fmt(v: Any) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def problems(
    err: ValidationError, data: Any, model: type[BaseModel] | None = None, prefix: str = "", file: str = "params.yaml"
) -> list[str]:
    """One line per problem: `<file>: key '<dotted.key>': got <value>; allowed: <what>`. Errors that are
    alternatives of one union at one key become one line ('an integer or a string')."""
    merged: dict[tuple, dict] = {}
    for e in err.errors(include_url=False):
        path, value, found = _walk(data, tuple(e["loc"]), model)
        key = dotted([prefix] * bool(prefix) + path)
        entry = merged.setdefault(
            (key, e["type"] == "extra_forbidden", e["type"] == "missing"), {"value": value, "expected": []}
        )
        parent = path[:-1] if e["type"] == "extra_forbidden" else path
        f = _field(model, path) if model is not None else None
        if not found and f is not None and e["type"] != "missing":  # a default checked against a value given
            entry["value"] = _Default(f.default)
        if e["type"] == "extra_forbidden":
            owner = _field(model, parent) if parent else None
            sub = owner.annotation if owner is not None else model
            allowed = sorted(sub.model_fields) if isinstance(sub, type) and issubclass(sub, BaseModel) else []
            entry["expected"] = [f"allowed keys here: {', '.join(allowed) or 'none'}"]
        elif e["type"] == "missing":
            entry["expected"] = ["this key is required"]
        else:
            what = _expected(e, f)
            if what not in entry["expected"]:
                entry["expected"].append(what)
    lines = []
    for (key, unknown, missing), entry in merged.items():
        where = f"{file}: key '{key}'" if key else f"{file}"
        if unknown:
            lines.append(f"{where}: unknown key (value {_fmt(entry['value'])}); {entry['expected'][0]}")
        elif missing:
            lines.append(f"{where}: missing; {entry['expected'][0]}")
        else:
            exp = entry["expected"]
            simple = all(
                x in _TYPE_WORDS.values() or x.startswith(("one of ", "a number ", "an integer ")) for x in exp
            )
            what = ("must be " + " or ".join(exp)) if simple else "; ".join(exp)
            lines.append(f"{where}: got {_fmt(entry['value'])}; {what}")
    return lines


def validate(model: type[M], data: Any, prefix: str = "", file: str = "params.yaml") -> M:
    """model.model_validate(data), or ParamError with one line per problem."""
    from fedccrl_core.foundation.errors import ParamError

    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ParamError(*problems(e, data, model, prefix, file)) from None


# ---- the documentation table ---------------------------------------------------------------------------
def _type_name(ann: Any) -> str:
    """A declared annotation in the words the errors use: int, number, bool, string, list, mapping, a | b."""
    import types
    from typing import Annotated, Literal, Union, get_origin

    origin, args = get_origin(ann), get_args(ann)
    if ann is type(None):
        return "null"
    if origin is Literal:
        return " \\| ".join(str(a) for a in args)
    if origin is Annotated:
        return _type_name(args[0])
    if origin in (Union, types.UnionType):
        return " or ".join(dict.fromkeys(_type_name(a) for a in args))
    if origin is not None:
        return {list: "list", tuple: "list", dict: "mapping"}.get(origin, str(origin))
    return {int: "int", float: "number", bool: "bool", str: "string", dict: "mapping", list: "list"}.get(
        ann, getattr(ann, "__name__", str(ann))
    )


def markdown(groups: dict[str, type[HParams]]) -> str:
    """The documentation site's hyperparameters page: one table per `train.<name>` group, each row a declared
    hyperparameter's key, type, default, allowed range and source, straight from the declarations. The page is
    generated when the site is built (scripts/mkdocs_hooks.py), never committed, so it cannot go stale."""
    out = [
        "# Hyperparameters",
        "",
        "Generated from each algorithm's declaration (`Params` in `fedccrl_core/algorithms/<name>.py`) by",
        "`make docs` when the site is built (`python scripts/mkdocs_hooks.py` prints the same text). params.yaml's",
        "`train.<algorithm>` groups hold these defaults; `-S train.<algorithm>.<key>=<value>` overrides one.",
        "",
    ]
    for name, params in groups.items():
        out += [f"## `train.{name}`", ""]
        if not params.model_fields:
            out += ["No hyperparameters (the group is empty: `{}`).", ""]
            continue
        out += ["| key | type | default | allowed | source |", "|---|---|---|---|---|"]
        for key, f in params.model_fields.items():
            default = (
                "null"
                if f.default is None
                else str(f.default).lower()
                if isinstance(f.default, bool)
                else _num(f.default)
            )
            source = (f.description or "").replace("|", "\\|")
            out.append(f"| `{key}` | {_type_name(f.annotation)} | `{default}` | {describe_bounds(f)} | {source} |")
        out.append("")
    return "\n".join(out)
