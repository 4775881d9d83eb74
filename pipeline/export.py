"""`fedccrl export`: a trained model -> one self-contained ONNX file + parity.json, logged to MLflow.

Parity is measured on every image of the held-out domain (ONNX Runtime CPU vs PyTorch). The stage
fails when the top-1 agreement is below --min-agreement. Outputs appear only on success:
parity.json first, then model.onnx renamed from a temp name, so a model.onnx is always complete;
stale outputs of an earlier export are removed before anything else happens.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import click

from fedccrl_core import contract
from fedccrl_core.fsio import atomic_path, write_text
from pipeline.cli import run_stage
from pipeline.tracking import timed


def sanitize(name: str) -> str:
    """An MLflow registered-model alias or name part: [a-z0-9_-] only."""
    return re.sub(r"[^a-z0-9_-]+", "-", str(name).lower()).strip("-") or "x"


def export(model_path: Path, shards: Path, out: Path, min_agreement: float, batch_size: int,
           registered_model: str | None, alias: str | None, use_mlflow: bool) -> dict:
    import numpy as np

    from fedccrl_core.algorithms import load_model
    from fedccrl_core.data.shards import load_domain_test
    from serving import onnx_export

    final_onnx, final_parity = out / "model.onnx", out / "parity.json"
    for stale in (final_onnx, final_parity):  # as DVC does: a failed export leaves no earlier output behind
        stale.unlink(missing_ok=True)
    if model_path.is_dir():
        model_path = model_path / contract.MODEL_FILE
    model, meta = load_model(model_path)
    x, y = load_domain_test(shards, meta["held_out_domain"])
    if x.shape[1:] != (meta["image_size"], meta["image_size"], 3):
        raise ValueError(f"{shards}: held-out images are {x.shape[1:]}, the model expects "
                         f"{meta['image_size']}x{meta['image_size']}x3 (shards from another image size?)")
    with atomic_path(final_onnx) as tmp_onnx:  # renamed to model.onnx after parity.json is written
        onnx_export.export_onnx(model, meta, tmp_onnx)
        session = onnx_export.cpu_session(tmp_onnx)
        result = onnx_export.parity(session, model, x, meta["mean"], meta["std"], labels=y, batch_size=batch_size)
        result.update(min_agreement=min_agreement, held_out_domain=meta["held_out_domain"],
                      onnx_bytes=tmp_onnx.stat().st_size)
        print(f"parity on {result['n_images']} {meta['held_out_domain']} images: top-1 agreement "
              f"{result['top1_agreement']:.6f}, max |logit diff| {result['max_abs_logit_diff']:.3g}", file=sys.stderr)
        if result["top1_agreement"] < min_agreement:
            raise onnx_export.ParityError(
                f"ONNX/PyTorch top-1 agreement {result['top1_agreement']:.6f} < --min-agreement {min_agreement} "
                f"on {result['n_images']} images (max |logit diff| {result['max_abs_logit_diff']:.3g}); "
                "no model.onnx written")
        if use_mlflow:
            log_to_mlflow(tmp_onnx, session, meta, result, np.ascontiguousarray(x[:2]), registered_model, alias)
        write_text(final_parity, json.dumps(result, indent=1) + "\n")
    print(f"wrote {final_onnx} ({result['onnx_bytes'] / 1e6:.1f} MB) and {final_parity}", file=sys.stderr)
    return result


def serving_requirements() -> list[str]:
    """The exact pins the logged model needs (the pyfunc reads images with pillow, answers a pandas DataFrame;
    MLflow adds its own pin), from this environment (no requirement-inference subprocess, and
    only the onnxruntime build that is installed: onnxruntime and onnxruntime-gpu must never be installed
    together)."""
    from importlib.metadata import PackageNotFoundError, version

    reqs = []
    for pkg in ("onnx", "onnxruntime-gpu", "onnxruntime", "numpy", "pandas", "pillow"):
        try:
            reqs.append(f"{pkg}=={version(pkg)}")
        except PackageNotFoundError:
            continue
    ort = [r for r in reqs if r.startswith("onnxruntime")]
    return [r for r in reqs if not r.startswith("onnxruntime")] + ort[:1]


def weights_sha256(onnx_path: Path) -> str:
    """sha256 of the graph's weights only (every initializer's name, type, shape and bytes, in name order): a
    model retrained to the same weights at another commit is the same registered version."""
    import onnx
    from onnx import numpy_helper

    h = hashlib.sha256()
    for t in sorted(onnx.load(str(onnx_path)).graph.initializer, key=lambda t: t.name):
        a = numpy_helper.to_array(t)
        h.update(f"{t.name}|{a.dtype}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def registered_model_name(meta: dict) -> str:
    """One registered model per (dataset, algorithm)."""
    return f"fedccrl-{sanitize(meta.get('dataset', 'model'))}-{sanitize(meta.get('algorithm', 'model'))}"


def _flavour(onnx_file: str):
    """An MLflow flavour module for Model.log: the pyfunc of serving/pyfunc.py (raw images in, class names and
    probabilities out), plus the onnx flavour pointing at the same .onnx file inside the model folder."""
    import types

    import mlflow.pyfunc
    import onnx

    def save_model(path, mlflow_model, **kwargs):
        mlflow.pyfunc.save_model(path, mlflow_model=mlflow_model, **kwargs)
        data = Path("artifacts") / Path(onnx_file).name
        assert (Path(path) / data).is_file(), data
        mlflow_model.add_flavor("onnx", onnx_version=onnx.__version__, data=data.as_posix(),
                                providers=["CPUExecutionProvider"], onnx_session_options=None, code=None)
        mlflow_model.save(str(Path(path) / "MLmodel"))

    return types.SimpleNamespace(__name__="mlflow.pyfunc", save_model=save_model)


@timed
def log_to_mlflow(onnx_path: Path, session, meta: dict, result: dict, example_u8, registered_model: str | None,
                  alias: str | None) -> None:
    """Log the model (pyfunc on raw images + onnx flavour) and the parity metrics to the training run through
    its run id, never reopening it (its status and end time stay those of the training); register it as a new
    version of fedccrl-<dataset>-<algorithm> only when its weights' sha256 is new, and point the alias at the
    version holding these weights. Only called after the parity check passed, so an alias never moves to a
    model that failed it. Skipped with a notice when the run is unknown."""
    run_id = meta.get("mlflow_run_id")
    if not run_id:
        print("notice: the model records no mlflow_run_id; skipping MLflow logging", file=sys.stderr)
        return
    from pipeline.tracking import mlflow_module

    mlflow = mlflow_module()
    from mlflow.entities import Metric
    from mlflow.exceptions import MlflowException
    from mlflow.models import Model

    from serving import pyfunc

    client = mlflow.MlflowClient()
    try:
        client.get_run(run_id)
    except MlflowException:
        print(f"notice: MLflow run {run_id} is not in the tracking store {mlflow.get_tracking_uri()}; "
              "skipping MLflow logging", file=sys.stderr)
        return
    name = registered_model or registered_model_name(meta)
    alias = sanitize(alias or f"s{meta.get('seed', 0)}-heldout-{meta['held_out_domain']}")
    tags = {k: str(meta[k]) for k in ("dataset", "held_out_domain", "algorithm", "seed", "params_hash", "git_commit")
            if meta.get(k) is not None}
    sha = weights_sha256(onnx_path)
    for mv in client.search_model_versions(f"name = '{name}'"):
        if mv.tags.get("weights_sha256") == sha:  # the same weights again: no duplicate version
            client.set_registered_model_alias(name, alias, mv.version)
            print(f"MLflow: {name} version {mv.version} already holds these weights (sha256 {sha[:12]}); "
                  f"alias @{alias} -> version {mv.version}, training run left untouched", file=sys.stderr)
            return
    tags["weights_sha256"] = sha
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric("export_top1_agreement", float(result["top1_agreement"]), now, 0),
                                      Metric("export_max_abs_logit_diff", float(result["max_abs_logit_diff"]), now, 0)])
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:  # the artifact is named model.onnx, not the stage's temp name
        onnx_file = Path(tmp) / "model.onnx"
        shutil.copyfile(onnx_path, onnx_file)
        # the logged model in the training run's experiment (Model.log alone would file it under the active one)
        logged = client.create_logged_model(client.get_run(run_id).info.experiment_id, name="model",
                                            source_run_id=run_id, tags=tags)
        info = Model.log(artifact_path=None, name="model", flavor=_flavour(str(onnx_file)), run_id=run_id,
                         model_id=logged.model_id,
                         registered_model_name=name, tags=tags, python_model=pyfunc.ImageClassifier(),
                         artifacts={pyfunc.ONNX_ARTIFACT: str(onnx_file)},
                         code_paths=[str(root / "serving"), str(root / "fedccrl_core")],
                         signature=pyfunc.signature(meta["classes"], example_u8),
                         pip_requirements=serving_requirements())
    version = info.registered_model_version
    for k, v in tags.items():
        client.set_model_version_tag(name, version, k, v)
    client.set_registered_model_alias(name, alias, version)
    print(f"MLflow: logged the model to run {run_id} (run not reopened); registered {name} version {version} "
          f"alias @{alias}", file=sys.stderr)


def export_sweep(models: Path, params_path: Path, shards: Path, out: Path, summary: Path, min_agreement: float,
                 batch_size: int, registered_model: str | None, use_mlflow: bool) -> dict:
    """Every run of the current sweep (params train.algorithms x seeds x held_out), in one process:
    out/<algorithm>/s<seed>/d<held_out>/{model.onnx, parity.json}, and the worst parity over them in `summary`."""
    from pipeline.params import load_config, run_dirs

    results = {}
    for run in run_dirs(load_config(params_path), models):  # the whole params file validated first
        key = run.relative_to(models).as_posix()
        results[key] = export(run / contract.MODEL_FILE, shards, out / key, min_agreement, batch_size,
                              registered_model, None, use_mlflow)
    worst = min(r["top1_agreement"] for r in results.values())
    # the compact DVC metric: the worst figures over every run (each run's own numbers: out/<run>/parity.json)
    doc = {"min_top1_agreement": worst, "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in results.values()),
           "runs": len(results)}
    write_text(summary, json.dumps(doc, indent=1) + "\n")
    return doc


def _term_as_exit(signum, frame):
    raise SystemExit(128 + signum)  # lets the finally blocks remove temp files on SIGTERM


@click.command("export")
@click.option("--model", "model_path", type=click.Path(path_type=Path), default=None,
              help="one model.pt written by the train stage (or its folder)")
@click.option("--models", type=click.Path(path_type=Path), default=None,
              help="instead of --model: every run of the sweep in params.yaml under this root (one process)")
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=Path("params.yaml"))
@click.option("--summary", type=click.Path(path_type=Path), default=None,
              help="with --models: a JSON of every run's parity (a DVC metric)")
@click.option("--shards", type=click.Path(path_type=Path), required=True, help="the partition stage output")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="folder for model.onnx and parity.json (with --models: the root of <algorithm>/s<seed>/d<i>)")
@click.option("--min-agreement", type=click.FloatRange(0.0, 1.0), default=0.999, show_default=True,
              help="fail when ONNX and PyTorch agree on fewer top-1 predictions than this")
@click.option("--batch-size", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--registered-model", default=None, help="MLflow registered model name [default: fedccrl-<dataset>-<algorithm>]")
@click.option("--alias", default=None,
              help="MLflow alias of the version [default: s<seed>-heldout-<domain>]")
@click.option("--mlflow/--no-mlflow", "use_mlflow", default=True, show_default=True,
              help="log to the training run recorded in the model (skipped with a notice when it has none)")
def command(model_path, models, params_path, summary, shards, out, min_agreement, batch_size, registered_model, alias,
            use_mlflow):
    """Export trained models to ONNX, check parity on the held-out domain, register them in MLflow."""
    if (model_path is None) == (models is None):
        raise click.UsageError("give exactly one of --model and --models")
    previous = signal.signal(signal.SIGTERM, _term_as_exit)
    try:
        if models is not None:
            run_stage(export_sweep, models, params_path, shards, out, summary or out / "parity.json", min_agreement,
                      batch_size, registered_model, use_mlflow)
        else:
            run_stage(export, model_path, shards, out, min_agreement, batch_size, registered_model, alias, use_mlflow)
    finally:
        signal.signal(signal.SIGTERM, previous)
