"""`fedccrl report`: the leave-one-domain-out table (FedCCRL Table 1 form), mean ± std across seeds.

Reads every results/runs/<algorithm>/s<seed>/d<i>.json and writes
  --metrics  results/metrics.json   DVC metrics: per algorithm and held-out domain, mean and std
                                    over seeds of final and val-selected target accuracy, plus Avg.
  --table    results/table.md       the paper-style table (Table 1 layout: one column per held-out domain)
             results/table.csv      the same numbers, one row per (selection, algorithm)
  --curves   results/curves.csv     per-round target accuracy in long form, one row per (run, held-out domain,
                                    round) with its `series` <algorithm>/s<seed>/<domain> (DVC plots: one line per
                                    series, .dvc/plots/series.json)
  --summary  results/summary.json   the compact DVC metric: per algorithm and held-out domain the mean final target
                                    accuracy over seeds, plus avg (`dvc metrics show` stays narrow)
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from fedccrl_core.foundation.fsio import atomic_file, write_text
from fedccrl_pipeline.stage_runtime import run_stage

if TYPE_CHECKING:
    from fedccrl_core.outcomes.evaluated import EvaluatedRun
    from fedccrl_core.outcomes.results import AlgorithmResult


def report(
    runs_dir: Path,
    metrics_out: Path,
    table_out: Path,
    curves_out: Path,
    params_path: Path | None = None,
    summary_out: Path | None = None,
) -> dict[str, AlgorithmResult]:
    from fedccrl_core.outcomes.results import (
        curve_rows,
        held_out_domains,
        load_results,
        summarize,
        summary_of,
        table_markdown,
        table_rows,
    )

    if params_path is not None:  # the stage validates the whole params file first, as every stage does
        from fedccrl_pipeline.params import load_config

        load_config(params_path, downloads=False)  # it reads results only: dataset.source does not apply
    runs = load_results(runs_dir)
    metrics = summarize(runs)
    lines = table_markdown(runs, metrics)
    write_text(metrics_out, json.dumps({alg: m.to_dict() for alg, m in metrics.items()}, indent=1))
    if summary_out is not None:
        write_text(summary_out, json.dumps(summary_of(metrics, held_out_domains(runs)), indent=1))
    write_text(table_out, "\n".join(lines))
    table_csv = table_out.with_suffix(".csv")
    for path, rows in ((table_csv, table_rows(runs, metrics)), (curves_out, curve_rows(runs))):
        with atomic_file(path, "w", newline="") as f:
            csv.writer(f).writerows(rows)
    print("\n".join(lines), file=sys.stderr)
    _log_to_parent(
        runs, [metrics_out, table_out, table_csv, curves_out, *([summary_out] if summary_out else [])], metrics
    )
    return metrics


def _log_to_parent(runs: list[EvaluatedRun], files: list[Path], metrics: dict[str, AlgorithmResult]) -> None:
    """The table goes to the sweep's MLflow parent run (found through a child run's parent tag)."""
    from fedccrl_pipeline.mlflow_store import mlflow_module, trained_run

    models_meta = [r.mlflow_run_id for r in runs if r.mlflow_run_id]
    if not models_meta:
        return
    run = trained_run(models_meta[0], "report")
    parent = run.data.tags.get("mlflow.parentRunId") if run is not None else None  # the sweep's parent run
    if not parent:
        return
    client = mlflow_module().MlflowClient()
    for f in files:
        if f.is_file():  # a FIFO or device output was streamed to its reader: nothing to read back
            client.log_artifact(parent, str(f), artifact_path="report")
    for alg, m in metrics.items():
        for key, v in (m.avg or {}).items():
            client.log_metric(parent, f"{alg}.avg_{key}", v)


@click.command("report")
@click.option("--runs", "runs_dir", type=click.Path(path_type=Path), required=True)
@click.option("--metrics", "metrics_out", type=click.Path(path_type=Path), required=True)
@click.option("--table", "table_out", type=click.Path(path_type=Path), required=True)
@click.option("--curves", "curves_out", type=click.Path(path_type=Path), required=True)
@click.option(
    "--summary",
    "summary_out",
    type=click.Path(path_type=Path),
    default=None,
    help="the compact DVC metric: mean final target accuracy per algorithm and held-out domain",
)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
def command(runs_dir, metrics_out, table_out, curves_out, summary_out, params_path):
    """Mean ± std across seeds per held-out domain; the paper-style table."""
    run_stage(report, runs_dir, metrics_out, table_out, curves_out, params_path, summary_out)
