"""Two people at once: two clones of one git repository, one DVC remote, one MLflow store. Each clone queues its
sweep (`dvc exp run --queue`, one experiment per seed) and both run `dvc queue start -j 2` at the same time; then
the first clone shares an experiment (`dvc exp push`: git refs to origin, outputs to the DVC remote) and the second
gets it (`dvc exp pull`, then `dvc pull`) and serves its model without retraining.

  python scripts/team_sweeps.py --tracking-uri http://127.0.0.1:5001 [--work DIR] [--per-clone 2]
  python scripts/team_sweeps.py --tracking-uri sqlite:////shared/folder/mlflow.db

It prints one line per check and a JSON summary (--json), and exits 0 when every check holds: every queued
experiment succeeded; the store holds each sweep's parent run once, one child run per training, every round of
each exactly once; the registry's versions are unique and each alias points to the version its seed trained; the
second clone got the first one's experiment and served its model. The settings are tiny (synthetic data at 16 px,
FedAvg, one held-out domain, 2 rounds) and the experiments run up to the `export` stage (the registry's models).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from fedccrl_benchmarks.accuracy import apply_overrides
from fedccrl_core.foundation.fsio import write_json

REPO = Path(__file__).resolve().parents[1]

BIN = Path(sys.executable).parent
CODE = ("fedccrl_core", "fedccrl_flower", "pipeline", "serving")
TINY = [
    "preprocess.image_size=16",
    "train.algorithms=[fedavg]",
    "train.seeds=[0]",
    "train.held_out=[sketch]",
    "train.rounds=2",
    "train.local_epochs=1",
    "tracking.system_metrics=false",
]  # as `dvc exp run -S` spells them
ROUNDS, HELD_OUT, ALGORITHM = 2, "sketch", "fedavg"
LRS = (0.003, 0.004)  # the learning rate of each clone's sweep


def say(msg: str) -> None:
    print(f"team-sweeps: {msg}", file=sys.stderr, flush=True)


def env_for(uri: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FEDCCRL_MLFLOW_ARTIFACTS", "PYTHONPATH")}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env['PATH']}",
        DVC_NO_ANALYTICS="1",
        OMP_NUM_THREADS="1",
        MLFLOW_TRACKING_URI=uri,
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@t",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@t",
    )
    return env


def sh(args: list[str], cwd: Path, env: dict, timeout: float = 600) -> str:
    p = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(
            f"{' '.join(args)} in {cwd} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        )
    return p.stdout


def make_origin(work: Path, env: dict) -> tuple[Path, Path]:
    """A bare git repository holding the pipeline at tiny settings (the code linked from this checkout), and the
    DVC remote (a shared folder) its config names as the default."""
    origin, remote, seed = work / "origin.git", work / "dvc-remote", work / "seed"
    sh(["git", "init", "-q", "--bare", "-b", "main", str(origin)], work, env)
    remote.mkdir()
    seed.mkdir()
    for f in ("dvc.yaml", ".dvcignore"):
        shutil.copy(REPO / f, seed / f)
    for d in CODE:
        (seed / d).symlink_to(REPO / d)
    params = apply_overrides(yaml.safe_load((REPO / "params.yaml").read_text()), TINY)
    (seed / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (seed / ".gitignore").write_text("/data/\n/models/\n/results/\n/plots/\n/exports/\n.fedccrl/\nmlflow.db\n")
    sh(["git", "init", "-q", "-b", "main"], seed, env)
    sh(["dvc", "init", "-q"], seed, env)
    shutil.copytree(REPO / ".dvc" / "plots", seed / ".dvc" / "plots", dirs_exist_ok=True)
    sh(["dvc", "remote", "add", "-d", "shared", str(remote)], seed, env)
    sh(["git", "add", "-A"], seed, env)
    sh(["git", "commit", "-qm", "the pipeline"], seed, env)
    sh(["git", "push", "-q", str(origin), "main"], seed, env)
    shutil.rmtree(seed)
    return origin, remote


def queue_sweeps(clones: dict[str, list[int]], env: dict, jobs: int, deadline_s: float) -> dict[str, str]:
    """Each clone queues one experiment per seed, then every clone's `dvc queue start -j <jobs>` at once; waits
    until no clone has a queued or running experiment. Returns each clone's `dvc queue status`."""
    for k, (clone, seeds) in enumerate(clones.items()):
        for s in seeds:  # each clone its own learning rate: one sweep (one parent run) per clone, one seed each
            sh(
                [
                    "dvc",
                    "exp",
                    "run",
                    "--queue",
                    "-n",
                    f"{Path(clone).name}-s{s}",
                    "-S",
                    f"train.seeds=[{s}]",
                    "-S",
                    f"train.lr={LRS[k]}",
                    "export",
                ],
                Path(clone),
                env,
            )
    say(
        f"{sum(map(len, clones.values()))} experiments queued in {len(clones)} clones; dvc queue start -j {jobs} in each"
    )
    starts = [
        subprocess.Popen(
            ["dvc", "queue", "start", "-j", str(jobs)],
            cwd=clone,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for clone in clones
    ]
    for p in starts:
        p.wait(timeout=300)
    deadline, status = time.monotonic() + deadline_s, {}
    try:
        while True:
            status = {c: sh(["dvc", "queue", "status"], Path(c), env) for c in clones}
            left = [c for c, s in status.items() if "Queued" in s or "Running" in s]
            if not left:
                return status
            if time.monotonic() > deadline:
                raise RuntimeError(f"queues still running after {deadline_s:.0f}s: {status}")
            time.sleep(5)
    finally:
        for c in clones:
            subprocess.run(["dvc", "queue", "stop", "--kill"], cwd=c, env=env, capture_output=True, timeout=120)


def check_store(uri: str, seeds: list[int]) -> list[tuple[str, bool]]:
    """What the store holds of the sweeps, as (check, holds)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("fedccrl-synthetic")
    runs = client.search_runs([exp.experiment_id]) if exp else []
    parents = [r for r in runs if r.data.tags.get("fedccrl.role") == "parent"]
    children = [r for r in runs if r.data.tags.get("fedccrl.role") == "child"]
    out = [
        (
            f"{len(parents)} parent runs, one per sweep ({len(LRS)} expected: the seeds of a sweep share it)",
            sorted(r.data.params.get("train.lr", "") for r in parents) == sorted(map(str, LRS)),
        ),
        (
            f"{len(children)} child runs, one per training ({len(seeds)} expected), all FINISHED",
            len(children) == len(seeds) and all(c.info.status == "FINISHED" for c in children),
        ),
    ]
    rounds_ok = True
    for c in children:
        steps = [m.step for m in client.get_metric_history(c.info.run_id, "target_acc")]
        rounds_ok &= sorted(steps) == list(range(1, ROUNDS + 1))
    out.append((f"every round of every child run exactly once (rounds 1..{ROUNDS})", rounds_ok and bool(children)))
    name = f"fedccrl-synthetic-{ALGORITHM}"
    versions = client.search_model_versions(f"name = '{name}'")
    seed_of_run = {c.info.run_id: c.data.params.get("train.seed") for c in children}
    out.append(
        (
            f"{len(versions)} registry versions of {name}, unique, one per trained model",
            len({v.version for v in versions}) == len(versions) == len(seeds),
        )
    )
    aliases_ok = True
    for s in seeds:
        try:
            v = client.get_model_version_by_alias(name, f"s{s}-heldout-{HELD_OUT}")
            aliases_ok &= seed_of_run.get(v.run_id) == str(s)
        except Exception:  # a missing alias is a failed check, reported as such
            aliases_ok = False
    out.append((f"each alias s<seed>-heldout-{HELD_OUT} points to the version its seed trained", aliases_ok))
    return out


def share_and_serve(first: Path, second: Path, exp_name: str, seed: int, env: dict) -> list[tuple[str, bool]]:
    """The first clone pushes its experiment (its git refs to origin, its outputs to the DVC remote); the second
    pulls the experiment's refs, checks it out as a branch, gets its data, models and exports with `dvc pull` and
    serves its ONNX model, with nothing left to rerun up to the export."""
    sh(["dvc", "exp", "push", "origin", exp_name], first, env)
    sh(["dvc", "exp", "pull", "--no-cache", "origin", exp_name], second, env)  # the git side only: dvc pull below
    listed = exp_name in sh(["dvc", "exp", "list", "--name-only"], second, env)
    sh(["dvc", "exp", "branch", exp_name, f"from-{exp_name}"], second, env)
    sh(["git", "checkout", "-q", f"from-{exp_name}"], second, env)
    sh(["dvc", "pull", "--with-deps", "export"], second, env)
    stale = sh(["dvc", "status", "--with-deps", "export"], second, env)
    model = second / "exports" / ALGORITHM / f"s{seed}" / f"d{HELD_OUT}" / "model.onnx"
    preds = second / "preds.jsonl"
    served = False
    if model.is_file():
        sh(["fedccrl-serve", "predict", str(model), "data/raw/sketch", "--output", str(preds)], second, env)
        served = preds.is_file() and len(preds.read_text().splitlines()) > 0
    return [
        (f"the second clone pulled experiment {exp_name} (dvc exp pull, then dvc pull)", listed),
        ("nothing to rerun up to the export there (dvc status --with-deps export)", "changed" not in stale),
        (f"it served the pulled model on the held-out images ({model.relative_to(second)})", served),
    ]


def run(uri: str, work: Path, per_clone: int, jobs: int = 2, deadline_s: float = 1500) -> dict:
    env = env_for(uri)
    origin, _ = make_origin(work, env)
    clones = {}
    for i, name in enumerate(("alice", "bob")):
        clone = work / name
        sh(["git", "clone", "-q", str(origin), str(clone)], work, env)
        clones[str(clone)] = list(range(i * per_clone, (i + 1) * per_clone))
    seeds = [s for ss in clones.values() for s in ss]
    t0 = time.perf_counter()
    status = queue_sweeps(clones, env, jobs, deadline_s)
    wall = time.perf_counter() - t0
    succeeded = sum(s.count("Success") for s in status.values())
    checks = [(f"{succeeded} of {len(seeds)} queued experiments succeeded", succeeded == len(seeds))]
    checks += check_store(uri, seeds)
    alice, bob = map(Path, clones)
    if succeeded == len(seeds):
        checks += share_and_serve(alice, bob, f"alice-s{clones[str(alice)][0]}", clones[str(alice)][0], env)
    return {
        "tracking_uri": uri,
        "experiments": len(seeds),
        "jobs": jobs,
        "wall_s": wall,
        "queue_status": status,
        "checks": [{"check": c, "holds": bool(h)} for c, h in checks],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tracking-uri", required=True, help="the one MLflow store both clones log to")
    ap.add_argument("--work", type=Path, default=None, help="folder for the repositories (default: a temporary one)")
    ap.add_argument("--per-clone", type=int, default=2, help="experiments each clone queues")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="fedccrl-team-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = run(args.tracking_uri, work.resolve(), args.per_clone)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    for c in result["checks"]:
        print(f"{'ok  ' if c['holds'] else 'FAIL'} {c['check']}")
    print(
        f"{result['experiments']} experiments from 2 clones, -j {result['jobs']} each, against "
        f"{result['tracking_uri']}: {result['wall_s']:.0f}s"
    )
    if args.json:
        write_json(args.json, result)
    return 0 if all(c["holds"] for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
