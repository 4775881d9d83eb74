"""`fedccrl export`: the ONNX file contract, parity, atomic outputs and MLflow registration.

Shards come from the real partition code: the session's tiny synthetic dataset (conftest.py `tiny`);
the model is a random small_cnn at 32 px (parity does not need a trained model).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from fixtures import TINY_IMAGES_PER_CLASS, write_run_history
from layout import TOP

from fedccrl_core.algorithms import load_model
from fedccrl_core.data.images import RESIZE_POLICY
from fedccrl_core.data.shards import load_domain_test
from fedccrl_core.foundation.errors import FedCCRLError
from fedccrl_core.learning.model_file import ModelMeta, save_model
from fedccrl_core.learning.models import build_model
from fedccrl_pipeline import checked_export, onnx_export, onnx_parity
from fedccrl_pipeline.card_records import SweepEpsilon, sweep_epsilon
from fedccrl_pipeline.export import command
from fedccrl_pipeline.model_registry import SERVING_PACKAGES, log_to_mlflow, sanitize
from fedccrl_pipeline.onnx_export import export_onnx, metadata_props
from fedccrl_serving.metadata import parse_metadata

REPO = Path(__file__).resolve().parents[1]

HELD_OUT = "sketch"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shards(tiny) -> Path:
    return tiny / "data" / "shards"  # the session's tiny dataset (conftest.py), read-only


def write_model(path: Path, shards: Path, **meta_over) -> Path:
    manifest = json.loads((shards / "manifest.json").read_text())
    torch.manual_seed(1)
    model = build_model("small_cnn", manifest["num_classes"])
    meta = dict(
        backbone="small_cnn",
        num_classes=manifest["num_classes"],
        classes=manifest["classes"],
        image_size=32,
        mean=[0.485, 0.456, 0.406],
        std=[0.229, 0.224, 0.225],
        resize=RESIZE_POLICY,
        dataset="synthetic",
        domains=manifest["domains"],
        held_out_domain=HELD_OUT,
        held_out_index=3,
        algorithm="fedccrl",
        seed=0,
        round=10,
        params_hash="feedbeef01234567",
        git_commit="c0ffee",
    )
    meta.update(meta_over)
    save_model(path, model, ModelMeta(**meta))
    write_run_history(path.parent, ModelMeta(**meta))
    return path


def run_export(model: Path, shards: Path, out: Path, *extra):
    args = ["--model", model, "--shards", shards, "--out", out, *extra]
    return CliRunner().invoke(command, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def exported(shards, tmp_path_factory):
    """One successful export through the stage CLI (the model records no MLflow run)."""
    d = tmp_path_factory.mktemp("export")
    model = write_model(d / "model.pt", shards)
    result = run_export(model, shards, d / "out")
    return model, d / "out", result


def leftovers(out: Path) -> set[str]:
    return {p.name for p in out.iterdir()} if out.exists() else set()


# ------------------------------------------------------------------ the successful export


def test_stage_writes_one_onnx_file_and_parity(exported, shards):
    _model, out, result = exported
    assert result.exit_code == 0, result.stderr
    assert leftovers(out) == {"model.onnx", "parity.json", "MODEL_CARD.md"}  # no side .data file, no temp file
    parity = json.loads((out / "parity.json").read_text())
    x, _ = load_domain_test(shards, HELD_OUT)
    assert parity["n_images"] == len(x) == TINY_IMAGES_PER_CLASS * 6  # the held-out domain, 6 classes
    assert parity["top1_agreement"] == 1.0
    assert parity["max_abs_logit_diff"] < 1e-4
    assert parity["onnx_accuracy"] == parity["torch_accuracy"]
    assert parity["min_agreement"] == 0.999
    assert list(parity) == [*PARITY_MEASURED, "onnx_accuracy", "torch_accuracy", *PARITY_CHECK]  # the file's format
    assert parity["inputs"] == "held-out images" and parity["held_out_domain"] == HELD_OUT
    assert "skipping MLflow" in result.stderr
    assert result.stdout == ""  # the exporter's progress lines are silenced


# parity.json's keys in their order (a held-out test adds the accuracies after the measured figures)
PARITY_MEASURED = ["n_images", "max_abs_logit_diff", "top1_agreement"]
PARITY_CHECK = ["min_agreement", "held_out_domain", "onnx_bytes", "inputs"]


def test_parity_json_on_generated_images_leaves_the_accuracies_out():
    """parity.json as `ExportParity.to_dict` writes it without labels: no accuracy key (not a null), no int8."""
    measured = onnx_parity.ParityFigures(n_images=64, max_abs_logit_diff=2e-8, top1_agreement=1.0)
    check = dict(min_agreement=0.999, held_out_domain="y", onnx_bytes=9, inputs=checked_export.GENERATED)
    doc = checked_export.ExportParity(**dataclasses.asdict(measured), **check).to_dict()
    assert list(doc) == PARITY_MEASURED + PARITY_CHECK
    assert doc == {"n_images": 64, "max_abs_logit_diff": 2e-8, "top1_agreement": 1.0, **check}


def test_onnx_file_passes_the_checker_and_holds_the_metadata(exported):
    model_path, out, _ = exported
    path = out / "model.onnx"
    onnx.checker.check_model(str(path), full_check=True)
    proto = onnx.load(str(path), load_external_data=False)
    assert not any(onnx.external_data_helper.uses_external_data(t) for t in proto.graph.initializer)
    assert path.stat().st_size < 2**31
    assert [i.name for i in proto.graph.input] == ["images"] and [o.name for o in proto.graph.output] == ["logits"]
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and [d.dim_value for d in dims[1:]] == [3, 32, 32]
    _, meta = load_model(model_path)
    decoded = parse_metadata({p.key: p.value for p in proto.metadata_props}, str(path)).as_dict()
    assert decoded["fedccrl_format"] == 1
    for key in (
        "classes",
        "image_size",
        "mean",
        "std",
        "resize",
        "dataset",
        "held_out_domain",
        "algorithm",
        "seed",
        "params_hash",
        "git_commit",
        "domains",
        "backbone",
        "num_classes",
    ):
        assert decoded[key] == getattr(meta, key), key


def test_dynamic_batch_matches_pytorch(exported):
    model_path, out, _ = exported
    model, _ = load_model(model_path)
    session = onnx_parity.cpu_session(out / "model.onnx")
    gen = torch.Generator().manual_seed(3)
    for n in (1, 3, 7):
        x = torch.randn(n, 3, 32, 32, generator=gen)
        got = session.run(["logits"], {"images": x.numpy()})[0]
        with torch.no_grad():
            ref = model(x).numpy()
        assert got.shape == (n, model.g.out_features)
        np.testing.assert_allclose(got, ref, atol=1e-5)


# ------------------------------------------------------------------ failures leave no model.onnx


def test_failed_parity_exits_nonzero_and_leaves_no_model(shards, tmp_path, monkeypatch):
    model = write_model(tmp_path / "model.pt", shards)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.onnx").write_bytes(b"stale export of an older model")
    real = onnx_parity.parity

    def disagreeing(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), top1_agreement=0.9)

    monkeypatch.setattr(checked_export, "parity", disagreeing)
    result = run_export(model, shards, out)
    assert result.exit_code != 0
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "agreement 0.900000 < --min-agreement 0.999" in errors[0]
    assert leftovers(out) == set()  # no model.onnx (not even the stale one), no parity.json, no temp file


def test_interrupted_export_leaves_no_model(shards, tmp_path, monkeypatch):
    model = write_model(tmp_path / "model.pt", shards)
    out = tmp_path / "out"

    def interrupted(*args, **kwargs):
        assert any(p.name.startswith(".model.onnx.tmp-") for p in out.iterdir())  # the export was on disk
        raise KeyboardInterrupt

    monkeypatch.setattr(checked_export, "parity", interrupted)
    result = run_export(model, shards, out)  # click turns Ctrl-C into "Aborted!" and exit code 1
    assert result.exit_code != 0
    assert leftovers(out) == set()


def test_bad_arguments_are_one_line_errors(shards, tmp_path):
    model = write_model(tmp_path / "model.pt", shards)
    r = run_export(model, shards, tmp_path / "out", "--min-agreement", "1.5")
    assert r.exit_code == 2 and "1.5" in r.stderr
    r = run_export(tmp_path / "missing.pt", shards, tmp_path / "out")
    assert r.exit_code == 2 and r.stderr.strip().startswith("error:") and "missing.pt" in r.stderr
    assert not (tmp_path / "out" / "model.onnx").exists()


def test_metadata_needs_the_preprocessing():
    with pytest.raises(FedCCRLError, match="resize"):
        metadata_props(
            ModelMeta(backbone="small_cnn", num_classes=1, classes=["a"], image_size=32, mean=[0, 0, 0], std=[1, 1, 1])
        )


# ------------------------------------------------------------------ MLflow


def test_mlflow_logs_registers_and_aliases_without_reopening_the_training_run(shards, tmp_path, monkeypatch):
    import mlflow
    import pandas as pd
    from PIL import Image

    # artifacts under tmp_path too: with a sqlite store MLflow's default artifact root is ./mlruns in the CWD
    exp_id = mlflow.create_experiment("fedccrl-test", artifact_location=(tmp_path / "artifacts").as_uri())
    with mlflow.start_run(experiment_id=exp_id, run_name="train") as run:
        mlflow.log_param("algorithm", "fedccrl")
    run_id = run.info.run_id
    client = mlflow.MlflowClient()
    trained = client.get_run(run_id).info
    model = write_model(tmp_path / "model.pt", shards, mlflow_run_id=run_id)
    result = run_export(model, shards, tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    name, uri = "fedccrl-synthetic-fedccrl", "models:/fedccrl-synthetic-fedccrl@s0-heldout-sketch"
    after = client.get_run(run_id).info  # the FIRST export already leaves the training run's timing alone
    assert (after.status, after.end_time, after.start_time) == (trained.status, trained.end_time, trained.start_time)
    version = client.get_model_version_by_alias(name, "s0-heldout-sketch")
    assert version.run_id == run_id
    assert version.tags["held_out_domain"] == HELD_OUT and version.tags["params_hash"] == "feedbeef01234567"
    logged = mlflow.search_logged_models(
        experiment_ids=[exp_id], filter_string=f"source_run_id = '{run_id}'", output_format="list"
    )
    assert [m.name for m in logged] == ["model"]
    info = mlflow.models.get_model_info(uri)
    assert {"onnx", "python_function"} <= set(info.flavors)
    inputs = info.signature.inputs.to_dict()
    assert inputs[0]["name"] == "images" and inputs[0]["tensor-spec"]["dtype"] == "uint8"
    assert list(inputs[0]["tensor-spec"]["shape"]) == [-1, -1, -1, 3]
    classes = json.loads((shards / "manifest.json").read_text())["classes"]
    assert info.signature.outputs.input_names() == ["class", "probability", *[f"p_{c}" for c in classes]]
    proto = mlflow.onnx.load_model(uri)  # the onnx flavour: the plain graph, metadata inside
    assert {p.key: p.value for p in proto.metadata_props}["fedccrl_format"] == "1"
    assert version.description == (tmp_path / "out" / "MODEL_CARD.md").read_text()  # the card, word for word
    metrics = client.get_run(run_id).data.metrics
    assert metrics["export_top1_agreement"] == 1.0 and metrics["export_max_abs_logit_diff"] < 1e-4
    reqs = mlflow.pyfunc.get_model_dependencies(uri)
    pins = [line.split("==")[0] for line in Path(reqs).read_text().split() if "==" in line]
    assert sum(p in ("onnxruntime", "onnxruntime-gpu") for p in pins) == 1, pins  # never both
    lock = {ln.lower() for ln in (ROOT / "constraints.txt").read_text().split() if "==" in ln}
    logged = [ln for ln in Path(reqs).read_text().split() if "==" in ln]
    assert "pillow" in pins and "pandas" in pins and logged  # what the pyfunc reads images and answers with
    assert [ln for ln in logged if ln.lower() not in lock] == []  # the logged pins are constraints.txt's

    # the pyfunc: raw uint8 HWC images in, class names and probabilities out, the PyTorch model's answers
    monkeypatch.setattr(sys, "path", list(sys.path))  # MLflow prepends the model's code folder: undone after
    pf = mlflow.pyfunc.load_model(uri)
    x, _ = load_domain_test(shards, HELD_OUT)
    torch_model, meta = load_model(model)
    with torch.no_grad():
        ref = torch.softmax(torch_model(normalized(x, meta)), 1).numpy()
    got = pf.predict(np.ascontiguousarray(x))
    assert isinstance(got, pd.DataFrame) and len(got) == len(x)
    assert list(got["class"]) == [classes[i] for i in ref.argmax(1)]
    np.testing.assert_allclose(got[[f"p_{c}" for c in classes]].to_numpy(), ref, atol=1e-5)
    np.testing.assert_allclose(got["probability"].to_numpy(), ref.max(1), atol=1e-5)
    # a larger image is resized by the training transform; image files are read by path
    big = np.asarray(Image.fromarray(x[0]).resize((64, 48), Image.BILINEAR))
    assert pf.predict(big[None]).shape[0] == 1
    files = []
    for i in range(3):
        Image.fromarray(x[i]).save(tmp_path / f"im{i}.png")
        files.append(str(tmp_path / f"im{i}.png"))
    by_path = pf.unwrap_python_model().predict(None, files)
    assert list(by_path["class"]) == list(got["class"][:3])
    np.testing.assert_allclose(by_path["probability"], got["probability"][:3], atol=1e-6)  # PNG is lossless

    # the logged model ships only the serving code, and that is enough: loaded and run where nothing else of the
    # repository is importable (no PYTHONPATH, no editable-install finder, another working directory)
    local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "logged")))
    shipped = sorted(p.relative_to(local / "code").as_posix() for p in (local / "code").rglob("*.py"))
    assert {s.split("/")[0] for s in shipped} == set(SERVING_PACKAGES)  # no pipeline, benchmarks, Flower
    assert shipped == sorted(
        f"{pkg}/{p.relative_to(TOP[pkg]).as_posix()}" for pkg in SERVING_PACKAGES for p in TOP[pkg].rglob("*.py")
    )  # whole packages: nothing shadowed
    np.save(tmp_path / "x.npy", x)
    script = (
        "import sys, json, numpy as np\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]\n"
        "import mlflow.pyfunc\n"
        f"pf = mlflow.pyfunc.load_model({str(local)!r})\n"
        f"out = pf.predict(np.load({str(tmp_path / 'x.npy')!r}))\n"
        "mods = [m.__file__ for n, m in sys.modules.items() if n.split('.')[0] in ('fedccrl_serving', 'fedccrl_core')]\n"
        "print(json.dumps({'classes': list(out['class']), 'files': mods}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    isolated = json.loads(run.stdout.strip().splitlines()[-1])
    assert isolated["classes"] == list(got["class"])
    assert isolated["files"] and all(f.startswith(str(local / "code")) for f in isolated["files"]), isolated["files"]

    # export twice more: no new version, the training run's end time untouched
    for _ in range(2):
        again = run_export(model, shards, tmp_path / "out2")
        assert again.exit_code == 0, again.stderr
        assert "already holds these weights" in again.stderr
    assert len(client.search_model_versions(f"name = '{name}'")) == 1
    assert client.get_run(run_id).info.end_time == trained.end_time
    assert client.get_model_version(name, "1").description == (tmp_path / "out2" / "MODEL_CARD.md").read_text()
    # new weights: a new version, and the alias moves to it
    retrained = write_model(tmp_path / "model2.pt", shards, mlflow_run_id=run_id, seed=0)
    m2, meta2 = load_model(retrained)
    with torch.no_grad():
        next(m2.parameters()).add_(0.01)
    save_model(retrained, m2, meta2)
    assert run_export(retrained, shards, tmp_path / "out3").exit_code == 0
    assert len(client.search_model_versions(f"name = '{name}'")) == 2
    assert str(client.get_model_version_by_alias(name, "s0-heldout-sketch").version) == "2"
    assert client.get_run(run_id).info.end_time == trained.end_time

    # the card's ε per image over the sweep: the latest dp_epsilon_sweep_per_image of the run's MLflow parent
    parent = client.create_run(exp_id).info.run_id
    for step, (eps, runs) in enumerate(((12.5, 3), (19.25, 6))):  # the latest step composes the most runs
        client.log_metric(parent, "dp_epsilon_sweep_per_image", eps, step=step)
        client.log_metric(parent, "dp_sweep_runs", runs, step=step)
    child = client.create_run(exp_id, tags={"mlflow.parentRunId": parent}).info.run_id
    child_meta = meta2.model_copy(update={"mlflow_run_id": child})
    assert sweep_epsilon(child_meta, True, True) == SweepEpsilon(19.25, 6)
    assert "no dp_epsilon_sweep_per_image" in sweep_epsilon(meta2, True, True).why_not  # a run without a parent
    assert sweep_epsilon(child_meta, True, False).why_not == "the export ran without MLflow"


def test_failed_parity_moves_no_alias_and_adds_no_version(shards, tmp_path, monkeypatch):
    import mlflow

    exp_id = mlflow.create_experiment("fedccrl-parity", artifact_location=(tmp_path / "artifacts").as_uri())
    with mlflow.start_run(experiment_id=exp_id, run_name="train") as run:
        pass
    model = write_model(
        tmp_path / "model.pt", shards, mlflow_run_id=run.info.run_id, dataset="synthetic", algorithm="fedavg"
    )
    assert run_export(model, shards, tmp_path / "out").exit_code == 0
    client = mlflow.MlflowClient()
    name = "fedccrl-synthetic-fedavg"
    before = client.get_model_version_by_alias(name, "s0-heldout-sketch").version
    m, meta = load_model(model)
    with torch.no_grad():
        next(m.parameters()).add_(0.5)
    save_model(model, m, meta)
    real = onnx_parity.parity

    def degraded(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), top1_agreement=0.5)

    monkeypatch.setattr(checked_export, "parity", degraded)
    assert run_export(model, shards, tmp_path / "out").exit_code != 0
    assert len(client.search_model_versions(f"name = '{name}'")) == 1
    assert client.get_model_version_by_alias(name, "s0-heldout-sketch").version == before


def test_mlflow_is_skipped_with_a_notice_for_an_unknown_run(exported, capsys):
    model_path, out, _ = exported
    _, meta = load_model(model_path)
    figures = onnx_parity.ParityFigures(n_images=1, max_abs_logit_diff=0.0, top1_agreement=1.0)
    log_to_mlflow(
        out / "model.onnx", meta.model_copy(update={"mlflow_run_id": "0" * 32}), figures, None, None, None, ""
    )
    assert "not in the tracking store" in capsys.readouterr().err


def test_alias_is_sanitized():
    assert sanitize("FedCCRL-s0-heldout-Art Painting!") == "fedccrl-s0-heldout-art-painting"
    assert sanitize("v1/../x") == "v1-x"


# ------------------------------------------------------------------ one trace per architecture


def _canonical(proto: onnx.ModelProto) -> bytes:
    """The model with every intermediate value and node renamed in order of appearance: two exports of one model
    compare equal when they compute the same graph with the same weights, whatever the exporter's name counters."""
    p = onnx.ModelProto.FromString(proto.SerializeToString())
    g, names = p.graph, {}
    kept = {v.name for v in g.input} | {v.name for v in g.output}
    rename = lambda n: n if n in kept or not n else names.setdefault(n, f"v{len(names)}")  # noqa: E731
    for t in g.initializer:
        t.name = rename(t.name)
    for k, node in enumerate(g.node):
        node.input[:] = [rename(n) for n in node.input]
        node.output[:] = [rename(n) for n in node.output]
        node.name = f"n{k}"
    for v in g.value_info:
        v.name = rename(v.name)
    return p.SerializeToString()


