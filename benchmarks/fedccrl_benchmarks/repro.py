"""`fedccrl-bench repro`: `dvc repro` of the default pipeline, timed stage by stage, then two incremental reruns.

Runs the repository's dvc.yaml, params.yaml and .dvcignore from scratch in a temporary workspace (the code folders
the stages depend on are linked, data/models/results are fresh; MLflow goes to a temporary SQLite store). Nothing in
the stages is instrumented: a wrapper put first on PATH in this run starts each `fedccrl` command that DVC runs and
records its wall time, and Python's own `-X importtime` (PYTHONPROFILEIMPORTTIME) reports what its imports took.
What is left of `dvc repro`'s wall time is DVC's own: its start-up, then after each command the hashing and caching
of that stage's outputs, the lock file and the next stage's status check.

Then, in the same workspace, the two reruns a user makes most: one `figures.*` key changed (`figures.seed`: only
`figures` may run) and one `export.*` key changed (`export.batch_size`: only `export` may run), each by one, so
that the stage has the same work to do again, and each timed as a whole `dvc repro` against the full one.
Last, the thread policy: spin (OMP_WAIT_POLICY=ACTIVE) against passive while a busy process shares the cores
(benchmarks/fedccrl_benchmarks/threads.py). It reports ratios against the baselines measured in this run; it asserts nothing.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import yaml

OVERHEAD_TARGET = 0.25  # everything but the train stages: at most this share of `dvc repro`'s wall time
RERUN_TARGET = 0.10  # `dvc repro` after one figures setting: at most this share of the full `dvc repro`
FIGURES_KEY, EXPORT_KEY = ("figures", "seed"), ("export", "batch_size")  # changed by one: the same work again

# The wrapper DVC runs as `fedccrl`: the real command under PYTHONPROFILEIMPORTTIME, its import lines kept apart
# from the rest of its stderr, one line per command in $BENCH_LOG: start, end (epoch seconds), exit code, pid, args.
WRAPPER = r"""#!/usr/bin/env bash
t0=$EPOCHREALTIME
PYTHONPROFILEIMPORTTIME=1 "$BENCH_REAL" "$@" 2> >(awk -v f="$BENCH_DIR/imports.$$" \
  '/^import time:/ {print > f; next} {print > "/dev/stderr"; fflush("/dev/stderr")}')
