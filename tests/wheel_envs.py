"""The fedccrl wheel and virtual environments that install it outside the repository (tests/test_install.py,
tests/test_flower.py; session fixtures in tests/conftest.py).

- `build_wheel`: `python -m build` (sdist, then the wheel built from that sdist), so a file missing from
  either shows up here.
- `serve_venv`: a fresh venv with `<wheel>[serve]` installed from the package index with -c constraints.txt.
- `full_venv`: a fresh venv with the wheel installed with --no-deps, plus flwr (--no-deps, for its console
  scripts: flower-supernode, flwr-clientapp); the other training dependencies (torch, ...) are reached through
  a .pth file listing the site-packages folders of the interpreter running the tests, since installing
  torch and its CUDA libraries into a temporary venv would download several GB per run. A .pth line only
  adds a folder to sys.path (the .pth files inside it are not run), so the checkout's editable install
  is not: fedccrl itself comes from the wheel.

`run_outside` runs a command from such a venv in a folder with no checkout and no PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints.txt"


PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
SELF = re.compile(r"fedccrl\[([a-z,-]+)\]")  # an extra built on others (full: fedccrl[site])


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def extra(*names: str) -> list[str]:
    """pyproject.toml's requirements of the base install with the extras `names`, an extra's `fedccrl[...]` read
    from this checkout's pyproject.toml (the installed fedccrl's metadata may be older)."""
    reqs, todo, seen = list(PROJECT["dependencies"]), list(names), set()
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        for r in PROJECT["optional-dependencies"][name]:
            inner = SELF.fullmatch(r)
            todo += inner.group(1).split(",") if inner else []
            reqs += [] if inner else [r]
    return reqs


def top_level_modules(dist: metadata.Distribution) -> set[str]:
    """The import names an installed distribution provides."""
    listed = dist.read_text("top_level.txt")
    if listed:
        return set(listed.split())
    return {
        f.parts[0].removesuffix(".py") for f in dist.files or [] if not f.parts[0].endswith((".dist-info", ".data"))
    }


def requirement_closure(requirements: list[str], read_as: dict[str, str] | None = None) -> set[str]:
    """The distributions that installing `requirements` brings, transitively, from the installed
    distributions' metadata (Requires-Dist with its markers and extras). `read_as` reads a distribution's
    requirements from another installed one (e.g. onnxruntime from onnxruntime-gpu: the CPU and GPU builds
    of one release declare the same requirements; tests/test_install.py checks it in the serve venv)."""
    from packaging.requirements import Requirement

    read_as = {canonical(k): v for k, v in (read_as or {}).items()}
    seen: set[tuple[str, frozenset]] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name, extras = canonical(req.name), frozenset(req.extras)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        for line in metadata.distribution(read_as.get(name, name)).requires or []:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in (*extras, "")):
                todo.append(dep)
    return {name for name, _ in seen}


def _run(args: list, cwd: Path, what: str, timeout: float = 900) -> subprocess.CompletedProcess:
    p = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=outside_env(), capture_output=True, text=True, timeout=timeout
    )
    assert p.returncode == 0, f"{what} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def outside_env() -> dict:
    """The environment of a process outside the checkout: no PYTHONPATH (nothing of the repository on sys.path)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def build_wheel(out: Path) -> Path:
    try:
        import build  # noqa: F401 (only whether it is installed)
    except ImportError as e:
        raise AssertionError("`python -m build` needs the build package: pip install -e '.[dev]'") from e
    out.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "build", "--outdir", out, REPO], out, "python -m build")
    (wheel,) = out.glob("fedccrl-*.whl")
    return wheel


def make_venv(path: Path) -> Path:
    _run([sys.executable, "-m", "venv", path], path.parent, f"python -m venv {path}")
    return path


def pip_install(venv: Path, *args) -> None:
    _run(
        [venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
        venv,
        f"pip install {' '.join(map(str, args))}",
    )


def serve_venv(root: Path, wheel: Path) -> Path:
    venv = make_venv(root / "serve-venv")
    pip_install(venv, "-c", CONSTRAINTS, f"{wheel}[serve]")
    return venv


def full_venv(root: Path, wheel: Path) -> Path:
    venv = make_venv(root / "full-venv")
    pip_install(venv, "--no-deps", wheel, f"flwr=={metadata.version('flwr')}")
    (site,) = (venv / "lib").glob("python3*/site-packages")
    deps = [p for p in sys.path if p.rstrip("/").endswith("site-packages") and Path(p).is_dir()]
    (site / "zz_training_dependencies.pth").write_text("".join(f"{p}\n" for p in deps))
    return venv


def run_outside(folder: Path, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `args` (the first one a program of a venv) in `folder`, which holds no checkout."""
    folder.mkdir(parents=True, exist_ok=True)
    assert not (folder / "pyproject.toml").exists() and REPO not in (folder, *folder.parents)
    return subprocess.run(
        [str(a) for a in args], cwd=folder, env=outside_env(), capture_output=True, text=True, timeout=timeout
    )


if __name__ == "__main__":  # in a venv: the closure of the installed fedccrl with the given extras, as JSON
    extras = sys.argv[1:]
    print(json.dumps(sorted(requirement_closure([f"fedccrl[{','.join(extras)}]" if extras else "fedccrl"]))))