def _random_model(algorithm: str, seed: int):
    """The algorithm's model on small_cnn with random weights AND random BatchNorm statistics (the optimization
    folds them into the convolutions, so two seeds give two different folded graphs)."""
    from fedccrl_core.algorithms import ALGORITHMS

    torch.manual_seed(seed)
    model = ALGORITHMS[algorithm].build_model("small_cnn", 4, "none", None)
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    meta = ModelMeta(
        backbone="small_cnn",
        num_classes=4,
        classes=list("abcd"),
        image_size=32,
        algorithm=algorithm,
        mean=[0.485, 0.456, 0.406],
        std=[0.229, 0.224, 0.225],
        resize=RESIZE_POLICY,
    )
    return model.eval(), meta


FAST_ALGORITHMS = ("fedccrl", "fedsr")  # FedSR: a probabilistic head and a reference distribution in its state


@pytest.mark.parametrize(
    "algorithm",
    [
        a
        if a in FAST_ALGORITHMS
        else pytest.param(a, marks=pytest.mark.full("one trace reused: every algorithm's model, three exports each"))
        for a in __import__("fedccrl_core.algorithms", fromlist=["ALGORITHMS"]).ALGORITHMS
    ],
)
def test_a_reused_trace_exports_the_same_graph_as_the_exporter_itself(algorithm, tmp_path):
    """A second model of one architecture, exported through the first one's trace, is the graph that
    torch.onnx.export(optimize=True) makes of it, with its own weights (up to intermediate value names)."""
    first, meta = _random_model(algorithm, seed=1)
    second, _ = _random_model(algorithm, seed=2)
    traces = {}
    export_onnx(first, meta, tmp_path / "first.onnx", traces=traces)
    assert len(traces) == 1
    reused = onnx.load(export_onnx(second, meta, tmp_path / "second.onnx", traces=traces))
    assert len(traces) == 1  # the second model was not traced again
    with torch.no_grad():
        direct = torch.onnx.export(
            second,
            (torch.randn(2, 3, 32, 32),),
            None,
            dynamo=True,
            external_data=False,
            verbose=False,
            input_names=["images"],
            output_names=["logits"],
            dynamic_shapes=({0: torch.export.Dim("batch", min=1)},),
        ).model_proto
    first_graph = onnx.load(tmp_path / "first.onnx")
    for m in (reused, first_graph, direct):  # our metadata and description apart
        del m.metadata_props[:]
        m.ClearField("doc_string")
    assert _canonical(reused) == _canonical(direct)
    assert _canonical(first_graph) != _canonical(direct)  # the weights differ: the comparison can fail