rc=$?
wait $!
echo "$t0 $EPOCHREALTIME $rc $$ $*" >> "$BENCH_DIR/commands.log"
exit $rc
"""


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _code_dirs(root: Path, dvc: dict) -> list[str]:
    """Top-level folders the stages depend on that no stage writes: the code, linked into the workspace."""
    outs, deps = set(), set()
    for st in dvc["stages"].values():
        for o in st.get("outs", []):
            outs.add(str(next(iter(o)) if isinstance(o, dict) else o).split("/")[0])
        for d in st.get("deps", []):
            deps.add(str(d).split("/")[0])
    return sorted(d for d in deps - outs if "$" not in d and (root / d).is_dir())


def import_seconds(lines: list[str]) -> float:
    """The wall seconds of a process's imports from its `-X importtime` lines: the cumulative time of each
    top-level import (a name without indentation; nested imports are inside their parent's cumulative)."""
    total_us = 0
    for line in lines:
        try:
            _, cumulative, name = line.removeprefix("import time:").split("|")
            us = int(cumulative)
        except ValueError:  # the header line
            continue
        if not name.startswith("  "):  # one space after the bar, more for a nested import
            total_us += us
    return total_us / 1e6


def _repro(ws: Path, env: dict, bench_dir: Path, what: str) -> dict:
    """`dvc repro` in ws: its wall and CPU, and every `fedccrl` command it ran (name, start, end, imports)."""
    log = bench_dir / "commands.log"
    log.unlink(missing_ok=True)
    for f in bench_dir.glob("imports.*"):
        f.unlink()
    print(f"bench-repro: {what}", file=sys.stderr, flush=True)
    c0, t0, epoch0 = _children_cpu(), time.perf_counter(), time.time()
    p = subprocess.run(["dvc", "repro"], cwd=ws, env=env, stdout=sys.stderr, stderr=sys.stderr)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    if p.returncode != 0:
        raise RuntimeError(f"bench-repro: {what}: dvc repro failed (exit code {p.returncode}) in {ws}")
    commands = []
    for line in log.read_text().splitlines() if log.is_file() else []:
        start, end, rc, pid, *args = line.split()
        imports = bench_dir / f"imports.{pid}"
        commands.append(
            {
                "stage": args[0],
                "start": float(start) - epoch0,
                "end": float(end) - epoch0,
                "rc": int(rc),
                "imports_s": import_seconds(imports.read_text().splitlines()) if imports.is_file() else 0.0,
            }
        )
    return {"wall_s": wall, "cpu_s": cpu, "commands": sorted(commands, key=lambda c: c["start"])}


def _set_param(ws: Path, key: tuple[str, str]) -> str:
    """Change one integer key of the workspace's params.yaml by one; returns `group.key=value`."""
    params = yaml.safe_load((ws / "params.yaml").read_text())
    group, name = key
    params[group][name] = int(params[group][name]) + 1
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return f"{group}.{name}={params[group][name]}"


def bench_repro(thread_steps: int, keep: Path | None) -> dict:
    from fedccrl_benchmarks.threads import measure

    root = Path.cwd()
    for f in ("dvc.yaml", "params.yaml"):
        if not (root / f).is_file():
            raise FileNotFoundError(f"{root / f}: not found (run `fedccrl-bench repro` from the repository root)")
    real = shutil.which("fedccrl")
    if shutil.which("dvc") is None or real is None:
        raise FileNotFoundError("dvc or fedccrl: not on PATH (activate the project's .venv)")
    dvc_doc = yaml.safe_load((root / "dvc.yaml").read_text())
    if keep is not None and keep.exists() and any(keep.iterdir()):
        raise FileExistsError(f"--keep {keep}: not empty")
    ws = Path(tempfile.mkdtemp(prefix="fedccrl-bench-repro-")) if keep is None else keep
    ws.mkdir(parents=True, exist_ok=True)
    bench_dir = Path(tempfile.mkdtemp(prefix="fedccrl-bench-wrapper-"))
    try:
        (bench_dir / "bin").mkdir()
        wrapper = bench_dir / "bin" / "fedccrl"
        wrapper.write_text(WRAPPER)
        wrapper.chmod(0o755)
        for f in ("dvc.yaml", "params.yaml"):
            shutil.copy(root / f, ws / f)
        for d in _code_dirs(root, dvc_doc):
            (ws / d).symlink_to(root / d)
        env = {
            **os.environ,
            "MLFLOW_TRACKING_URI": f"sqlite:///{ws / 'mlflow.db'}",
            "DVC_NO_ANALYTICS": "1",
            "PATH": f"{bench_dir / 'bin'}{os.pathsep}{os.environ['PATH']}",
            "BENCH_REAL": real,
            "BENCH_DIR": str(bench_dir),
        }
        subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=ws, env=env, check=True)
        for extra in (".dvcignore", ".dvc/plots"):  # what DVC leaves out of folder hashes; the curves' template
            src = root / extra
            if src.is_dir():
                shutil.copytree(src, ws / extra, dirs_exist_ok=True)
            elif src.is_file():
                shutil.copy(src, ws / extra)
        full = _repro(ws, env, bench_dir, f"dvc repro of the default from scratch in {ws}")
        reruns = {}
        for key in (FIGURES_KEY, EXPORT_KEY):
            change = _set_param(ws, key)
            reruns[change] = _repro(ws, env, bench_dir, f"dvc repro after {change}")
        print(f"bench-repro: thread policy ({thread_steps} steps, 1 busy process)", file=sys.stderr, flush=True)
        policy = measure(thread_steps, 2, 1)
    finally:
        shutil.rmtree(bench_dir, ignore_errors=True)
        if keep is None:
            shutil.rmtree(ws, ignore_errors=True)
    result = {
        "full": full,
        "reruns": reruns,
        "thread_policy": policy,
        "cores": len(os.sched_getaffinity(0)),
        "load_avg": os.getloadavg()[0],
    }
    _print(result)
    return result


