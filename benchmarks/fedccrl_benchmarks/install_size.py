"""`fedccrl-bench install-size`: what each install puts on disk, the `site` extra (what a Flower site runs: docs/flower.md)
against the `full` extra (a training machine), measured in one run.

Builds the fedccrl wheel (or takes `--wheel`), then makes one fresh venv per extra and installs `<wheel>[extra]` into
it with pip, from a local folder of wheels only (`--find-links DIR --no-index`, no pip configuration; docs/benchmarks.md
fills it with `pip download` of the full extra, whose wheels hold the site extra's) and the project's constraints.txt. It prints, per venv, the
size of its files (apparent size, MB = 10^6 bytes), of the torch distribution, of what torch brings for the GPU (the
nvidia-* CUDA libraries and triton), and the site install's share of the full one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[2]
EXTRAS = ("full", "site")  # the baseline first
SIZES = r"""
import json, os, sys
from importlib import metadata
seen, by_dist = set(), {}
for dist in metadata.distributions():
    name = dist.metadata["Name"].lower().replace("_", "-")
    total = 0
    for f in dist.files or []:
        p = os.path.realpath(dist.locate_file(f))
        if p not in seen and os.path.isfile(p):
            seen.add(p)
            total += os.path.getsize(p)
    by_dist[name] = by_dist.get(name, 0) + total
print(json.dumps(by_dist))
"""


def folder_bytes(folder: Path) -> int:
    """The apparent size of every file under `folder` (links not followed)."""
    return sum((Path(root) / f).lstat().st_size for root, _, files in os.walk(folder) for f in files)


def _run(args: list, what: str, cwd: Path, timeout: float = 3600) -> subprocess.CompletedProcess:
    """`args` in `cwd`, with no pip configuration and no PYTHONPATH: a checkout on the path holds fedccrl.egg-info,
    which pip would take for an installed fedccrl (and skip the wheel)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_CONFIG_FILE"] = os.devnull
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if p.returncode != 0:
        raise click.ClickException(f"{what} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p


def build_wheel(out: Path) -> Path:
    """The project's wheel, built from this checkout's sdist (in a temporary folder, so the checkout gets no build/)
    with this environment's setuptools, without network."""
    out.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, REPO], "python -m build", out)
    (wheel,) = out.glob("fedccrl-*.whl")
    return wheel


def measure(extra: str, wheel: Path, wheels: Path, work: Path) -> dict:
    """Install `<wheel>[extra]` into a fresh venv under `work`; its sizes in bytes."""
    venv = work / f"{extra}-venv"
    _run([sys.executable, "-m", "venv", venv], f"python -m venv {venv}", work)
    py = venv / "bin" / "python"
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--find-links", wheels]
    _run([*pip, "-c", REPO / "constraints.txt", f"{wheel}[{extra}]"], f"pip install {wheel.name}[{extra}]", work)
    dists = json.loads(_run([py, "-c", SIZES], "sizes", work).stdout)
    if "fedccrl" not in dists:
        raise click.ClickException(f"{venv}: fedccrl is not installed")
    cuda = [k for k in dists if (k.startswith(("nvidia-", "cuda-")) and k != "nvidia-ml-py") or k == "triton"]
    gpu = sum(dists[k] for k in cuda)
    return {"total": folder_bytes(venv), "torch": dists.get("torch", 0), "gpu": gpu, "dists": len(dists)}


def table(sizes: dict[str, dict]) -> str:
    mb = lambda b: f"{b / 1e6:,.0f}"  # noqa: E731
    lines = [
        "| install | distributions | size MB | torch MB | CUDA libraries + triton MB | torch + CUDA share | rest MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for extra, s in sizes.items():
        rest = s["total"] - s["torch"] - s["gpu"]
        share = (s["torch"] + s["gpu"]) / s["total"]
        lines.append(
            f"| `{extra}` | {s['dists']} | {mb(s['total'])} | {mb(s['torch'])} | {mb(s['gpu'])} | {share:.0%} | {mb(rest)} |"
        )
    base, site = sizes[EXTRAS[0]], sizes[EXTRAS[1]]
    rest = lambda s: s["total"] - s["torch"] - s["gpu"]  # noqa: E731
    lines.append(
        f"\nsite / full: size {site['total'] / base['total']:.2f}, beside torch and its CUDA libraries "
        f"{rest(site) / rest(base):.2f}"
    )
    return "\n".join(lines)


@click.command("install-size")
@click.option("--find-links", "wheels", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--wheel", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="default: build it")
@click.option("--work", type=click.Path(file_okay=False, path_type=Path), help="default: a temporary folder")
def command(wheels: Path, wheel: Path | None, work: Path | None) -> None:
    """Disk size of the site install against the full install (fresh venvs, local wheels only)."""
    with tempfile.TemporaryDirectory(prefix="fedccrl-install-size-") as tmp:
        work = work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        wheel = wheel or build_wheel(work / "dist")
        sizes = {}
        for extra in EXTRAS:
            sizes[extra] = measure(extra, wheel, wheels, work)
            print(f"{extra}: {sizes[extra]['total'] / 1e6:,.0f} MB", file=sys.stderr, flush=True)
        click.echo(table(sizes))