def test_models_of_two_algorithms_share_one_trace_only_where_their_modules_match(tmp_path):
    """FedAvg's and FedCCRL's models are the same modules (one trace serves both, and gives FedCCRL's model the graph
    torch.onnx.export gives it); FedSR adds a probabilistic head (a trace of its own)."""
    fedavg, meta = _random_model("fedavg", seed=1)
    fedccrl, _ = _random_model("fedccrl", seed=2)
    fedsr, _ = _random_model("fedsr", seed=3)
    traces = {}
    export_onnx(fedavg, meta, tmp_path / "fedavg.onnx", traces=traces)
    shared = onnx.load(export_onnx(fedccrl, meta, tmp_path / "fedccrl.onnx", traces=traces))
    assert len(traces) == 1
    export_onnx(fedsr, meta, tmp_path / "fedsr.onnx", traces=traces)
    assert len(traces) == 2
    with torch.no_grad():
        direct = torch.onnx.export(
            fedccrl,
            (torch.randn(2, 3, 32, 32),),
            None,
            dynamo=True,
            external_data=False,
            verbose=False,
            input_names=["images"],
            output_names=["logits"],
            dynamic_shapes=({0: torch.export.Dim("batch", min=1)},),
        ).model_proto
    for m in (shared, direct):
        del m.metadata_props[:]
        m.ClearField("doc_string")
    assert _canonical(shared) == _canonical(direct)