def stage_table(run: dict) -> tuple[dict, float]:
    """{stage: {procs, wall, imports, dvc}} of one `dvc repro`, and DVC's start-up before the first command. A
    command's `dvc` seconds: from its end to the next command's start (or to the end of `dvc repro`): DVC saving
    its outputs and checking the next stage."""
    cmds = run["commands"]
    by: dict[str, dict] = {}
    for i, c in enumerate(cmds):
        nxt = cmds[i + 1]["start"] if i + 1 < len(cmds) else run["wall_s"]
        s = by.setdefault(c["stage"], {"procs": 0, "wall": 0.0, "imports": 0.0, "dvc": 0.0})
        s["procs"] += 1
        s["wall"] += c["end"] - c["start"]
        s["imports"] += c["imports_s"]
        s["dvc"] += max(0.0, nxt - c["end"])
    return by, (cmds[0]["start"] if cmds else run["wall_s"])


def _print(r: dict) -> None:
    echo = click.echo
    full = r["full"]
    by, dvc_start = stage_table(full)
    wall = full["wall_s"]
    train = by.get("train", {}).get("wall", 0.0)
    other = wall - train
    echo(
        f"everything but training: {100 * other / wall:.1f} % of dvc repro's wall ({other:.1f}s of {wall:.1f}s; "
        f"training {train:.1f}s; target at most {100 * OVERHEAD_TARGET:.0f} %: "
        f"{'met' if other <= OVERHEAD_TARGET * wall else 'MISSED'})"
    )
    echo(
        f"dvc repro of the default, from scratch: wall {wall:.1f}s  cpu {full['cpu_s']:.1f}s  "
        f"({r['cores']} cores, load average {r['load_avg']:.2f} at the end)"
    )
    echo(f"  {'stage':<10} {'procs':>5} {'wall s':>8} {'imports s':>10} {'dvc s':>7}")
    for name, s in by.items():
        echo(f"  {name:<10} {s['procs']:>5} {s['wall']:>8.1f} {s['imports']:>10.1f} {s['dvc']:>7.1f}")
    dvc_total = dvc_start + sum(s["dvc"] for s in by.values())
    echo(
        f"  DVC itself: {dvc_total:.1f}s ({dvc_start:.1f}s before the first stage; `dvc s`: after each stage's "
        f"command, saving its outputs and checking the next); imports: -X importtime, all of a stage's processes"
    )
    for change, run in r["reruns"].items():
        ran = sorted({c["stage"] for c in run["commands"]})
        share = run["wall_s"] / wall
        target = (
            f"; target at most {100 * RERUN_TARGET:.0f} %: {'met' if share <= RERUN_TARGET else 'MISSED'}"
            if change.startswith(FIGURES_KEY[0] + ".")
            else ""
        )
        echo(
            f"after {change}: dvc repro {run['wall_s']:.1f}s = {100 * share:.1f} % of the full one{target}; "
            f"stages run: {', '.join(ran) or 'none'}"
        )
    a, q = r["thread_policy"]["ACTIVE"], r["thread_policy"]["PASSIVE"]
    echo(
        f"thread policy, a busy process sharing the cores: spin / passive wall {a['wall'] / q['wall']:.2f}x "
        f"cpu {a['cpu'] / q['cpu']:.2f}x (spin {a['wall']:.2f}s, passive {q['wall']:.2f}s)"
    )


@click.command("repro")
@click.option("--thread-steps", type=int, default=40, show_default=True, help="steps per thread-policy measurement")
@click.option(
    "--keep",
    type=click.Path(path_type=Path),
    default=None,
    help="run in this (empty or new) folder and keep it, instead of a temporary one",
)
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="also write the figures here")
def command(thread_steps, keep, json_out):
    """`dvc repro` of the default from scratch, stage by stage; then one figures and one export setting changed."""
    from fedccrl_pipeline.stage_runtime import run_stage

    result = run_stage(bench_repro, thread_steps, keep)
    if json_out is not None:
        from fedccrl_core.foundation.fsio import write_json

        write_json(json_out, result)
