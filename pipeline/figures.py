"""`fedccrl figures`: the PNGs users would rather look at than read (FedCCRL Fig. 3, 5, 7, curves,
confusion matrices), from the trained runs. Logged as MLflow artifacts: everything to the sweep's
parent run, and each run's confusion matrix to its own child run.

This process loads the data and the models (torch) and computes what the figures show; two drawing
processes draw meanwhile, one the t-SNE of Fig. 5 (sklearn), the other every other figure. The curves and
confusion matrices need no model: they are drawn while torch loads."""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import click

from fedccrl_core import contract
from pipeline.cli import run_stage
from pipeline.params import load_config
from pipeline.mlflow_clock import timed


def figures(shards: Path, pools: Path, models: Path, runs_dir: Path, out: Path, params_path: Path,
            drawing: tuple | None = None) -> list[Path]:
    """`drawing`: the (t-SNE, other) drawing processes of `drawing_processes()`, when the caller started them
    earlier (`fedccrl publish`, before it loads torch); by default this function starts its own."""
    import numpy as np

    from fedccrl_core.algorithm_params.fedccrl import resolve_variant
    from fedccrl_core.data.shards import load_manifest
    from fedccrl_core.fsio import atomic_dir
    from fedccrl_core.results import load_runs_with_history, round_series

    cfg = load_config(params_path)  # the whole file, before anything is read or written
    final_out = out
    # .<out>.tmp-<pid>-<token>, renamed at the end; the drawing processes, started before torch is imported
    with atomic_dir(final_out) as out, contextlib.ExitStack() as stack:
        tsne_pool, pool = drawing or stack.enter_context(drawing_processes())
        fp = cfg.figures
        seed, n_preview, n_tsne, n_cam = fp.seed, fp.preview_images, fp.tsne_points, fp.gradcam_images
        fcfg = resolve_variant(cfg.train.fedccrl.model_dump())  # the variant's readings
        mean, std = cfg.preprocess.mean, cfg.preprocess.std
        manifest = load_manifest(shards)
        classes = list(manifest["classes"])
        pending = []  # the drawing processes' results: the PNGs' paths
        draw = lambda kind, *args: pending.append(  # noqa: E731
            (tsne_pool if kind == "tsne" else pool).submit(_draw, kind, *args))
        say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731

        # per-round curves (mean over seeds) and the confusion matrices of the first seed of each algorithm
        runs = load_runs_with_history(models, runs_dir)
        domains = [d for d in manifest["domains"] if any(r["meta"]["held_out_domain"] == d for r in runs)]
        first = {}  # {domain: {algorithm: run of its first seed}}, FedCCRL first, then FedAvg
        for dom in domains:
            dom_runs = [r for r in runs if r["meta"]["held_out_domain"] == dom]
            by_alg = {}
            for r in sorted(dom_runs, key=lambda r: (r["meta"]["algorithm"], r["meta"]["seed"])):
                by_alg.setdefault(r["meta"]["algorithm"], r)
            first[dom] = {a: by_alg[a] for a in sorted(by_alg, key=lambda a: (a != "fedccrl", a != "fedavg", a))}
            draw("round_curves", dom, round_series(dom_runs), out / f"curves_{dom}.png")
            for alg, r in first[dom].items():
                cm = np.array(r["result"]["detail"]["final"]["confusion"])
                draw("confusion", dom, alg, cm, classes, out / f"confusion_{alg}_{dom}.png")

        from fedccrl_core.data.shards import load_domain_test
        from fedccrl_core.viz.compute import model_features, preview_rows  # torch

        # Fig. 3: every client, its originals, CCDT with the pool of the other clients, then DIFP
        rows = preview_rows(shards, pools, fcfg, seed, n_preview, mean, std)
        draw("augmentation_preview", rows, out / "augmentation_preview.png")

        # Fig. 5 and 7: first seed of each algorithm, fixed seeded sample of held-out images
        for dom in domains:
            x, y = load_domain_test(shards, dom)
            pick = np.random.default_rng(seed).permutation(len(y))[:n_tsne]  # a seeded sample across all classes
            cam_pick = pick[:n_cam]
            feats, cam_maps = model_features({a: r["dir"] / contract.MODEL_FILE for a, r in first[dom].items()},
                                             x, y, pick, n_cam, mean, std)
            draw("tsne", dom, feats, classes, seed, out / f"tsne_{dom}.png")
            draw("gradcam_grid", dom, x[cam_pick], cam_maps, classes, y[cam_pick], out / f"gradcam_{dom}.png")
            say(f"figures: held-out {dom} computed")
        if any(r["meta"].get("mlflow_run_id") for r in runs):
            _open_mlflow()  # while the figures are drawn
        written = [p.result() for p in pending]  # a drawing process's error is raised here
        say(f"figures: {len(written)} PNGs in {final_out}")
    written = [final_out / p.name for p in written]
    _log_to_mlflow(runs, written)
    return written


