"""DVC code dependencies by package: each stage of dvc.yaml depends on the code it imports (its own script
pipeline/fedccrl_pipeline/<stage>.py, `fedccrl`'s entry point pipeline/fedccrl_pipeline/cli.py and the project modules these import, transitively,
lazy imports inside functions included), declared as few paths as DVC can hash:

- a sub-package (fedccrl_core/data, fedccrl_core/algorithms, ...) as its folder, when the stage imports any module
  of it (one `.dir` hash in dvc.lock instead of one per file);
- a module of a top-level package (fedccrl_core/*.py, pipeline/fedccrl_pipeline/*.py, serving/fedccrl_serving/*.py) as its file, unless the stage
  imports every module of that package, then as the package's folder.

Every module a stage imports is covered, and no dep covers nothing the stage imports.

One boundary: every stage first validates the whole of params.yaml (pipeline/fedccrl_pipeline/params.py, so that a bad key fails before any work), which
imports every algorithm's `Params`, the dataset registry and the Flower settings to do so. Validation can stop a
stage but never changes what it writes, so pipeline/fedccrl_pipeline/params.py is a dep of every stage while the modules it imports
count only where the stage itself uses them (otherwise editing FedSR would re-download the dataset).
pipeline/fedccrl_pipeline/deploy_params.py, which validates deploy/params.yaml, is the same boundary.

The rule holds for the research pipeline, dvc.yaml at the root. The operator's pipeline is the package's template
pipeline/fedccrl_pipeline/project/dvc.yaml, which `fedccrl deploy init DIR` writes into a project outside the
checkout, where the code is the installed package and no path of it is the project's: its stages list no code
deps, only files of the project (test_the_operators_template_depends_on_its_project_only).

On a failure the test prints the deps list to paste into the dvc.yaml it names.
"""

from __future__ import annotations

import ast
import os
import tomllib
from pathlib import Path

import pytest
import yaml
from layout import TOP, module_name

ROOT = Path(__file__).resolve().parents[1]
OWN = ("fedccrl_core", "pipeline", "serving", "fedccrl_flower")  # folders: the product's code (not benchmarks/)
FLOWER_APP = "fedccrl_flower/app/pyproject.toml"  # `flwr run` of the train stage's Flower engine (train.engine)
MODULES = {module_name(p): p for folder in OWN for p in (ROOT / folder).rglob("*.py")}


def imports_of(module: str) -> set[str]:
    """The project modules one module imports (every import statement, function-level ones included)."""
    path = MODULES[module]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in MODULES}
    return out


VALIDATION_ONLY = {
    "fedccrl_pipeline.params",
    "fedccrl_pipeline.deploy_params",
    "fedccrl_pipeline.params_groups",
}  # listed, but what they import to validate is not followed (see above)


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


CONSOLE = "fedccrl_pipeline.cli"  # the console script: it imports a command's module only when that command runs


def stage_roots(stage: dict) -> set[str]:
    """`fedccrl <command> ...`: the console script's module, what it imports for every command, and the command's
    module (pipeline/fedccrl_pipeline/cli.py STAGES); not the other commands' modules."""
    from fedccrl_pipeline.cli import COMMANDS, STAGES

    words = stage["cmd"].split()
    assert words[0] == "fedccrl", stage["cmd"]
    commands = {make().callback.__module__ for make in COMMANDS.values()}
    return {CONSOLE, STAGES[words[1]]().callback.__module__} | (imports_of(CONSOLE) - commands)


def needed_files(stage: dict) -> set[str]:
    used = closure(stage_roots(stage), VALIDATION_ONLY | {CONSOLE})
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


def by_package(files: set[str], folders: bool = True) -> list[str]:
    """`files` as dvc.yaml deps, by the rule of this module's docstring (`folders`: whether a folder may stand for
    its files)."""
    out = set()
    for folder in TOP.values():
        top = folder.relative_to(ROOT).as_posix()  # fedccrl_core, pipeline/fedccrl_pipeline, ...
        mine = {f for f in files if (ROOT / f).is_relative_to(folder)}
        if not folders:
            out |= mine
            continue
        if mine and py_files(top) <= mine:
            out.add(top)
            continue
        for f in mine:
            parts = (ROOT / f).relative_to(folder).parts
            out.add(f"{top}/{parts[0]}" if len(parts) > 1 else f)
    return sorted(out, key=lambda d: ((ROOT / d).is_file(), d))


DVC_FILES = ("dvc.yaml",)  # the research pipeline (the operator's template: see the module's docstring)
TEMPLATE = "pipeline/fedccrl_pipeline/project/dvc.yaml"


def from_root(dvc_file: str, dep: str) -> str:
    """A dep of `dvc_file` (relative to its folder) as a path from the repository root."""
    return Path(os.path.relpath((ROOT / dvc_file).parent / dep, ROOT)).as_posix()


def in_project(dvc_file: str, path: str) -> bool:
    """Whether `path` (from the repository root) lies inside the DVC project of `dvc_file`, under its .dvcignore."""
    return (ROOT / path).is_relative_to((ROOT / dvc_file).parent)


def code_deps(dvc_file: str, stage: dict) -> list[str]:
    """The stage's deps that are the product's code, as written in `dvc_file`."""
    return [str(d) for d in stage.get("deps", []) if from_root(dvc_file, str(d)).split("/")[0] in OWN]


def expected_deps(dvc_file: str, needed: set[str]) -> list[str]:
    """The code deps `dvc_file` should list for a stage that imports `needed`, as written there."""
    folders = all(in_project(dvc_file, f) for f in needed)
    here = (ROOT / dvc_file).parent
    return [Path(os.path.relpath(ROOT / d, here)).as_posix() for d in by_package(needed, folders)]


