"""Exact DVC code dependencies: each stage of dvc.yaml depends on its own script
(pipeline/<stage>.py), on `fedccrl`'s entry point (pipeline/cli.py) and on exactly the project modules these import,
transitively, lazy imports inside functions included; nothing it does not use. So a changed module reruns only the
stages that import it.

One boundary: every stage first validates the whole of params.yaml (pipeline/params.py, so that a bad key fails before any work), which
imports every algorithm's `Params`, the dataset registry and the Flower settings to do so. Validation can stop a
stage but never changes what it writes, so pipeline/params.py is a dep of every stage while the modules it imports
count only where the stage itself uses them (otherwise editing FedSR would re-download the dataset).

A folder in `deps` stands for every .py file under it (DVC hashes the whole folder): it is listed only when the stage
uses all of them. On a failure the test prints the deps list to paste into dvc.yaml.
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
OWN = ("fedccrl_core", "pipeline", "serving", "fedccrl_flower")
FLOWER_APP = "fedccrl_flower/app/pyproject.toml"  # `flwr run` of the train stage's Flower engine (train.engine)
MODULES = {(".".join(p.relative_to(ROOT).with_suffix("").parts[:-1]) if p.name == "__init__.py"
            else ".".join(p.relative_to(ROOT).with_suffix("").parts)): p
           for pkg in OWN for p in (ROOT / pkg).rglob("*.py")}


def imports_of(module: str) -> set[str]:
    """The project modules one module imports (every import statement, function-level ones included)."""
    path = MODULES[module]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in MODULES}
    return out


VALIDATION_ONLY = {"pipeline.params"}  # listed, but what it imports to validate is not followed (see above)


def closure(roots: set[str], boundary: set[str] = frozenset()) -> set[str]:
    """Every project module importing `roots` loads: their imports, transitively, and every parent package; the
    imports of a module in `boundary` are not followed."""
    seen, todo = set(), list(roots)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a.b.c runs a and a.b first
        if m not in boundary:
            todo += sorted(imports_of(m) - seen)
    return seen


def stage_roots(stage: dict) -> set[str]:
    """`fedccrl <command> ...`: the console script's module and the command's module (pipeline/cli.py STAGES)."""
    from pipeline.cli import STAGES

    words = stage["cmd"].split()
    assert words[0] == "fedccrl", stage["cmd"]
    return {"pipeline.cli", STAGES[words[1]]}


def needed_files(stage: dict) -> set[str]:
    used = closure(stage_roots(stage), VALIDATION_ONLY)
    files = {MODULES[m].relative_to(ROOT).as_posix() for m in used}
    if "fedccrl_flower.run" in used:  # the Flower engine starts `flwr run` on its app: its components run too
        comps = tomllib.loads((ROOT / FLOWER_APP).read_text())["tool"]["flwr"]["app"]["components"]
        extra = closure({ref.split(":")[0] for ref in comps.values()}, VALIDATION_ONLY)
        files |= {MODULES[m].relative_to(ROOT).as_posix() for m in extra} | {FLOWER_APP}
    return files


def py_files(dep: str) -> set[str]:
    p = ROOT / dep
    if p.is_dir():
        return {f.relative_to(ROOT).as_posix() for f in [*p.rglob("*.py"), *p.rglob("pyproject.toml")]}
    return {dep}


def compact(files: set[str]) -> list[str]:
    """`files` as dvc.yaml deps: a folder whose every .py file is needed stands for them (largest folders first)."""
    out, left = [], set(files)
    for d in sorted({str(Path(f).parent) for f in files for _ in [0]} | {p for f in files
                     for p in map(str, Path(f).parents) if p != "."}, key=lambda d: (d.count("/"), d)):
        inside = py_files(d)
        if inside and inside <= left and inside <= files:
            out.append(d)
            left -= inside
    return out + sorted(left)


STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


@pytest.mark.parametrize("name", sorted(STAGES))
def test_stage_deps_are_exactly_the_code_it_imports(name):
    stage = STAGES[name]
    code_deps = [d for d in stage.get("deps", []) if str(d).split("/")[0] in OWN]
    listed = set().union(*(py_files(d) for d in code_deps)) if code_deps else set()
    needed = needed_files(stage)
    assert listed == needed, (
        f"dvc.yaml stage {name}: deps miss {sorted(needed - listed)} and list unused {sorted(listed - needed)}; "
        f"its code deps should be {compact(needed)}")


def test_the_own_script_is_a_dep():
    for name, stage in STAGES.items():
        from pipeline.cli import STAGES as COMMANDS

        script = COMMANDS[stage["cmd"].split()[1]].replace(".", "/") + ".py"
        assert script in stage["deps"], f"dvc.yaml stage {name} does not depend on {script}"


def test_closure_follows_lazy_and_relative_imports():
    assert "fedccrl_core.data.shards" in closure({"pipeline.evaluate"})  # imported inside evaluate()
    assert {"fedccrl_core", "fedccrl_core.data"} <= closure({"fedccrl_core.data.shards"})  # parent packages
    assert "fedccrl_core.algorithms.base" in closure({"fedccrl_core.algorithms"})  # from .base import ...
    assert "pipeline.onnx_export" not in closure({"pipeline.report"})  # report does not export
    assert "fedccrl_core.algorithm_params" in closure({"pipeline.params"})  # the hyperparameters, without torch
    assert "fedccrl_core.algorithms" not in closure({"pipeline.params"})
    assert "fedccrl_core.algorithms" not in closure({"pipeline.report"}, VALIDATION_ONLY)


def test_bytecode_caches_stay_out_of_the_hash_of_a_folder_dep():
    """A folder in deps (fedccrl_core/viz, ...) stands for its sources: Python's __pycache__ inside it, written
    by the first import or by another Python version, must not change the stage's hash (.dvcignore)."""
    import shutil
    import subprocess

    dvc = shutil.which("dvc")
    if dvc is None:
        pytest.skip("dvc is not on PATH (the project's .venv is not active)")
    folders = sorted({d for st in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].values()
                      for d in st.get("deps", []) if (ROOT / d).is_dir() and any((ROOT / d).rglob("*.py"))})
    assert folders  # the stages do depend on folders of code
    pyc = [f"{d}/__pycache__/m.cpython-311.pyc" for d in folders]
    ignored = subprocess.run([dvc, "check-ignore", *pyc], cwd=ROOT, capture_output=True, text=True)
    assert ignored.stdout.split() == pyc, f"hashed with their folder: {sorted(set(pyc) - set(ignored.stdout.split()))}"
    sources = subprocess.run([dvc, "check-ignore", *(f"{d}/m.py" for d in folders)], cwd=ROOT, capture_output=True,
                             text=True)
    assert sources.returncode == 1 and sources.stdout == "", f"sources left out of a folder's hash: {sources.stdout}"