@contextlib.contextmanager
def drawing_processes():
    """The two drawing processes of `figures`: (one for the t-SNE of Fig. 5, one for every other figure). Both
    are forked once this process has imported matplotlib (about 1 s of CPU that each would otherwise repeat)."""
    import fedccrl_core.viz.figures  # noqa: F401

    with _drawing_process(tsne=True) as tsne_pool, _drawing_process() as pool:
        yield tsne_pool, pool


@contextlib.contextmanager
def _drawing_process(tsne: bool = False):
    """One drawing process for _draw, on one thread: forked now (a first, empty job starts it), before this
    process imports torch; in a process that had imported torch already, the child never calls it. The t-SNE one
    imports sklearn while this process loads torch; each is sent SIGTERM if this process dies, and one that dies
    makes its jobs fail (BrokenProcessPool), never wait forever."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"), initializer=_worker_start,
                               initargs=(tsne,))
    try:
        pool.submit(int)
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # on an error, the job it is drawing ends first


def _worker_start(tsne: bool) -> None:
    from fedccrl_core.procs import die_with_parent

    die_with_parent()
    # below the other processes of the stage: in `fedccrl publish` the ONNX export beside is the longer path,
    # and given the cores first it ends with the figures instead of 3 s after them (docs/benchmarks.md)
    os.nice(8)
    import fedccrl_core.viz.figures  # noqa: F401
    if tsne:
        import fedccrl_core.viz.embed  # noqa: F401
        import sklearn.manifold  # noqa: F401


def _draw(kind: str, *args) -> Path:
    """One PNG, in a drawing process: a function of fedccrl_core.viz.figures, or "tsne": the t-SNE of each
    algorithm's h(x) (FedCCRL Fig. 5), then its panels. args end with the PNG's path."""
    from fedccrl_core.viz import figures as fig

    if kind == "tsne":
        from fedccrl_core.viz.embed import tsne_2d

        dom, feats, classes, seed, path = args
        panels = {alg: (tsne_2d(h, seed), y) for alg, (h, y) in feats.items()}
        return fig.tsne_panels(dom, panels, classes, path)
    return getattr(fig, kind)(*args)


def _open_mlflow() -> None:
    """Import mlflow and open the store now (seconds). A store that fails is reported by _log_to_mlflow, once
    the PNGs are written."""
    from pipeline.mlflow_store import mlflow_module

    with contextlib.suppress(Exception):
        mlflow_module()


@timed
def _log_to_mlflow(runs: list[dict], written: list[Path]) -> None:
    from pipeline.mlflow_store import mlflow_module

    run_ids = [r["meta"].get("mlflow_run_id") for r in runs if r["meta"].get("mlflow_run_id")]
    if not run_ids:
        return
    mlflow = mlflow_module()
    client = mlflow.MlflowClient()
    try:
        parent = client.get_run(run_ids[0]).data.tags.get("mlflow.parentRunId")
    except Exception as e:  # the store was moved or deleted: the PNGs are still written
        print(f"figures: MLflow run {run_ids[0]} not found ({e.__class__.__name__}); not logged", file=sys.stderr)
        return
    for p in written:
        if parent:
            client.log_artifact(parent, str(p), artifact_path="figures")
    for r in runs:
        rid, meta = r["meta"].get("mlflow_run_id"), r["meta"]
        png = [p for p in written if p.name == f"confusion_{meta['algorithm']}_{meta['held_out_domain']}.png"]
        if rid and png:
            client.log_artifact(rid, str(png[0]), artifact_path="figures")


@click.command("figures")
@click.option("--shards", type=click.Path(path_type=Path), required=True)
@click.option("--pools", type=click.Path(path_type=Path), required=True)
@click.option("--models", type=click.Path(path_type=Path), required=True)
@click.option("--runs", "runs_dir", type=click.Path(path_type=Path), required=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
def command(shards, pools, models, runs_dir, out, params_path):
    """Augmentation preview, per-round curves, t-SNE, Grad-CAM and confusion matrices as PNGs."""
    run_stage(figures, shards, pools, models, runs_dir, out, params_path)
