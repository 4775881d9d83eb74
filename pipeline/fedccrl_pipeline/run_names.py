"""How runs are named: params as MLflow spells them (params.yaml's dotted keys), and a sweep's parent run named
after the DVC experiment and the params it changed against the committed params.yaml."""

from __future__ import annotations

import os

from ruamel.yaml import YAMLError

from fedccrl_pipeline.git_state import committed_text
from fedccrl_pipeline.params_yaml import parse_yaml

MAX_RUN_NAME = 250  # MLflow's limit on a run name


def flatten(d: dict, prefix: str = "") -> dict:
    """{"train": {"lr": 0.003}} -> {"train.lr": 0.003}."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def dvc_experiment_name() -> str | None:
    """The name of the DVC experiment running this stage (`dvc exp run` sets DVC_EXP_NAME), else None."""
    return os.environ.get("DVC_EXP_NAME") or None


def changed_params(sweep_params: dict, baseline_yaml: str | None = None) -> dict | None:
    """The params of this sweep that differ from the committed params.yaml (`git show HEAD:params.yaml`: the
    experiment's baseline, also inside `dvc exp run --temp/--queue` copies), as dotted keys; None without git or
    when the committed file is not YAML. The baseline is read as params.yaml is (pipeline/fedccrl_pipeline/params.py: YAML 1.2
    floats, so `lr: 1e-3` is the number 0.001 on both sides)."""
    if baseline_yaml is None:
        baseline_yaml = committed_text("params.yaml")
        if baseline_yaml is None:
            return None
    try:
        doc = parse_yaml(baseline_yaml)
    except YAMLError:  # a broken committed file gives no baseline; the working one was validated
        return None
    if not isinstance(doc, dict):
        return None
    base = flatten(doc)
    now = flatten(sweep_params)
    return {k: v for k, v in now.items() if k in base and base[k] != v}


def sweep_run_name(exp_name: str | None, sweep_params: dict, sweep_key: str, baseline_yaml: str | None = None) -> str:
    """A parent run's name: the DVC experiment and its changed params (`gauge-damn train.fedccrl.lambda1=1`),
    `default` for the committed params, `sweep-<key>` when there is no git baseline to compare with."""
    changed = changed_params(sweep_params, baseline_yaml)
    if changed is None:
        return exp_name or f"sweep-{sweep_key[:8]}"
    parts = [exp_name] if exp_name else []
    parts += [f"{k}={v}" for k, v in changed.items()] or ([] if exp_name else ["default"])
    name = " ".join(parts)
    return name if len(name) <= MAX_RUN_NAME else name[: MAX_RUN_NAME - 1] + "…"
