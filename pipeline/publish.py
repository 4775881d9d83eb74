"""`fedccrl publish`: everything after training, as one stage process. In order: evaluate every trained run on its
held-out domain (pipeline/evaluate.py), the report of them (pipeline/report.py), the ONNX export with its parity
check and MLflow model (pipeline/export.py), the figures (pipeline/figures.py).

Why one process: each of the four imports torch or MLflow (or both) and opens the MLflow store; as four DVC stages
they paid that, and DVC's own bookkeeping, four times: about 40 % of their wall time on 2 cores
(docs/benchmarks.md). The commands `fedccrl evaluate`, `report`, `export` and `figures` remain for running one step
alone; this stage runs the same functions with the same arguments.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from pipeline.cli import run_stage


def publish(shards: Path, pools: Path, models: Path, runs: Path, metrics: Path, summary: Path, table: Path,
            curves: Path, exports: Path, parity: Path, plots: Path, min_agreement: float, batch_size: int,
            params_path: Path) -> None:
    from pipeline.evaluate import evaluate_all
    from pipeline.export import export_sweep
    from pipeline.figures import figures
    from pipeline.params import load_config
    from pipeline.report import report

    load_config(params_path)  # the whole params file, before anything is read or written
    steps = (("evaluate", lambda: evaluate_all(shards, models, runs, params_path)),
             ("report", lambda: report(runs, metrics, table, curves, params_path, summary)),
             ("export", lambda: export_sweep(models, params_path, shards, exports, parity, min_agreement, batch_size,
                                             None, True)),
             ("figures", lambda: figures(shards, pools, models, runs, plots, params_path)))
    took = []
    for k, (name, step) in enumerate(steps, 1):
        print(f"publish: {k}/{len(steps)} {name}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        step()
        took.append(f"{name} {time.perf_counter() - t0:.1f}s")
    print(f"publish: done ({', '.join(took)})", file=sys.stderr, flush=True)


@click.command("publish")
@click.option("--shards", type=click.Path(path_type=Path), required=True, help="the partition stage output")
@click.option("--pools", type=click.Path(path_type=Path), required=True, help="the pools stage output")
@click.option("--models", type=click.Path(path_type=Path), required=True,
              help="the train stages' output root: models/<algorithm>/s<seed>/d<held_out>")
@click.option("--runs", type=click.Path(path_type=Path), required=True, help="evaluation results, one JSON per run")
@click.option("--metrics", type=click.Path(path_type=Path), required=True, help="the report's full figures (JSON)")
@click.option("--summary", type=click.Path(path_type=Path), required=True, help="the report's compact DVC metric")
@click.option("--table", type=click.Path(path_type=Path), required=True, help="the report's table (.md, and .csv beside)")
@click.option("--curves", type=click.Path(path_type=Path), required=True, help="per-round curves (CSV, a DVC plot)")
@click.option("--exports", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="root of <algorithm>/s<seed>/d<i>/{model.onnx, parity.json}")
@click.option("--parity", type=click.Path(path_type=Path), required=True, help="the worst parity over every run")
@click.option("--plots", type=click.Path(path_type=Path), required=True, help="folder of the figures' PNGs")
@click.option("--min-agreement", type=click.FloatRange(0.0, 1.0), default=0.999, show_default=True,
              help="fail when ONNX and PyTorch agree on fewer top-1 predictions than this")
@click.option("--batch-size", type=click.IntRange(min=1), default=256, show_default=True,
              help="images per batch of the parity check")
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
def command(shards, pools, models, runs, metrics, summary, table, curves, exports, parity, plots, min_agreement,
            batch_size, params_path):
    """Evaluate, report, export to ONNX and draw the figures: every step after training, in one process."""
    run_stage(publish, shards, pools, models, runs, metrics, summary, table, curves, exports, parity, plots,
              min_agreement, batch_size, params_path)
