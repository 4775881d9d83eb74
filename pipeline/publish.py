"""`fedccrl publish`: everything after training, as one stage. This process evaluates every trained run on its
held-out domain (pipeline/evaluate.py), reports them (pipeline/report.py) and draws the figures
(pipeline/figures.py); meanwhile a second process exports every model to ONNX with its parity check
(pipeline/export.py's export_sweep, as `fedccrl export --models --no-mlflow`). It names each model it has written
through a pipe, and this process logs that model to MLflow (export.log_exported) once its own steps are done. The
export is one thread of Python (torch's dynamo exporter) for most of its time, a long serial path: it uses the
second core beside the rest and leaves to this process what this process can do.

A model's files appear before it is logged (`fedccrl export` logs first): if logging fails, the stage fails, and
DVC records no output of it.

Why one stage: each of the four imports torch or MLflow (or both) and opens the MLflow store; as four DVC stages
they paid that, and DVC's own bookkeeping, four times (docs/benchmarks.md). The commands `fedccrl evaluate`,
`report`, `export` and `figures` remain for running one step alone; this stage runs them with the same arguments.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click

from fedccrl_core.errors import FedCCRLError
from pipeline.cli import folders_apart, run_stage


def publish(shards: Path, pools: Path, models: Path, runs: Path, metrics: Path, summary: Path, table: Path,
            curves: Path, exports: Path, parity: Path, plots: Path, min_agreement: float, batch_size: int,
            params_path: Path) -> None:
    from pipeline.evaluate import evaluate_all, trained_runs
    from pipeline.figures import Figures, drawing_processes
    from pipeline.params import load_config
    from pipeline.report import report

    # the folders, the whole params file and every trained run, before any process starts or anything is written
    folders_apart({"shards": shards, "pools": pools, "models": models},
                  {"runs": runs, "exports": exports, "plots": plots})
    trained_runs(load_config(params_path), models)
    took = []
    # the figures' drawing processes first, then the curves (training histories only): they are drawn while this
    # process imports torch, and the export is forked then
    with drawing_processes() as drawing, Figures(shards, models, plots, params_path, drawing) as figs:
        figs.curves()
        export, names = _start_export(models, params_path, shards, exports, parity, min_agreement, batch_size)
        try:
            steps = (("figures of the models", lambda: figs.model_figures(pools)),  # the t-SNE starts early
                     ("evaluate", lambda: evaluate_all(shards, models, runs, params_path)),
                     ("report", lambda: report(runs, metrics, table, curves, params_path, summary)),
                     ("confusion matrices", lambda: figs.confusions(runs)))
            for k, (name, step) in enumerate(steps, 1):
                print(f"publish: {k}/{len(steps)} {name} (the export runs beside)", file=sys.stderr, flush=True)
                t0 = time.perf_counter()
                step()
                took.append(f"{name} {time.perf_counter() - t0:.1f}s")
            t0 = time.perf_counter()
            logged = _log_exports(names, models, exports, shards)
            export.join()
            code = export.exitcode
            took.append(f"then logged {logged} models to MLflow while the export ran, "
                        f"{time.perf_counter() - t0:.1f}s")
        finally:
            names.close()
            if export.is_alive():  # this process failed or was stopped: the export stops with it
                export.terminate()
                export.join()
        t0 = time.perf_counter()
    took.append(f"and {time.perf_counter() - t0:.1f}s for the drawings")
    figs.log()
    if code != 0:
        raise FedCCRLError(f"publish: the ONNX export failed (exit code {code}; its error is above): no exports")
    print(f"publish: done ({', '.join(took)})", file=sys.stderr, flush=True)


def _start_export(models, params_path, shards, exports, parity, min_agreement, batch_size):
    """export_sweep of the whole sweep in a child process, forked once this process has imported torch (about 2.5 s
    of CPU the child then does not repeat) and before it has run anything with it (no OpenMP or CUDA state exists
    yet to be shared by the fork), and before it imports MLflow, which the child does not use. Returns (the process,
    the reading end of the pipe through which it names each model written)."""
    import multiprocessing

    import torch  # noqa: F401

    fork = multiprocessing.get_context("fork")
    names, written = fork.Pipe(duplex=False)
    process = fork.Process(target=_export, name="fedccrl export",
                           args=(written, models, params_path, shards, exports, parity, min_agreement, batch_size))
    process.start()
    written.close()  # only the child holds its end now (nothing else is forked after): its exit ends `names`
    return process, names


def _log_exports(names, models: Path, exports: Path, shards: Path) -> int:
    """Log each model the export names to MLflow, until it closes the pipe (it finished or died). The names are
    the run keys <algorithm>/s<seed>/d<held_out>, as plain bytes: nothing read from the pipe is unpickled."""
    from pipeline.export import log_exported

    logged = 0
    while True:
        try:
            key = names.recv_bytes().decode()
        except EOFError:
            return logged
        log_exported(models / key, exports / key, shards)
        logged += 1


def _export(written, models, params_path, shards, exports, parity, min_agreement, batch_size) -> None:
    """The child: `fedccrl export --models ... --no-mlflow` on one torch thread (unless the user set
    OMP_NUM_THREADS; the parent keeps its own), without a stage-time record of its own (`fedccrl bench-repro` counts
    it in the parent's); it sends each run's key down `written` once the run's files are written."""
    import torch

    from pipeline.cli import exit_now
    from pipeline.export import export_sweep

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    os.environ.pop("FEDCCRL_STAGE_TIMES", None)
    try:
        run_stage(export_sweep, models, params_path, shards, exports, parity, min_agreement, batch_size, None, False,
                  lambda key: written.send_bytes(key.encode()))
    except SystemExit as e:  # run_stage's exit code 2 for a known error
        exit_now(e.code if isinstance(e.code, int) else 1)
    exit_now(0)


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
