"""Installs that fit their use (pyproject.toml, constraints.txt, docs/getting-started.md "Installing"):

- fast: the serve extra's dependency closure (pyproject's requirements, resolved through the installed
  distributions' metadata) has onnxruntime and no torch; the full install's has torch and onnxruntime-gpu and
  not the CPU onnxruntime (the two clash); no documented install combines them; every third-party module the
  packages import is a declared dependency; constraints.txt pins what the metadata names.
- full tier: `python -m build`, then, in a folder with no checkout, `<wheel>[serve]` in a fresh venv (-c
  constraints.txt, from the package index) runs `fedccrl-serve info/predict/evaluate` on an exported model and
  has no torch; a registered MLflow model loads with `mlflow.pyfunc.load_model` in the full-install venv
  (tests/wheel_envs.py) and predicts on raw images. The Flower SuperNodes from that venv: tests/test_flower.py.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from layout import FIND, ROOTS, TOP, module_name
from PIL import Image
from wheel_envs import REPO, canonical, extra, requirement_closure, run_outside, top_level_modules

PACKAGES = tuple(TOP)  # the wheel's top-level import names (tests/layout.py: pyproject.toml's source roots)
TORCH = {"torch", "torchvision", "triton"}
SERVE_CORE = {"onnxruntime", "numpy", "pillow", "click"}


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


# the training venv has the GPU build only; the CPU build's requirements are read from it: outside the GPU build's
# own extras (cuda, cudnn) they are the same (checked in the serve venv)
READ_AS = {} if _installed("onnxruntime") else {"onnxruntime": "onnxruntime-gpu"}


def test_serve_extra_closure_has_onnxruntime_and_no_torch():
    closure = requirement_closure(extra("serve"), READ_AS)
    assert SERVE_CORE <= closure
    assert not closure & TORCH and not [n for n in closure if n.startswith("nvidia-")], sorted(closure)
    assert "onnxruntime-gpu" not in closure and "mlflow" not in closure and "flwr" not in closure


def test_full_extra_closure_has_the_training_stack_and_one_onnxruntime():
    closure = requirement_closure(extra("full", "dev"))
    assert {"torch", "torchvision", "dvc", "mlflow", "onnx", "onnxscript", "onnxruntime-gpu", "flwr", "ray"} <= closure
    assert "onnxruntime" not in closure  # the CPU build would clash with onnxruntime-gpu (one `onnxruntime` module)


def test_no_documented_install_combines_serve_and_full():
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "Makefile"]
    installs = [(p.name, line) for p in docs for line in p.read_text().splitlines() if "pip install" in line]
    assert any("[serve]" in line for _, line in installs) and any("full" in line for _, line in installs)
    for name, line in installs:
        extras = set(re.findall(r"\[([a-z,-]+)\]", line))
        named = {e for group in extras for e in group.split(",")}
        assert not {"serve", "full"} <= named, f"{name}: {line.strip()}"


def test_the_wheel_ships_every_module_under_a_fedccrl_import_name():
    """Every import name the wheel installs starts with fedccrl (a user's own `pipeline` or `benchmarks` package
    is never overwritten); setuptools finds, under pyproject.toml's source roots, exactly the packages of the
    folders below them, so that every .py file of pipeline/, serving/, benchmarks/ and the top packages ships."""
    from setuptools import find_packages

    first_party = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]["isort"]
    assert sorted(TOP) == sorted(first_party["known-first-party"]) and all(n.startswith("fedccrl") for n in TOP)
    sources = [p for folder in TOP.values() for p in folder.rglob("*.py")]
    sources += [p for root in ROOTS if root != REPO for p in root.rglob("*.py")]  # a module beside a package too
    found = {pkg for root in ROOTS for pkg in find_packages(str(root), include=FIND["include"])}
    unshipped = sorted(
        p.relative_to(REPO).as_posix()
        for p in sources
        if not any(p.is_relative_to(f) for f in TOP.values()) or module_name(p.parent / "__init__.py") not in found
    )
    assert not unshipped, f"not in a package the wheel ships (a folder without __init__.py?): {unshipped}"
    assert found == {module_name(init) for folder in TOP.values() for init in folder.rglob("__init__.py")}


def test_every_imported_third_party_module_is_declared():
    """ast over the packages: each top-level import that is not the standard library or the project itself
    is a module of a distribution named in pyproject's dependencies or extras (dev excluded)."""
    provided = set()
    for req in extra("serve", "full"):
        try:  # the one onnxruntime build installed here provides the `onnxruntime` module
            provided |= top_level_modules(metadata.distribution(re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0]))
        except metadata.PackageNotFoundError:
            continue
    missing = {}
    for pkg in PACKAGES:
        for path in TOP[pkg].rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    names = [node.module]
                else:
                    continue
                for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - set(PACKAGES):
                    if top not in provided:
                        missing.setdefault(top, set()).add(path.relative_to(REPO).as_posix())
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_constraints_pin_every_dependency_the_metadata_names():
    pins = {
        canonical(line.split("==")[0]): line.split("==")[1]
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if "==" in line
    }
    from packaging.requirements import Requirement

    for r in extra("serve", "full", "dev"):
        req = Requirement(r)
        assert canonical(req.name) in pins, f"constraints.txt has no pin for {req.name}"
        assert req.specifier.contains(pins[canonical(req.name)]), f"{req.name}=={pins[canonical(req.name)]} vs {r}"


