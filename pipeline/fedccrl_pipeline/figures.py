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
from fedccrl_core.foundation.errors import ParamError
from fedccrl_pipeline.deploy_params import test_shards
from fedccrl_pipeline.params import load_config
from fedccrl_pipeline.stage_runtime import folders_apart, run_stage

if TYPE_CHECKING:
    from fedccrl_core.federation.history import SavedRun


def figures(
    shards: Path | None,
    pools: Path | None,
    models: Path,
    runs_dir: Path,
    out: Path,
    params_path: Path,
    deploy_path: Path | None = None,
) -> list[Path]:
    """Every figure, into `out` (written whole at the end), then logged to MLflow. A deployment's runs
    (`deploy_path`, the operator's pipeline) get what the operator's machine can draw: the curves, and with
    `shards` (its own test folder of the held-out domains) Fig. 5 and 7 and the confusion matrices; Fig. 3 shows
    the source sites' images and is not drawn. Under train.privacy neither is Fig. 3 (training images, statistics
    without noise), and Fig. 5 and 7 use the held-out domain's val rows (data/shards.py held_out_parts)."""
    if deploy_path is None and (shards is None or pools is None):
        raise ParamError("--shards and --pools: required (the sweep's data), unless --deploy names a deployment")
    shards = test_shards(deploy_path, shards)
    folders_apart({"shards": shards, "pools": pools, "models": models, "runs": runs_dir}, {"out": out})
    cfg = load_config(params_path, downloads=deploy_path is None)  # the whole file first; a deployment: no download
    with Figures(shards, models, out, cfg, deploy_path) as figs:
        figs.curves()
        if cfg.train.privacy.enabled:  # Fig. 3 shows training images, and statistics without noise
            print("figures: train.privacy: no augmentation preview (Fig. 3; docs/privacy.md)", file=sys.stderr)
        elif pools is not None and deploy_path is None:
            figs.augmentation_preview(pools)
        if shards is not None:
            figs.held_out_figures()
            figs.confusions(runs_dir)
    return figs.log()


class Figures:
    """The figures of one sweep, drawn into a temporary folder that replaces `out` when the `with` block ends
    without an error: the curves from the training histories, Fig. 3 from the shards and pools, Fig. 5 and 7 from
    the models on the held-out images, the confusion matrices from the evaluation results."""

    def __init__(self, shards: Path | None, models: Path, out: Path, cfg, deploy_path: Path | None = None):
        """cfg: the ParamsFile, validated before anything is read or written; deploy_path: a deployment's
        params file, whose runs these are (else the sweep's)."""
        from fedccrl_core.data.manifest import load_manifest

        self.cfg = cfg
        self.shards, self.models, self.final_out = shards, models, out
        self.runs = _sweep_histories(self.cfg, models, deploy_path)
        self.deploy_path = deploy_path
        # the shards' domains and classes, or, without shards (a deployment), the ones its models were trained with
        named = load_manifest(shards) if shards is not None else self.runs[0].meta
        order, self.classes = list(named.domains or []), list(named.classes or [])
        held_out = {r.meta.held_out_domain for r in self.runs}
        self.domains = [d for d in order if d in held_out] + sorted(str(d) for d in held_out - set(order))
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

    def augmentation_preview(self, pools: Path) -> None:
        """FedCCRL Fig. 3: every client, its originals, CCDT with the pool of the other clients, then DIFP."""
        from fedccrl_core.algorithm_params.fedccrl import resolve_variant
        from fedccrl_core.viz.compute import preview_rows  # torch

        assert self.shards is not None
        fp, cfg = self.cfg.figures, self.cfg
        fcfg = resolve_variant(cfg.train.fedccrl)  # the variant's readings
        rows = preview_rows(
            self.shards, pools, fcfg, fp.seed, fp.preview_images, cfg.preprocess.mean, cfg.preprocess.std
        )
        self._draw("augmentation_preview", rows, self.out / "augmentation_preview.png")

    def held_out_figures(self) -> None:
        """FedCCRL Fig. 5 and 7 (first seed of each algorithm, a fixed seeded sample of held-out images)."""
        import numpy as np

        from fedccrl_core.data.shards import load_domain_test
        from fedccrl_core.viz.compute import model_features  # torch

        assert self.shards is not None
        fp, cfg = self.cfg.figures, self.cfg
        mean, std = cfg.preprocess.mean, cfg.preprocess.std
        for dom in self.domains:
            # under train.privacy the study's shards give their val rows only; the operator's test folder (a
            # deployment's) is no site's images, whole
            private = self.deploy_path is None and any(r.history.private for r in self._first_seeds(dom).values())
            x, y = load_domain_test(self.shards, dom, private)
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
        import numpy as np

        from fedccrl_core.outcomes.evaluated import load_result

        for dom in self.domains:
            for alg, r in self._first_seeds(dom).items():
                evaluated = contract.result_file(runs_dir, self.models, r.dir)
                if not evaluated.is_file():
                    raise FileNotFoundError(f"{evaluated}: no evaluation of {r.dir} (run the evaluate stage first)")
                final = load_result(evaluated).detail.final  # the evaluate stage's file (outcomes/evaluated.py)
                if final.confusion is None:  # a deployment's run evaluated by its sites alone: counts, no matrix
                    print(f"figures: {evaluated} has no confusion matrix (the sites' counts only)", file=sys.stderr)
                    continue
                cm = np.array(final.confusion)
                self._draw("confusion", dom, alg, cm, self.classes, self.out / f"confusion_{alg}_{dom}.png")

    def log(self) -> list[Path]:
        """After the folder is in place: the PNGs logged to MLflow; their final paths."""
        written = [self.final_out / p.name for p in self.written]
        _log_to_mlflow(self.runs, written)
        return written


def _sweep_histories(cfg, models: Path, deploy_path: Path | None = None) -> list[SavedRun]:
    """Every run of the current sweep (or deployment) with its training history, in the order of the evaluate
    step's results."""
    from fedccrl_core.federation.history import SavedRun, load_history
    from fedccrl_pipeline.evaluate import trained_runs

    ordered = sorted(trained_runs(cfg, models, deploy_path), key=lambda d: contract.result_file(Path("r"), models, d))
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
@click.option(
    "--shards",
    type=click.Path(path_type=Path),
    default=None,
    help="the sweep's shards; with --deploy, optional: the operator's test folder of the held-out domains",
)
@click.option("--pools", type=click.Path(path_type=Path), default=None, help="the sweep's pools (not with --deploy)")
@click.option("--models", type=click.Path(path_type=Path), required=True)
@click.option("--runs", "runs_dir", type=click.Path(path_type=Path), required=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
@click.option(
    "--deploy",
    "deploy_path",
    type=click.Path(path_type=Path),
    default=None,
    help="a deployment's params file (its deploy group): draw its runs, on its test folder",
)
def command(shards, pools, models, runs_dir, out, params_path, deploy_path):
    """Augmentation preview, per-round curves, t-SNE, Grad-CAM and confusion matrices as PNGs."""
    run_stage(figures, shards, pools, models, runs_dir, out, params_path, deploy_path)
