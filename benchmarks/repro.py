"""`fedccrl bench-repro`: `dvc repro` of the default pipeline, timed stage by stage, against the 180 s target on 2 cores.
Its headline is the share of the wall time spent outside the train stages (DVC itself included), against 20 %.

Runs the repository's dvc.yaml, params.yaml and .dvcignore from scratch in a temporary workspace (the code folders the
stages depend on are linked, data/models/results are fresh; MLflow goes to a temporary SQLite store), with
FEDCCRL_STAGE_TIMES set so every stage process records its start-up (interpreter + imports), body, CPU and
MLflow seconds (pipeline/cli.py `run_stage`). Then, in the same run, the thread policy: spin
(OMP_WAIT_POLICY=ACTIVE) against passive while a busy process shares the cores (benchmarks/threads.py).
It reports this design only (the stage times against the 180 s target; the thread policy as a ratio against
the passive baseline measured in this run); it asserts nothing.
"""
from __future__ import annotations

import json
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

TARGET_S = 180.0  # the budget of the main job: `dvc repro` of the default within 180 s on 2 cores
OVERHEAD_TARGET = 0.20  # everything but the train stages: at most this share of `dvc repro`'s wall time


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


def _run(cmd: list[str], ws: Path, env: dict, what: str) -> tuple[float, float]:
    """(wall, CPU of the finished process tree) of one command; its output goes to stderr."""
    c0, t0 = _children_cpu(), time.perf_counter()
    p = subprocess.run(cmd, cwd=ws, env=env, stdout=sys.stderr, stderr=sys.stderr)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed (exit code {p.returncode}): {' '.join(cmd)} in {ws}")
    return wall, cpu


def _stage_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def bench_repro(thread_steps: int, keep: Path | None) -> dict:
    from benchmarks.threads import measure

    root = Path.cwd()
    for f in ("dvc.yaml", "params.yaml"):
        if not (root / f).is_file():
            raise FileNotFoundError(f"{root / f}: not found (run `fedccrl bench-repro` from the repository root)")
    dvc_exe = shutil.which("dvc")
    if dvc_exe is None:
        raise FileNotFoundError("dvc: not on PATH (activate the project's .venv)")
    dvc_doc = yaml.safe_load((root / "dvc.yaml").read_text())
    ws = Path(tempfile.mkdtemp(prefix="fedccrl-bench-repro-")) if keep is None else keep
    if keep is not None:
        if keep.exists() and any(keep.iterdir()):
            raise FileExistsError(f"--keep {keep}: not empty")
        keep.mkdir(parents=True, exist_ok=True)
    try:
        for f in ("dvc.yaml", "params.yaml"):
            shutil.copy(root / f, ws / f)
        for d in _code_dirs(root, dvc_doc):
            (ws / d).symlink_to(root / d)
        times = ws / "stage_times.jsonl"
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{ws / 'mlflow.db'}",
               "FEDCCRL_STAGE_TIMES": str(times), "DVC_NO_ANALYTICS": "1"}
        subprocess.run([dvc_exe, "init", "--no-scm", "-q"], cwd=ws, env=env, check=True)
        if (root / ".dvcignore").is_file():  # what DVC leaves out of the hashes of folders, as in the repository
            shutil.copy(root / ".dvcignore", ws / ".dvcignore")
        print(f"bench-repro: dvc repro of the default in {ws}", file=sys.stderr, flush=True)
        repro_wall, repro_cpu = _run([dvc_exe, "repro"], ws, env, "dvc repro")
        rows = _stage_rows(times)

        print(f"bench-repro: thread policy ({thread_steps} steps, 1 busy process)", file=sys.stderr, flush=True)
        policy = measure(thread_steps, 2, 1)
    finally:
        if keep is None:
            shutil.rmtree(ws, ignore_errors=True)
    result = {"repro_wall_s": repro_wall, "repro_cpu_s": repro_cpu, "stages": rows,
              "thread_policy": policy, "cores": len(os.sched_getaffinity(0)), "load_avg": os.getloadavg()[0]}
    _print(result)
    return result


def _print(r: dict) -> None:
    rows = r["stages"]
    by: dict[str, dict] = {}
    for row in rows:
        s = by.setdefault(row["stage"], {"n": 0, "startup": 0.0, "body": 0.0, "cpu": 0.0, "mlflow": 0.0})
        s["n"] += 1
        s["startup"] += row["startup_s"] or 0.0
        s["body"] += row["body_s"]
        s["cpu"] += row["cpu_s"]
        s["mlflow"] += row["mlflow_s"]
    echo = click.echo
    train = by.get("train", {"startup": 0.0, "body": 0.0})
    train_wall = train["startup"] + train["body"]
    other = r["repro_wall_s"] - train_wall
    echo(f"everything but training: {100 * other / r['repro_wall_s']:.1f} % of dvc repro's wall "
         f"({other:.1f}s of {r['repro_wall_s']:.1f}s; training {train_wall:.1f}s; target at most "
         f"{100 * OVERHEAD_TARGET:.0f} %: {'met' if other <= OVERHEAD_TARGET * r['repro_wall_s'] else 'MISSED'})")
    echo(f"dvc repro of the default, from scratch: wall {r['repro_wall_s']:.1f}s  cpu {r['repro_cpu_s']:.1f}s  "
         f"({r['cores']} cores, load average {r['load_avg']:.2f}; target {TARGET_S:.0f}s: "
         f"{'met' if r['repro_wall_s'] <= TARGET_S else 'MISSED'})")
    echo(f"  {'stage':<10} {'procs':>5} {'wall s':>8} {'start-up s':>10} {'cpu s':>8} {'mlflow s':>9}")
    for name, s in by.items():
        echo(f"  {name:<10} {s['n']:>5} {s['startup'] + s['body']:>8.1f} {s['startup']:>10.1f} {s['cpu']:>8.1f} "
             f"{s['mlflow']:>9.1f}")
    stage_wall = sum(s["startup"] + s["body"] for s in by.values())
    startup = sum(s["startup"] for s in by.values())
    mlflow = sum(s["mlflow"] for s in by.values())
    echo(f"  overhead: start-up + imports {startup:.1f}s over {len(rows)} processes; MLflow {mlflow:.1f}s; "
         f"DVC itself {r['repro_wall_s'] - stage_wall:.1f}s")
    a, q = r["thread_policy"]["ACTIVE"], r["thread_policy"]["PASSIVE"]
    echo(f"  thread policy, a busy process sharing the cores: spin / passive wall {a['wall'] / q['wall']:.2f}x "
         f"cpu {a['cpu'] / q['cpu']:.2f}x (spin {a['wall']:.2f}s, passive {q['wall']:.2f}s)")


@click.command("bench-repro")
@click.option("--thread-steps", type=int, default=40, show_default=True, help="steps per thread-policy measurement")
@click.option("--keep", type=click.Path(path_type=Path), default=None,
              help="run in this (empty or new) folder and keep it, instead of a temporary one")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="also write the figures here")
def command(thread_steps, keep, json_out):
    """`dvc repro` of the default from scratch: wall/CPU per stage, start-up, MLflow, thread policy."""
    from pipeline.cli import run_stage

    result = run_stage(bench_repro, thread_steps, keep)
    if json_out is not None:
        from fedccrl_core.fsio import write_json

        write_json(json_out, result)
