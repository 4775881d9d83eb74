"""`fedccrl figures`: the PNGs users would rather look at than read (FedCCRL Fig. 3, 5, 7, curves,
confusion matrices), from the trained runs. Logged as MLflow artifacts: everything to the sweep's
parent run, and each run's confusion matrix to its own child run."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from fedccrl_core import contract
from pipeline.cli import run_stage
from pipeline.params import load_config
from pipeline.mlflow_clock import timed


def figures(shards: Path, pools: Path, models: Path, runs_dir: Path, out: Path, params_path: Path) -> list[Path]:
    import numpy as np

    from fedccrl_core.algorithm_params.fedccrl import resolve_variant
    from fedccrl_core.data.shards import load_domain_test, load_manifest
    from fedccrl_core.fsio import atomic_dir
    from fedccrl_core.results import load_runs_with_history, round_series
    from fedccrl_core.viz import figures as fig
    from fedccrl_core.viz.compute import model_panels, preview_rows

    cfg = load_config(params_path)  # the whole file, before anything is read or written
    final_out = out
    with atomic_dir(final_out) as out:  # .<out>.tmp-<pid>-<token>, renamed into place at the end
        fp = cfg.figures
        seed, n_preview, n_tsne, n_cam = fp.seed, fp.preview_images, fp.tsne_points, fp.gradcam_images
        fcfg = resolve_variant(cfg.train.fedccrl.model_dump())  # the variant's readings
        mean, std = cfg.preprocess.mean, cfg.preprocess.std
        manifest = load_manifest(shards)
        classes = list(manifest["classes"])
        written: list[Path] = []
        say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731

        # Fig. 3: every client, its originals, CCDT with the pool of the other clients, then DIFP
        rows = preview_rows(shards, pools, fcfg, seed, n_preview, mean, std)
        written.append(fig.augmentation_preview(rows, out / "augmentation_preview.png"))
        say(f"figures: {final_out / written[-1].name}")

        runs = load_runs_with_history(models, runs_dir)
        domains = [d for d in manifest["domains"] if any(r["meta"]["held_out_domain"] == d for r in runs)]
        for dom in domains:
            dom_runs = [r for r in runs if r["meta"]["held_out_domain"] == dom]
            series = round_series(dom_runs)  # per-round curves, mean over seeds
            written.append(fig.round_curves(dom, series, out / f"curves_{dom}.png"))

            # Fig. 5 and 7: first seed of each algorithm, fixed seeded sample of held-out images
            x, y = load_domain_test(shards, dom)
            first = {}
            for r in sorted(dom_runs, key=lambda r: (r["meta"]["algorithm"], r["meta"]["seed"])):
                first.setdefault(r["meta"]["algorithm"], r)
            order = sorted(first, key=lambda a: (a != "fedccrl", a != "fedavg", a))
            pick = np.random.default_rng(seed).permutation(len(y))[:n_tsne]  # a seeded sample across all classes
            cam_pick = pick[:n_cam]
            panels, cam_maps = model_panels({a: first[a]["dir"] / contract.MODEL_FILE for a in order}, x, y, pick,
                                            n_cam, mean, std, seed)
            written.append(fig.tsne_panels(dom, panels, classes, out / f"tsne_{dom}.png"))
            written.append(fig.gradcam_grid(dom, x[cam_pick], cam_maps, classes, y[cam_pick], out / f"gradcam_{dom}.png"))
            for alg in order:
                r = first[alg]
                cm = r["result"]["detail"]["final"]["confusion"]
                written.append(fig.confusion(dom, alg, np.array(cm), classes, out / f"confusion_{alg}_{dom}.png"))
            say(f"figures: held-out {dom} done")
    written = [final_out / p.name for p in written]
    _log_to_mlflow(runs, written)
    return written


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