STAGES = {(f, name): st for f in DVC_FILES for name, st in yaml.safe_load((ROOT / f).read_text())["stages"].items()}


@pytest.mark.parametrize(("dvc_file", "name"), sorted(STAGES), ids=[f"{f}:{n}" for f, n in sorted(STAGES)])
def test_stage_code_deps_cover_what_it_imports_by_package(dvc_file, name):
    stage = STAGES[dvc_file, name]
    written = code_deps(dvc_file, stage)
    deps = [from_root(dvc_file, d) for d in written]
    needed = needed_files(stage)
    should = expected_deps(dvc_file, needed)
    listed = set().union(*(py_files(d) for d in deps)) if deps else set()
    assert needed <= listed, (
        f"{dvc_file} stage {name}: deps miss {sorted(needed - listed)}; code deps should be {should}"
    )
    unused = [d for d in written if not py_files(from_root(dvc_file, d)) & needed]
    assert not unused, f"{dvc_file} stage {name}: deps {unused} hold nothing it imports; should be {should}"
    assert sorted(written) == sorted(should), f"{dvc_file} stage {name}: code deps {written}, by package {should}"


def test_by_package_declares_folders_for_sub_packages_and_files_at_the_top():
    got = by_package(
        {"fedccrl_core/data/shards.py", "fedccrl_core/foundation/errors.py", "pipeline/fedccrl_pipeline/cli.py"}
    )
    assert got == ["fedccrl_core/data", "fedccrl_core/foundation", "pipeline/fedccrl_pipeline/cli.py"]
    assert by_package(py_files("serving/fedccrl_serving")) == ["serving/fedccrl_serving"]


def test_the_own_script_is_a_dep():
    from fedccrl_pipeline.cli import STAGES as COMMANDS

    for (dvc_file, name), stage in STAGES.items():
        script = MODULES[COMMANDS[stage["cmd"].split()[1]]().callback.__module__].relative_to(ROOT).as_posix()
        deps = [from_root(dvc_file, str(d)) for d in stage["deps"]]
        assert script in deps, f"{dvc_file} stage {name} does not depend on {script}"


def test_closure_follows_lazy_and_relative_imports():
    assert "fedccrl_core.data.shards" in closure({"fedccrl_pipeline.evaluate"})  # imported inside evaluate()
    assert {"fedccrl_core", "fedccrl_core.data"} <= closure({"fedccrl_core.data.shards"})  # parent packages
    assert "fedccrl_core.algorithms.base" in closure({"fedccrl_core.algorithms"})  # from .base import ...
    assert "fedccrl_core.algorithms.fedsr" in closure({"fedccrl_core.algorithms"})  # by name, from PARAMS
    assert "fedccrl_pipeline.onnx_export" not in closure({"fedccrl_pipeline.report"})  # report does not export
    assert "fedccrl_core.algorithm_params" in closure({"fedccrl_pipeline.params"})  # the hyperparameters, without torch
    assert "fedccrl_core.algorithms" not in closure({"fedccrl_pipeline.params"})
    assert "fedccrl_core.algorithms" not in closure({"fedccrl_pipeline.report"}, VALIDATION_ONLY)


def test_bytecode_caches_stay_out_of_the_hash_of_a_folder_dep():
    """A folder in deps (fedccrl_core/viz, ...) stands for its sources: Python's __pycache__ inside it, written
    by the first import or by another Python version, must not change the stage's hash (.dvcignore)."""
    import shutil
    import subprocess

    dvc = shutil.which("dvc")
    if dvc is None:
        pytest.skip("dvc is not on PATH (the project's .venv is not active)")
    folders = sorted(
        {
            d
            for st in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].values()
            for d in st.get("deps", [])
            if (ROOT / d).is_dir() and any((ROOT / d).rglob("*.py"))
        }
    )
    assert folders  # the stages do depend on folders of code
    pyc = [f"{d}/__pycache__/m.cpython-311.pyc" for d in folders]
    ignored = subprocess.run([dvc, "check-ignore", *pyc], cwd=ROOT, capture_output=True, text=True)
    assert ignored.stdout.split() == pyc, f"hashed with their folder: {sorted(set(pyc) - set(ignored.stdout.split()))}"
    sources = subprocess.run(
        [dvc, "check-ignore", *(f"{d}/m.py" for d in folders)], cwd=ROOT, capture_output=True, text=True
    )
    assert sources.returncode == 1 and sources.stdout == "", f"sources left out of a folder's hash: {sources.stdout}"


def test_the_operators_template_depends_on_its_project_only():
    """The operator's project (`fedccrl deploy init`) lies outside the checkout: each stage of its template runs the
    installed `fedccrl` (a command of STAGES) and depends on files of the project only, never on a path that leaves
    it (code included)."""
    from fedccrl_pipeline.cli import STAGES as COMMANDS

    stages = yaml.safe_load((ROOT / TEMPLATE).read_text())["stages"]
    assert {"federate", "evaluate_sites", "evaluate", "report", "figures", "export"} == set(stages)
    for name, stage in stages.items():
        words = stage["cmd"].split()
        assert words[:1] == ["fedccrl"] and words[1] in COMMANDS, f"{TEMPLATE} stage {name}: {stage['cmd']}"
        outside = [d for d in stage.get("deps", []) if Path(d).is_absolute() or ".." in Path(d).parts]
        assert not outside, f"{TEMPLATE} stage {name}: deps {outside} lie outside the operator's project"
        assert ".." not in stage["cmd"], f"{TEMPLATE} stage {name} reads outside the project: {stage['cmd']}"
