"""`fedccrl figures`: the PNGs users would rather look at than read (FedCCRL Fig. 3, 5, 7, curves,
confusion matrices), from the trained runs. Logged as MLflow artifacts: everything to the sweep's
parent run, and each run's confusion matrix to its own child run.

One plain process: it loads the data and the models (torch), computes what each figure shows on a bounded sample
(`figures.tsne_points`, `figures.gradcam_images`, `figures.preview_images`) and draws it. The PNGs go into a
temporary folder that replaces --out only when every figure is drawn."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from fedccrl_core.foundation import contract
from fedccrl_pipeline.params import load_config
from fedccrl_pipeline.stage_runtime import folders_apart, run_stage

if TYPE_CHECKING:
    from fedccrl_core.federation.history import SavedRun


def figures(shards: Path, pools: Path, models: Path, runs_dir: Path, out: Path, params_path: Path) -> list[Path]:
    """Every figure, into `out` (written whole at the end), then logged to MLflow."""
    folders_apart({"shards": shards, "pools": pools, "models": models, "runs": runs_dir}, {"out": out})
    cfg = load_config(params_path)  # the whole file, before anything is read
    with Figures(shards, models, out, cfg) as figs:
        figs.curves()
        figs.model_figures(pools)
        figs.confusions(runs_dir)
    return figs.log()


class Figures:
    """The figures of one sweep, drawn into a temporary folder that replaces `out` when the `with` block ends
    without an error: the curves from the training histories, Fig. 3, 5 and 7 from the models, the confusion
    matrices from the evaluation results."""

    def __init__(self, shards: Path, models: Path, out: Path, cfg):
        """cfg: the ParamsFile, validated before anything is read or written."""
        from fedccrl_core.data.shards import load_manifest

        self.cfg = cfg
        self.shards, self.models, self.final_out = shards, models, out
        manifest = load_manifest(shards)
        self.classes = list(manifest.classes)
        self.runs = _sweep_histories(self.cfg, models)
        self.domains = [d for d in manifest.domains if any(r.meta.held_out_domain == d for r in self.runs)]
        self.written: list[Path] = []

    def __enter__(self):
        from fedccrl_core.foundation.fsio import atomic_dir

        self._folder = atomic_dir(self.final_out)  # .<out>.tmp-<pid>-<token>, renamed at the end
        self.out = self._folder.__enter__()
        return self

    def __exit__(self, kind, error, tb):
        done = self._folder.__exit__(kind, error, tb)
        if kind is None:
            print(f"figures: {len(self.written)} PNGs in {self.final_out}", file=sys.stderr, flush=True)
        return done

    def _draw(self, kind: str, *args) -> None:
        self.written.append(_draw(kind, *args))

    def _first_seeds(self, dom: str) -> dict[str, SavedRun]:
        """{algorithm: run of its first seed} on held-out `dom`, FedCCRL first, then FedAvg."""
        by_alg: dict[str, SavedRun] = {}
        for r in sorted(
            (r for r in self.runs if r.meta.held_out_domain == dom),
            key=lambda r: (str(r.meta.algorithm), int(r.meta.seed or 0)),
        ):
            by_alg.setdefault(str(r.meta.algorithm), r)
        return {a: by_alg[a] for a in sorted(by_alg, key=lambda a: (a != "fedccrl", a != "fedavg", a))}

    def curves(self) -> None:
        """Per-round curves (mean over seeds), one PNG per held-out domain: the training histories only."""
        from fedccrl_core.outcomes.results import round_series

        for dom in self.domains:
            dom_runs = [r.history for r in self.runs if r.meta.held_out_domain == dom]
            self._draw("round_curves", dom, round_series(dom_runs), self.out / f"curves_{dom}.png")

    def model_figures(self, pools: Path) -> None:
        """FedCCRL Fig. 3 (every client: its originals, CCDT with the pool of the other clients, then DIFP), and
        Fig. 5 and 7 (first seed of each algorithm, a fixed seeded sample of held-out images)."""
        import numpy as np

        from fedccrl_core.algorithm_params.fedccrl import resolve_variant
        from fedccrl_core.data.shards import load_domain_test
        from fedccrl_core.viz.compute import model_features, preview_rows  # torch

        fp, cfg = self.cfg.figures, self.cfg
        mean, std = cfg.preprocess.mean, cfg.preprocess.std
        fcfg = resolve_variant(cfg.train.fedccrl)  # the variant's readings
        rows = preview_rows(self.shards, pools, fcfg, fp.seed, fp.preview_images, mean, std)
        self._draw("augmentation_preview", rows, self.out / "augmentation_preview.png")
        for dom in self.domains:
            x, y = load_domain_test(self.shards, dom)
            pick = np.random.default_rng(fp.seed).permutation(len(y))[: fp.tsne_points]  # across all classes
            cam_pick = pick[: fp.gradcam_images]
            feats, cam_maps = model_features(
                {a: r.dir / contract.MODEL_FILE for a, r in self._first_seeds(dom).items()},
                x,
                y,
                pick,
                fp.gradcam_images,
                mean,
                std,
            )
            self._draw("tsne", dom, feats, self.classes, fp.seed, self.out / f"tsne_{dom}.png")
            self._draw(
                "gradcam_grid", dom, x[cam_pick], cam_maps, self.classes, y[cam_pick], self.out / f"gradcam_{dom}.png"
            )
            print(f"figures: held-out {dom} computed", file=sys.stderr, flush=True)

    def confusions(self, runs_dir: Path) -> None:
        """The confusion matrix of the first seed of each algorithm on each held-out domain: the evaluation
        results of the evaluate step (runs_dir, the same runs)."""
        import json

        import numpy as np

        for dom in self.domains:
            for alg, r in self._first_seeds(dom).items():
                evaluated = contract.result_file(runs_dir, self.models, r.dir)
                if not evaluated.is_file():
                    raise FileNotFoundError(f"{evaluated}: no evaluation of {r.dir} (run the evaluate stage first)")
                result = json.loads(evaluated.read_text())  # the evaluate stage's file (outcomes/runs.py)
                cm = np.array(result["detail"]["final"]["confusion"])
                self._draw("confusion", dom, alg, cm, self.classes, self.out / f"confusion_{alg}_{dom}.png")

    def log(self) -> list[Path]:
        """After the folder is in place: the PNGs logged to MLflow; their final paths."""
        written = [self.final_out / p.name for p in self.written]
        _log_to_mlflow(self.runs, written)
        return written


def _sweep_histories(cfg, models: Path) -> list[SavedRun]:
    """Every run of the current sweep with its training history, in the order of the evaluate step's results."""
    from fedccrl_core.federation.history import SavedRun, load_history
    from fedccrl_pipeline.evaluate import trained_runs

    ordered = sorted(trained_runs(cfg, models), key=lambda d: contract.result_file(Path("r"), models, d))
    return [SavedRun(d, load_history(d)) for d in ordered]


