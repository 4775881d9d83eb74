"""`fedccrl bench-repro`: `dvc repro` of the default pipeline, timed stage by stage, against the 180 s target on 2 cores.

Runs the repository's dvc.yaml and params.yaml from scratch in a temporary workspace (the code folders the
stages depend on are linked, data/models/results are fresh; MLflow goes to a temporary SQLite store), with
FEDCCRL_STAGE_TIMES set so every stage process records its start-up (interpreter + imports), body, CPU and
MLflow seconds (pipeline/cli.py `run_stage`). Then, in the same run:
  * the previous design's train stage for comparison: one process per (algorithm, seed, held-out domain),
    run one after another as DVC ran them, with `train.fast: false` (no channels_last on the CPU);
  * the thread policy: spin (OMP_WAIT_POLICY=ACTIVE) against passive while a busy process shares the cores
    (pipeline/bench_threads.py).
It prints what it measured and ratios against baselines measured in this run; it asserts nothing.
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


def bench_repro(compare: bool, thread_steps: int, keep: Path | None) -> dict:
    from pipeline.bench_threads import measure

    root = Path.cwd()
    for f in ("dvc.yaml", "params.yaml"):
        if not (root / f).is_file():
            raise FileNotFoundError(f"{root / f}: not found (run `fedccrl bench-repro` from the repository root)")
    dvc_exe = shutil.which("dvc")
    if dvc_exe is None:
        raise FileNotFoundError("dvc: not on PATH (activate the project's .venv)")
    dvc_doc = yaml.safe_load((root / "dvc.yaml").read_text())
    params = yaml.safe_load((root / "params.yaml").read_text())
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
        print(f"bench-repro: dvc repro of the default in {ws}", file=sys.stderr, flush=True)
        repro_wall, repro_cpu = _run([dvc_exe, "repro"], ws, env, "dvc repro")
        rows = _stage_rows(times)

        prev = None
        if compare:
            tr = params["train"]
            prev_params = yaml.safe_load((root / "params.yaml").read_text())
            prev_params["train"]["fast"] = False
            (ws / "prev_params.yaml").write_text(yaml.safe_dump(prev_params, sort_keys=False))
            prev_times = ws / "prev_times.jsonl"
            penv = {**env, "FEDCCRL_STAGE_TIMES": str(prev_times)}
            wall = cpu = 0.0
            for alg in tr["algorithms"]:
                for seed in tr["seeds"]:
                    for i in tr["held_out"]:
                        print(f"bench-repro: previous design, train {alg} seed {seed} held-out {i}",
                              file=sys.stderr, flush=True)
                        w, c = _run(["fedccrl", "train", "--shards", "data/shards", "--pools", "data/pools",
                                     "--algorithm", str(alg), "--seed", str(seed), "--held-out", str(i),
                                     "--out", f"prev/{alg}/s{seed}", "--checkpoints", "prev_checkpoints",
                                     "--params", "prev_params.yaml", "--workers", "1"], ws, penv, "previous train")
                        wall, cpu = wall + w, cpu + c
            prev = {"wall_s": wall, "cpu_s": cpu, "rows": _stage_rows(prev_times)}

        print(f"bench-repro: thread policy ({thread_steps} steps, 1 busy process)", file=sys.stderr, flush=True)
        policy = measure(thread_steps, 2, 1)
    finally:
        if keep is None:
            shutil.rmtree(ws, ignore_errors=True)
    result = {"repro_wall_s": repro_wall, "repro_cpu_s": repro_cpu, "stages": rows, "previous_train": prev,
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
    p = r["previous_train"]
    if p:
        now = by.get("train", {"startup": 0.0, "body": 0.0, "cpu": 0.0, "mlflow": 0.0, "n": 0})
        now_wall = now["startup"] + now["body"]
        pstart = sum(x["startup_s"] or 0.0 for x in p["rows"])
        pml = sum(x["mlflow_s"] for x in p["rows"])
        echo("  train stage, this design vs the previous one (a process per held-out domain, in sequence, "
             "train.fast false; same runs):")
        echo(f"    wall   {now_wall:7.1f}s vs {p['wall_s']:7.1f}s  ({p['wall_s'] / max(now_wall, 1e-9):.2f}x)")
        echo(f"    cpu    {now['cpu']:7.1f}s vs {p['cpu_s']:7.1f}s  ({p['cpu_s'] / max(now['cpu'], 1e-9):.2f}x)")
        echo(f"    start-up {now['startup']:5.1f}s vs {pstart:7.1f}s over {now['n']} vs {len(p['rows'])} processes; "
             f"MLflow {now['mlflow']:.1f}s vs {pml:.1f}s")
    a, q = r["thread_policy"]["ACTIVE"], r["thread_policy"]["PASSIVE"]
    echo(f"  thread policy, a busy process sharing the cores: spin / passive wall {a['wall'] / q['wall']:.2f}x "
         f"cpu {a['cpu'] / q['cpu']:.2f}x (spin {a['wall']:.2f}s, passive {q['wall']:.2f}s)")


@click.command("bench-repro")
@click.option("--compare/--no-compare", default=True, show_default=True,
              help="also run the train stage the previous way (a process per held-out domain, fast off)")
@click.option("--thread-steps", type=int, default=40, show_default=True, help="steps per thread-policy measurement")
@click.option("--keep", type=click.Path(path_type=Path), default=None,
              help="run in this (empty or new) folder and keep it, instead of a temporary one")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="also write the figures here")
def command(compare, thread_steps, keep, json_out):
    """`dvc repro` of the default from scratch: wall/CPU per stage, start-up, MLflow, thread policy."""
    from pipeline.cli import run_stage

    result = run_stage(bench_repro, compare, thread_steps, keep)
    if json_out is not None:
        from fedccrl_core.fsio import write_json

        write_json(json_out, result)
