"""Imports point down only (docs/architecture.md, "Layers"). Every import statement is read from the source
(function-level ones included, so a lazy import cannot hide an upward dependency), without importing anything.

The library fedccrl_core imports none of the outer packages (pipeline, serving, fedccrl_flower) nor DVC, MLflow,
click or Flower. Inside it, a module may import its own floor or a lower one:

  floor 4  viz (figures over the library)
  floor 3  federation (the round loop, engines, checkpoints of a run, training jobs), outcomes (saved runs
           re-evaluated, results tables)
  floor 2  algorithms (client hooks + server half), algorithm_params (their hyperparameters, torch-free)
  floor 1  learning (statistics, losses, models, Eq. 2, a client's data and state, accuracy, confusion, the model
           file), data, augment, privacy (the mechanisms, the accountant, the audit)
  floor 0  foundation (errors, hyperparameter declarations, seeds, threads, processes, safe writes, the names
           layers share, the run key); the package's own __init__

Each sub-package is one floor, and each module's docstring states its floor.

So `learning.model_file` cannot import `algorithms`, and `algorithms.base` cannot import `federation`. serving and
fedccrl_flower do not import pipeline (the stage CLIs sit on top of them). benchmarks (research tooling: the
`fedccrl-bench` commands and the plain baseline trainer) sits on top of everything: no other package imports it.
A new module of fedccrl_core must be given a floor here: the test names it.

serving runs without torch (`fedccrl-serve`, the MLflow pyfunc): no module of serving imports torch, lazily or not
(the exporter, which needs torch, is pipeline/fedccrl_pipeline/onnx_export.py), and importing serving's modules in a process where
`import torch` fails works, so no fedccrl_core module that serving uses imports torch when imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from layout import TOP, module_name

ROOT = Path(__file__).resolve().parents[1]

FLOORS = {
    "fedccrl_core": 0,
    "fedccrl_core.foundation": 0,
    "fedccrl_core.learning": 1,
    "fedccrl_core.data": 1,
    "fedccrl_core.augment": 1,
    "fedccrl_core.privacy": 1,
    "fedccrl_core.algorithms": 2,
    "fedccrl_core.algorithm_params": 2,
    "fedccrl_core.federation": 3,
    "fedccrl_core.outcomes": 3,
    "fedccrl_core.viz": 4,
}
OUTSIDE_THE_LIBRARY = (
    "fedccrl_pipeline",
    "fedccrl_serving",
    "fedccrl_flower",
    "fedccrl_benchmarks",
    "click",
    "mlflow",
    "dvc",
    "flwr",
)
ABOVE_SERVING_AND_FLOWER = ("fedccrl_pipeline", "fedccrl_benchmarks")
ABOVE_PIPELINE = ("fedccrl_benchmarks",)
NOT_IN_SERVING = ("torch", "torchvision")  # serving runs on onnxruntime, numpy and PIL


def imported(module: str, source: str, is_package: bool = False) -> set[str]:
    """Every module an import statement of `source` names: `from a.b import c` gives a.b and a.b.c (c may be a
    module); relative imports are resolved against `module`."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def floor(module: str) -> int | None:
    """The floor of a fedccrl_core module: its longest listed prefix."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in FLOORS:
            return FLOORS[".".join(parts[:n])]
    return None


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    out = []
    for target in sorted(imported(module, source, is_package)):
        top = target.split(".")[0]
        if module.startswith("fedccrl_core"):
            if top in OUTSIDE_THE_LIBRARY:
                out.append(
                    f"{module} imports {target}: the library imports no outer package, DVC, MLflow, click or Flower"
                )
            elif top == "fedccrl_core":
                # `from fedccrl_core.x import name` also yields fedccrl_core.x.name, whose floor is fedccrl_core.x's
                if floor(target) is not None and floor(target) > floor(module):
                    out.append(f"{module} (floor {floor(module)}) imports {target} (floor {floor(target)})")
        elif module.split(".")[0] in ("fedccrl_serving", "fedccrl_flower") and top in ABOVE_SERVING_AND_FLOWER:
            out.append(f"{module} imports {target}: {top} sits above serving and fedccrl_flower")
        elif module.split(".")[0] == "fedccrl_serving" and top in NOT_IN_SERVING:
            out.append(f"{module} imports {target}: serving runs without torch")
        elif module.split(".")[0] == "fedccrl_pipeline" and top in ABOVE_PIPELINE:
            out.append(f"{module} imports {target}: {top} sits above pipeline (research tooling, not the product)")
    return out


SOURCES = sorted(p for folder in TOP.values() for p in folder.rglob("*.py"))


def test_every_library_module_has_a_floor():
    unplaced = [
        module_name(p) for p in SOURCES if module_name(p).startswith("fedccrl_core") and floor(module_name(p)) is None
    ]
    assert not unplaced, (
        f"give these modules a floor in tests/test_layers.py FLOORS (and docs/architecture.md): {unplaced}"
    )


@pytest.mark.parametrize(
    "path", [p for p in SOURCES if module_name(p).startswith("fedccrl_core")], ids=lambda p: module_name(p)
)
def test_every_library_module_states_its_floor(path):
    """Each module of the library says in its docstring which floor it sits on (its sub-package's)."""
    import re

    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    n = floor(module_name(path))
    assert re.search(rf"\bfloor {n}\b", doc, re.I), f"{path.relative_to(ROOT)}: its docstring should state 'Floor {n}'"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_imports_point_down(path):
    assert violations(module_name(path), path.read_text(), path.name == "__init__.py") == []


@pytest.mark.parametrize(
    "module,source",
    [
        ("fedccrl_core.learning.model_file", "from fedccrl_core.algorithms import ALGORITHMS"),
        ("fedccrl_core.algorithms.base", "def f():\n    from fedccrl_core.federation.client import ClientData"),
        ("fedccrl_core.algorithms.base", "from ..federation import engine"),
        ("fedccrl_core.data.shards", "import mlflow"),
        ("fedccrl_core.learning.models", "from fedccrl_pipeline.params import load_config"),
        ("fedccrl_serving.cli", "from fedccrl_pipeline.stage_runtime import run_stage"),
        ("fedccrl_serving.runtime", "def f():\n    import torch"),
        ("fedccrl_serving.inputs", "from torchvision.io import decode_image"),
        ("fedccrl_serving.metadata", "from fedccrl_pipeline.onnx_export import export_onnx"),
        ("fedccrl_core.foundation.runkey", "from fedccrl_benchmarks.plain import plain_round"),
        ("fedccrl_core.federation.engine", "def f():\n    import fedccrl_benchmarks.speed"),
        ("fedccrl_pipeline.train", "from fedccrl_benchmarks.accuracy import bench_accuracy"),
        ("fedccrl_flower.run", "from fedccrl_benchmarks import speed"),
    ],
    ids=[
        "checkpoint-algorithms",
        "lazy-import",
        "relative-import",
        "mlflow",
        "pipeline",
        "serving-pipeline",
        "serving-torch",
        "serving-torchvision",
        "serving-exporter",
        "library-benchmarks",
        "library-benchmarks-lazy",
        "pipeline-benchmarks",
        "flower-benchmarks",
    ],
)
def test_an_upward_import_is_caught(module, source):
    """The checker itself: each of these runs back up a layer."""
    assert violations(module, source)


SERVING = sorted(module_name(p) for p in TOP["fedccrl_serving"].glob("*.py"))


def test_serving_imports_without_torch():
    """Every module of serving imports in a process where `import torch` fails (and so do the fedccrl_core modules
    they import at import time): serving's own import statements are checked above, this catches the library's."""
    import subprocess
    import sys

    assert {
        "fedccrl_serving.cli",
        "fedccrl_serving.runtime",
        "fedccrl_serving.inputs",
        "fedccrl_serving.report",
        "fedccrl_serving.metadata",
    } <= set(SERVING)
    code = (
        "import importlib, sys; sys.modules['torch'] = None\n"
        f"for m in {SERVING!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch', 'torchvision')) and sys.modules[m]))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]"


NO_TRAINING = (
    "fedccrl_pipeline.download",
    "fedccrl_pipeline.partition",
    "fedccrl_pipeline.pools",
    "fedccrl_pipeline.report",
)


@pytest.mark.parametrize(
    "argv",
    [
        *(["-c", f"import {m}"] for m in NO_TRAINING),
        ["-c", "from fedccrl_pipeline.params import load_config; load_config('params.yaml')"],
        ["-m", "fedccrl_pipeline.cli", "--help"],
        ["-m", "fedccrl_pipeline.cli", "partition", "--help"],
    ],
    ids=[*NO_TRAINING, "load_config", "fedccrl --help", "fedccrl partition --help"],
)
def test_stages_that_do_not_train_import_neither_torch_nor_mlflow(argv):
    """download, partition, pools and report validate the whole params.yaml (every algorithm's hyperparameters:
    fedccrl_core/algorithm_params/) without importing torch, which they never use (about 2 s of CPU a stage); nor
    MLflow at import (report logs its table to MLflow when it runs, importing it then)."""
    import subprocess
    import sys

    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('IMPORTED', sorted(m for m in ('torch', 'mlflow') if m in sys.modules)))\n"
    )
    if argv[0] == "-m":
        code += (
            f"import runpy; sys.argv = ['fedccrl', *{argv[2:]!r}]; runpy.run_module({argv[1]!r}, run_name='__main__')\n"
        )
    else:
        code += argv[1] + "\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "IMPORTED []", r.stdout[-3000:]


