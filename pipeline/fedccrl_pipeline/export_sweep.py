"""`fedccrl export --models`: every run of the current sweep exported in one process (export_run.py `export` each), and
the worst parity over them as the stage's compact metric."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from fedccrl_core.foundation import contract
from fedccrl_core.foundation.fsio import write_text
from fedccrl_pipeline.export_run import export
from fedccrl_pipeline.quantize import Int8Settings

if TYPE_CHECKING:
    from fedccrl_pipeline.checked_export import ExportParity


def export_sweep(
    models: Path,
    params_path: Path,
    shards: Path,
    out: Path,
    summary: Path,
    min_agreement: float,
    batch_size: int,
    registered_model: str | None,
    use_mlflow: bool,
    int8: Int8Settings | None = None,
    results: Path | None = None,
) -> dict:
    """Every run of the current sweep (params train.algorithms x seeds x held_out), in one process:
    out/<algorithm>/s<seed>/d<held_out>/{model.onnx, parity.json, the card}, and the worst parity over them in
    `summary`. int8, results: as export's (each run's INT8 copy beside its model.onnx)."""
    from fedccrl_pipeline.params import load_config, run_dirs

    done: dict[str, ExportParity] = {}
    traces: dict = {}  # one trace per architecture, reused by its further models (onnx_export.export_onnx)
    for run in run_dirs(load_config(params_path), models):  # the whole params file validated first
        key = run.relative_to(models).as_posix()
        done[key] = export(
            run / contract.MODEL_FILE,
            shards,
            out / key,
            min_agreement,
            batch_size,
            registered_model,
            None,
            use_mlflow,
            traces,
            int8,
            results,
        )
    # the compact DVC metric: the worst figures over every run (each run's own numbers: out/<run>/parity.json)
    doc: dict[str, float | int] = {
        "min_top1_agreement": min(r.top1_agreement for r in done.values()),
        "max_abs_logit_diff": max(r.max_abs_logit_diff for r in done.values()),
        "runs": len(done),
    }
    if int8 is not None:  # the largest INT8 accuracy drop, in points (each run's gate: its parity.json "int8")
        doc["max_int8_drop_points"] = max(r.int8.accuracy_drop_points for r in done.values() if r.int8 is not None)
    write_text(summary, json.dumps(doc, indent=1) + "\n")
    return doc