def test_a_trace_holding_its_own_constants_is_not_reused():
    """A graph initializer that is no state entry (a tensor constant of the trace) may differ between two models of
    one architecture: that trace serves only the model it came from."""

    class WithConstant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 2, 3)

        def forward(self, x):
            return self.conv(x).mean((2, 3)) + torch.tensor([1.0, 2.0])

    model = WithConstant().eval()
    traced = onnx_export._trace(model, 8, 2)
    assert set(traced.graph.initializers) - set(model.state_dict())  # the constant is an initializer
    assert onnx_export._program_with_weights(traced, WithConstant().eval(), own_trace=False) is None
    assert onnx_export._program_with_weights(traced, model, own_trace=True) is not None


# ------------------------------------------------------------------ the paper's backbone


@pytest.mark.full("MobileNetV3-Large at 224 px: the paper's backbone exported and checked, about a minute on 2 cores")
def test_mobilenet_v3_large_224_exports_as_one_checked_file(tmp_path):
    torch.manual_seed(0)
    model = build_model("mobilenet_v3_large", 7).eval()
    meta = ModelMeta(
        backbone="mobilenet_v3_large",
        num_classes=7,
        classes=[f"c{i}" for i in range(7)],
        image_size=224,
        mean=[0.485, 0.456, 0.406],
        std=[0.229, 0.224, 0.225],
        resize=RESIZE_POLICY,
    )
    path = export_onnx(model, meta, tmp_path / "model.onnx")  # runs onnx.checker (full check) itself
    assert leftovers(tmp_path) == {"model.onnx"}
    assert 10e6 < path.stat().st_size < 2**31
    x = torch.randn(3, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    got = onnx_parity.cpu_session(path).run(["logits"], {"images": x.numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, model(x).numpy(), atol=1e-4)


# ------------------------------------------------------------------ export + serve, end to end


def test_serving_the_raw_held_out_folder_reproduces_the_shard_predictions(exported, shards, tiny):
    """The held-out domain's original files through `fedccrl-serve evaluate` give exactly the confusion
    matrix of the PyTorch model on the shards (decoded by the partition stage): same transform."""
    from fedccrl_serving.cli import main as serve

    model_path, out, _ = exported
    r = CliRunner().invoke(
        serve,
        ["evaluate", str(out / "model.onnx"), str(tiny / "raw" / HELD_OUT), "--json", "-q"],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    model, meta = load_model(model_path)
    x, y = load_domain_test(shards, HELD_OUT)
    with torch.no_grad():
        logits = model(normalized(x, meta))
    cm = np.zeros((meta.num_classes,) * 2, int)
    np.add.at(cm, (y, logits.argmax(1).numpy()), 1)
    assert doc["confusion_matrix"] == cm.tolist()
    assert doc["accuracy"] == json.loads((out / "parity.json").read_text())["onnx_accuracy"]


def normalized(x_u8: np.ndarray, meta: ModelMeta) -> torch.Tensor:
    from fedccrl_core.learning.statistics import normalize_u8

    return normalize_u8(torch.from_numpy(np.ascontiguousarray(x_u8)), meta.mean, meta.std)