def test_benchmarks_is_outside_the_library_and_on_top():
    """The library never imports the benchmarks (their code does not enter the run key, runkey.code_hash); the
    benchmarks may import every layer below them."""
    assert not (ROOT / "fedccrl_core" / "bench").exists()
    assert violations("fedccrl_benchmarks.speed", "from fedccrl_core.federation.engine import InProcessEngine") == []
    assert violations("fedccrl_benchmarks.accuracy", "from fedccrl_pipeline.stage_runtime import run_stage") == []


def test_downward_and_sideways_imports_pass():
    assert violations("fedccrl_core.federation.engine", "from fedccrl_core.algorithms import Algorithm") == []
    assert violations("fedccrl_core.learning.model_file", "from fedccrl_core.learning.models import FedModel") == []
    assert violations("fedccrl_core.algorithms.fedccrl", "from fedccrl_core.algorithms.base import Algorithm") == []
    assert violations("fedccrl_core.algorithms", "from .base import Algorithm", is_package=True) == []


EVERY_SOURCE = sorted(p for folder in (*TOP.values(), ROOT / "tests", ROOT / "scripts") for p in folder.rglob("*.py"))


def unresolved(source: str) -> list[str]:
    """`from <own module> import name` statements (lazy ones inside functions too) whose module or name
    does not exist: a lazy import of a removed module fails only on the path that runs it."""
    import importlib

    bad = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] in TOP
        ):
            continue
        try:
            module = importlib.import_module(node.module)
        except ModuleNotFoundError:
            bad.append(f"line {node.lineno}: no module {node.module}")
            continue
        for alias in node.names:
            if alias.name == "*" or hasattr(module, alias.name):
                continue
            try:
                importlib.import_module(f"{node.module}.{alias.name}")
            except ModuleNotFoundError:
                bad.append(f"line {node.lineno}: {node.module} has no {alias.name}")
    return bad


@pytest.mark.parametrize("path", EVERY_SOURCE, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_own_import_resolves(path):
    assert unresolved(path.read_text()) == []


def test_an_import_of_a_removed_module_is_caught():
    assert unresolved("def f():\n    from fedccrl_core.data.atomic import write_json_atomic\n") == [
        "line 2: no module fedccrl_core.data.atomic"
    ]
    assert unresolved("from fedccrl_core.foundation.fsio import no_such_helper\n") == [
        "line 1: fedccrl_core.foundation.fsio has no no_such_helper"
    ]
