"""The MLflow model side of `fedccrl export` (pipeline/fedccrl_pipeline/export.py): the exported model logged to its training run
without reopening it, registered once per (dataset, algorithm), a new version only for new weights."""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedccrl_core.learning.model_file import ModelMeta
    from fedccrl_pipeline.onnx_parity import ParityFigures


def sanitize(name: str) -> str:
    """An MLflow registered-model alias or name part: [a-z0-9_-] only."""
    return re.sub(r"[^a-z0-9_-]+", "-", str(name).lower()).strip("-") or "x"


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


# The packages the logged pyfunc (serving/fedccrl_serving/pyfunc.py) imports from when it is loaded and predicts, shipped whole:
# MLflow puts the model's code folder first on sys.path of the process that loads it, so a partial copy of a
# package would hide the rest of an installed fedccrl from that process and from the workers it spawns. No
# pipeline, benchmarks or Flower code goes in (tests/test_export.py loads the model where nothing else of the
# repository is importable).
SERVING_PACKAGES = ("fedccrl_core", "fedccrl_serving")  # import names; each shipped as a folder of that name


def _package_folders(dest: Path) -> list[str]:
    """Each of SERVING_PACKAGES copied whole (its .py files) into dest/<import name>: MLflow ships a code path
    under its folder's name, which is the package's import name."""
    import importlib

    out = []
    for name in SERVING_PACKAGES:
        init = importlib.import_module(name).__file__
        assert init is not None  # a package of .py files
        src = Path(init).parent
        shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        out.append(str(dest / name))
    return out


def registered_model_name(meta: ModelMeta) -> str:
    """One registered model per (dataset, algorithm)."""
    return f"fedccrl-{sanitize(meta.dataset or 'model')}-{sanitize(meta.algorithm or 'model')}"


def save_model(path, mlflow_model, onnx_file: str, **kwargs) -> None:
    """This module is the flavour module that log_to_mlflow hands to MLflow's `Model.log` (its contract for a
    flavour: a module with `save_model(path, mlflow_model, **kwargs)`; MLflow's own flavours log the same way):
    the pyfunc of serving/fedccrl_serving/pyfunc.py (raw images in, class names and probabilities out), plus the onnx flavour
    pointing at the same .onnx file inside the model folder."""
    import mlflow.pyfunc
    import onnx

    mlflow.pyfunc.save_model(path, mlflow_model=mlflow_model, **kwargs)
    data = Path("artifacts") / Path(onnx_file).name
    if not (Path(path) / data).is_file():
        raise FileNotFoundError(f"the pyfunc's artifacts hold no {data}")
    mlflow_model.add_flavor(
        "onnx",
        onnx_version=onnx.__version__,
        data=data.as_posix(),
        providers=["CPUExecutionProvider"],
        onnx_session_options=None,
        code=None,
    )
    mlflow_model.save(str(Path(path) / "MLmodel"))


def _known_weights(client, name: str, sha: str, alias: str, card: str) -> bool:
    """Whether a version of `name` already holds the weights of sha256 `sha`: then its description becomes `card`
    and `alias` points at it (no duplicate version)."""
    for mv in client.search_model_versions(f"name = '{name}'"):
        if mv.tags.get("weights_sha256") == sha:  # the same weights again: no duplicate version
            client.update_model_version(name, mv.version, description=card)
            client.set_registered_model_alias(name, alias, mv.version)
            print(
                f"MLflow: {name} version {mv.version} already holds these weights (sha256 {sha[:12]}); "
                f"alias @{alias} -> version {mv.version}, its description this export's model card, training run "
                "left untouched",
                file=sys.stderr,
            )
            return True
    return False


def _log_model(client, run_id: str, onnx_path: Path, name: str, tags: dict, meta: ModelMeta, example_u8):
    """The ONNX file logged to the training run `run_id` (pyfunc on raw images + onnx flavour) and registered as a
    new version of `name`; Model.log's info."""
    from mlflow.models import Model

    from fedccrl_serving import pyfunc

    with tempfile.TemporaryDirectory() as tmp:  # the artifact is named model.onnx
        onnx_file = Path(tmp) / "model.onnx"
        shutil.copyfile(onnx_path, onnx_file)
        code = _package_folders(Path(tmp) / "code")
        # the logged model in the training run's experiment (Model.log alone would file it under the active one)
        logged = client.create_logged_model(
            client.get_run(run_id).info.experiment_id, name="model", source_run_id=run_id, tags=tags
        )
        info = Model.log(
            artifact_path=None,
            name="model",
            flavor=sys.modules[__name__],  # save_model above
            onnx_file=str(onnx_file),
            run_id=run_id,
            model_id=logged.model_id,
            registered_model_name=name,
            tags=tags,
            python_model=pyfunc.ImageClassifier(),
            artifacts={pyfunc.ONNX_ARTIFACT: str(onnx_file)},
            code_paths=code,
            signature=pyfunc.signature(meta.classes, example_u8),
            pip_requirements=serving_requirements(),
        )
    return info


def log_to_mlflow(
    onnx_path: Path,
    meta: ModelMeta,
    result: ParityFigures,
    example_u8,
    registered_model: str | None,
    alias: str | None,
    card: str,
) -> None:
    """Log the model (pyfunc on raw images + onnx flavour) and the parity metrics to the training run through
    its run id, never reopening it (its status and end time stay those of the training); register it as a new
    version of fedccrl-<dataset>-<algorithm> only when its weights' sha256 is new, and point the alias at the
    version holding these weights. The version's description is the export's model card (`card`, the text of the
    card file beside the export), also when the version already held these weights: the latest export's card. Only
    called after the parity check passed, so an alias never moves to a model that failed it. Skipped with a notice
    when the run is unknown."""
    run_id = meta.mlflow_run_id
    if not run_id:
        print("notice: the model records no mlflow_run_id; skipping MLflow logging", file=sys.stderr)
        return
    from fedccrl_pipeline.mlflow_store import mlflow_module

    mlflow = mlflow_module()
    from mlflow.entities import Metric

    from fedccrl_pipeline.mlflow_store import trained_run

    client = mlflow.MlflowClient()
    if trained_run(run_id, "export") is None:
        return
    name = registered_model or registered_model_name(meta)
    alias = sanitize(alias or f"s{meta.seed or 0}-heldout-{meta.held_out_domain}")
    named = ("dataset", "held_out_domain", "algorithm", "seed", "params_hash", "git_commit", "privacy")
    tags = {k: str(getattr(meta, k)) for k in named if getattr(meta, k) is not None}
    sha = weights_sha256(onnx_path)
    if _known_weights(client, name, sha, alias, card):
        return
    tags["weights_sha256"] = sha
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[
            Metric("export_top1_agreement", result.top1_agreement, now, 0),
            Metric("export_max_abs_logit_diff", result.max_abs_logit_diff, now, 0),
        ],
    )
    info = _log_model(client, run_id, onnx_path, name, tags, meta, example_u8)
    version = info.registered_model_version  # created with `tags` (Model.log tags the version it registers)
    client.update_model_version(name, version, description=card)
    client.set_registered_model_alias(name, alias, version)
    print(
        f"MLflow: logged the model to run {run_id} (run not reopened); registered {name} version {version} "
        f"alias @{alias}, described by the model card",
        file=sys.stderr,
    )