def _draw(kind: str, *args) -> Path:
    """One PNG: a function of fedccrl_core.viz.figures, or "tsne": the t-SNE of each
    algorithm's h(x) (FedCCRL Fig. 5), then its panels. args end with the PNG's path."""
    from fedccrl_core.viz import figures as fig

    if kind == "tsne":
        from fedccrl_core.viz.embed import tsne_2d

        dom, feats, classes, seed, path = args
        panels = {alg: (tsne_2d(h, seed), y) for alg, (h, y) in feats.items()}
        return fig.tsne_panels(dom, panels, classes, path)
    return getattr(fig, kind)(*args)


def _log_to_mlflow(runs: list[SavedRun], written: list[Path]) -> None:
    from fedccrl_pipeline.mlflow_store import mlflow_module, trained_run

    run_ids = [r.meta.mlflow_run_id for r in runs if r.meta.mlflow_run_id]
    if not run_ids:
        return
    run = trained_run(run_ids[0], "figures")
    if run is None:  # the store was moved or replaced since training: the PNGs are still written
        return
    parent = run.data.tags.get("mlflow.parentRunId")  # the sweep's parent run
    client = mlflow_module().MlflowClient()
    for p in written:
        if parent:
            client.log_artifact(parent, str(p), artifact_path="figures")
    for r in runs:
        rid, meta = r.meta.mlflow_run_id, r.meta
        png = [p for p in written if p.name == f"confusion_{meta.algorithm}_{meta.held_out_domain}.png"]
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
