"""Two queued DVC experiments run side by side (`dvc queue start -j 2`) log to the one MLflow store
the README points `mlflow ui` at (<repo>/mlflow.db): both parents, named after their experiments, their
children, and each experiment's changed params.

A scratch git repository holds the working tree's files (tracked and untracked, not ignored) at tiny settings:
one algorithm, one seed, one held-out domain, one round of one local epoch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures import write_params

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TINY = {
    "train.algorithms": ["fedccrl"],
    "train.seeds": [0],
    "train.held_out": ["sketch"],
    "train.rounds": 1,
    "train.local_epochs": 1,
    "tracking.system_metrics": False,
    "figures.tsne_points": 20,
    "figures.gradcam_images": 2,
    "figures.preview_images": 1,
}


def _env(ws: Path) -> dict:
    """No MLFLOW_TRACKING_URI: the store is the one the stages resolve from the repository (pipeline/fedccrl_pipeline/mlflow_store.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "FEDCCRL_MLFLOW_ARTIFACTS")}
    env.update(PATH=f"{BIN}:{env['PATH']}", DVC_NO_ANALYTICS="1", OMP_NUM_THREADS="1")
    return env


def _run(args, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    p = subprocess.run(args, cwd=cwd, env=_env(cwd), capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def _scratch_repo(root: Path) -> Path:
    files = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    ws = root / "repo"
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file() and not src.is_symlink():
            (ws / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, ws / rel)
    write_params(ws, TINY)  # the scratch repo's params.yaml is the checkout's, copied above
    for cmd in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tiny"],
    ):
        _run(cmd, ws)
    return ws


@pytest.mark.full("two queued experiments up to the train stages, side by side")
@pytest.mark.timeout(1800)
def test_two_queued_experiments_land_in_the_repos_mlflow_store(tmp_path):
    ws = _scratch_repo(tmp_path)
    # up to the train stages, which log to MLflow (the stages after them: tests/test_team.py, test_pipeline.py)
    _run(["dvc", "exp", "run", "--queue", "-n", "lr-a", "-S", "train.lr=0.002", "train"], ws)
    _run(["dvc", "exp", "run", "--queue", "-n", "lr-b", "-S", "train.lr=0.004", "train"], ws)
    _run(["dvc", "queue", "start", "-j", "2"], ws)
    try:
        deadline = time.monotonic() + 900
        while True:
            status = _run(["dvc", "queue", "status"], ws).stdout
            if not any(s in status for s in ("Queued", "Running")):
                break
            assert time.monotonic() < deadline, status
            time.sleep(5)
        logs = "".join(
            subprocess.run(["dvc", "queue", "logs", n], cwd=ws, env=_env(ws), capture_output=True, text=True).stdout[
                -4000:
            ]
            for n in ("lr-a", "lr-b")
            if status.count("Success") != 2
        )
        assert status.count("Success") == 2, status + logs
    finally:
        subprocess.run(["dvc", "queue", "stop", "--kill"], cwd=ws, env=_env(ws), capture_output=True, timeout=120)

    import mlflow

    assert not list((ws / ".dvc" / "tmp" / "exps").rglob("mlflow.db"))  # nothing left in a temp copy
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{ws / 'mlflow.db'}")
    exp = client.get_experiment_by_name("fedccrl-synthetic")
    runs = client.search_runs([exp.experiment_id])
    parents = {r.data.tags.get("dvc.exp_name"): r for r in runs if r.data.tags.get("fedccrl.role") == "parent"}
    assert set(parents) == {"lr-a", "lr-b"}
    for name, lr in (("lr-a", "0.002"), ("lr-b", "0.004")):
        parent = parents[name]
        assert parent.info.run_name == f"{name} train.lr={lr}"  # the experiment and its changed params
        assert parent.data.tags["dvc.exp_name"] == name and parent.data.params["train.lr"] == lr
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert [c.info.run_name for c in children] == ["fedccrl-synthetic-s0-sketch"]
        (child,) = children
        assert child.data.params["train.lr"] == lr and child.info.status == "FINISHED"
        assert child.data.tags["dvc.exp_name"] == name
        assert client.get_metric_history(child.info.run_id, "target_acc")[0].step == 1