# ================================================================ the wheel, outside the checkout (full tier)
CLASSES = ["dog", "elephant", "giraffe", "guitar"]
SIZE = 32
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _meta(**over):
    from fedccrl_core.data.images import RESIZE_POLICY
    from fedccrl_core.learning.model_file import ModelMeta

    meta = dict(
        backbone="small_cnn",
        num_classes=len(CLASSES),
        classes=CLASSES,
        image_size=SIZE,
        mean=MEAN,
        std=STD,
        resize=RESIZE_POLICY,
        dataset="synthetic",
        domains=["a", "b", "c", "d"],
        held_out_domain="d",
        held_out_index=3,
        algorithm="fedccrl",
        seed=0,
        round=1,
        params_hash="0123abcd",
        git_commit="f00dcafe",
    )
    return ModelMeta(**meta, **over)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(onnx path, torch model): a random small_cnn at 32 px (as tests/test_serving.py)."""
    import torch

    from fedccrl_core.learning.models import build_model
    from fedccrl_pipeline.onnx_export import export_onnx

    torch.manual_seed(0)
    model = build_model("small_cnn", len(CLASSES)).eval()
    path = tmp_path_factory.mktemp("export") / "model.onnx"
    export_onnx(model, _meta(), path)
    return path, model


def _torch_probs(model, u8: np.ndarray) -> np.ndarray:
    import torch

    from fedccrl_core.learning.statistics import normalize_u8

    with torch.no_grad():
        return torch.softmax(model(normalize_u8(torch.from_numpy(u8), MEAN, STD)).double(), 1).numpy()


def _images(folder: Path, n: int = 6) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        cast = rng.integers(0, 256, (1, 1, 3))
        arr = np.clip(rng.integers(0, 256, (SIZE, SIZE, 3)) * 0.5 + cast * 0.5, 0, 255).astype(np.uint8)
        path = folder / CLASSES[i % len(CLASSES)] / f"{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(arr).save(path)
        paths.append(path)
    return paths


@pytest.mark.full("builds the wheel and installs it with onnxruntime from the package index into a fresh venv")
@pytest.mark.timeout(1800)
def test_the_serve_install_runs_fedccrl_serve_outside_the_checkout(fedccrl_wheel, serve_venv, exported, tmp_path):
    with zipfile.ZipFile(fedccrl_wheel) as whl:
        names = whl.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == set(PACKAGES) and all(t.startswith("fedccrl") for t in tops), tops  # one namespace
    assert "fedccrl_flower/app/pyproject.toml" in names  # the Flower App's configuration travels in the package
    assert any(n.endswith((".dist-info/licenses/LICENSE", ".dist-info/LICENSE")) for n in names)

    py, serve = serve_venv / "bin" / "python", serve_venv / "bin" / "fedccrl-serve"
    outside = tmp_path / "site"
    installed = json.loads(run_outside(outside, py, "-m", "pip", "list", "--format", "json").stdout)
    dists = {canonical(d["name"]) for d in installed}
    assert SERVE_CORE <= dists and not dists & TORCH and "onnxruntime-gpu" not in dists, sorted(dists)
    p = run_outside(outside, py, REPO / "tests" / "wheel_envs.py", "serve")  # the closure from the wheel's METADATA
    assert p.returncode == 0, p.stderr
    assert SERVE_CORE <= set(json.loads(p.stdout)) and not set(json.loads(p.stdout)) & TORCH
    p = run_outside(
        outside,
        py,
        "-c",
        "import json, importlib.metadata as m, fedccrl_serving, fedccrl_core; print(json.dumps("
        "[fedccrl_serving.__file__, fedccrl_core.__file__, m.distribution('onnxruntime').requires]))",
    )
    assert p.returncode == 0, p.stderr
    serving_file, core_file, ort_requires = json.loads(p.stdout)
    assert all(Path(f).is_relative_to(serve_venv) for f in (serving_file, core_file))  # the wheel, not the checkout
    if READ_AS:  # the fast closure test read the CPU build's requirements from the GPU build's: the same list
        plain = lambda reqs: sorted(r for r in reqs if "extra ==" not in r)  # noqa: E731
        assert plain(ort_requires) == plain(metadata.distribution("onnxruntime-gpu").requires)

    onnx_path, model = exported
    paths = _images(outside / "images")
    p = run_outside(outside, serve, "info", onnx_path)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["metadata"]["classes"] == CLASSES
    p = run_outside(outside, serve, "predict", onnx_path, outside / "images", "--top-k", 2, "-q")
    assert p.returncode == 0, p.stderr
    recs = sorted((json.loads(line) for line in p.stdout.splitlines()), key=lambda r: r["path"])
    assert [r["path"] for r in recs] == sorted(map(str, paths))
    u8 = np.stack([np.asarray(Image.open(r["path"]).convert("RGB")) for r in recs])
    probs = _torch_probs(model, u8)  # 32 px images: the resize is the identity
    for rec, prob in zip(recs, probs):
        assert rec["score"] == pytest.approx(prob.max(), abs=1e-5)
        assert prob[CLASSES.index(rec["label"])] == pytest.approx(prob.max(), abs=1e-5)
    p = run_outside(outside, serve, "evaluate", onnx_path, outside / "images", "--json", "-q")
    assert p.returncode == 0, p.stderr
    right = sum(Path(r["path"]).parent.name == r["label"] for r in recs)
    assert json.loads(p.stdout)["accuracy"] == pytest.approx(right / len(recs))


@pytest.mark.full("builds the wheel and a venv outside the repository, logs and registers an MLflow model")
@pytest.mark.timeout(1800)
def test_a_registered_pyfunc_loads_and_predicts_in_the_full_install_outside_the_checkout(full_venv, exported, tmp_path):
    import mlflow

    from fedccrl_pipeline.model_registry import log_to_mlflow
    from fedccrl_pipeline.onnx_parity import ParityFigures

    onnx_path, model = exported
    exp_id = mlflow.create_experiment("fedccrl-install", artifact_location=(tmp_path / "artifacts").as_uri())
    with mlflow.start_run(experiment_id=exp_id, run_name="train") as run:
        mlflow.log_param("algorithm", "fedccrl")
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (5, SIZE, SIZE, 3), dtype=np.uint8)
    log_to_mlflow(
        onnx_path,
        _meta(mlflow_run_id=run.info.run_id),
        ParityFigures(n_images=2, max_abs_logit_diff=0.0, top1_agreement=1.0),
        raw[:2],
        None,
        None,
        "# Model card\n",
    )
    outside = tmp_path / "site"
    outside.mkdir()
    np.save(outside / "raw.npy", raw)
    script = (
        "import json, sys, numpy as np, mlflow, fedccrl_flower\n"
        "pf = mlflow.pyfunc.load_model('models:/fedccrl-synthetic-fedccrl@s0-heldout-d')\n"
        "out = pf.predict(np.load('raw.npy'))\n"
        "print(json.dumps({'classes': list(out['class']), 'p': out[[f'p_{c}' for c in "
        f"{CLASSES!r}]].to_numpy().tolist(), 'fedccrl_flower': fedccrl_flower.__file__}}))\n"
    )
    p = run_outside(outside, full_venv / "bin" / "python", "-c", script)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert Path(got["fedccrl_flower"]).is_relative_to(full_venv)  # fedccrl from the wheel
    ref = _torch_probs(model, raw)
    np.testing.assert_allclose(np.asarray(got["p"]), ref, atol=1e-5)
    assert got["classes"] == [CLASSES[i] for i in ref.argmax(1)]
    bin_ = full_venv / "bin"  # the wheel's console scripts, outside the checkout, on the wheel's import names
    p = run_outside(outside, bin_ / "fedccrl", "--version")
    assert p.returncode == 0 and "fedccrl, version" in p.stdout, p.stderr[-3000:]
    p = run_outside(outside, bin_ / "fedccrl-bench", "--help")
    assert p.returncode == 0 and all(c in p.stdout for c in ("speed", "accuracy", "repro")), p.stderr[-3000:]
    p = run_outside(outside, bin_ / "python", "-c", "import fedccrl_pipeline.cli as c; print(c.__file__)")
    assert p.returncode == 0 and Path(p.stdout.strip()).is_relative_to(full_venv), p.stderr[-3000:]
