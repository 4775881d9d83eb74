"""A team's setup (docs/team.md): a real PostgreSQL and `mlflow server` on loopback (scripts/tracking_server.py),
two clones running queued sweeps against it at once with a DVC remote between them (scripts/team_sweeps.py), and
the tracking server and its database killed and restarted under a training run."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from fedccrl_benchmarks.accuracy import apply_overrides
from fedccrl_flower.processes import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _script(name: str):
    """scripts/<name>.py loaded by its path: the team's tooling is not part of the installed packages."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


team_sweeps = _script("team_sweeps")
tracking_server = _script("tracking_server")

pytestmark = pytest.mark.skipif(
    not (tracking_server.shutil.which("initdb") or list(Path("/usr/lib/postgresql").glob("*/bin/initdb"))),
    reason="PostgreSQL is not installed (.ci/run installs it)",
)


def service_dir(tmp: Path) -> Path:
    """A folder the `postgres` user can reach (pytest's base folder is private to its user, mode 700)."""
    d = Path(tempfile.mkdtemp(prefix=f"fedccrl-tracking-{tmp.name}-"))
    d.chmod(0o755)
    return d


class Server:
    def __init__(self, root: Path):
        self.dir, self.pg_port, self.port = root, free_port(), free_port()
        self.uri = f"http://127.0.0.1:{self.port}"

    def ctl(self, action: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                str(REPO / "scripts" / "tracking_server.py"),
                action,
                "--dir",
                str(self.dir),
                "--pg-port",
                str(self.pg_port),
                "--port",
                str(self.port),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )

    def kill_mlflow(self) -> None:
        os.killpg(int((self.dir / "mlflow.pid").read_text()), signal.SIGKILL)

    def kill_postgres(self) -> None:
        p = tracking_server.Paths(self.dir)
        subprocess.run(
            tracking_server.as_postgres(
                [tracking_server.pg_bin("pg_ctl"), "stop", "-D", str(p.cluster), "-m", "immediate"]
            ),
            check=True,
            capture_output=True,
            timeout=60,
        )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(service_dir(tmp_path_factory.getbasetemp()))
    try:
        p = srv.ctl("start")
        assert p.returncode == 0 and p.stdout.strip() == f"export MLFLOW_TRACKING_URI={srv.uri}", p.stderr[-3000:]
        yield srv
    finally:
        srv.ctl("stop")
        shutil.rmtree(srv.dir, ignore_errors=True)


@pytest.mark.full("PostgreSQL and an MLflow server on loopback")
@pytest.mark.timeout(600)
def test_the_tracking_server_commands(server, tmp_path):
    status = server.ctl("status")
    assert status.returncode == 0 and f"mlflow server {server.uri}: running" in status.stdout, status.stdout
    again = server.ctl("start")  # idempotent: both run, the URI again
    assert again.returncode == 0 and again.stdout.strip() == f"export MLFLOW_TRACKING_URI={server.uri}"
    assert oct((server.dir / "postgres-password").stat().st_mode)[-3:] == "600"
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    password = (server.dir / "postgres-password").read_text().strip()
    assert password not in ps  # the backend URI reaches the server through its environment
    private = tmp_path / "private"  # pytest's folders are mode 700: the postgres user cannot reach them
    p = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "tracking_server.py"),
            "start",
            "--dir",
            str(private),
            "--pg-port",
            str(free_port()),
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if os.geteuid() == 0:
        assert p.returncode == 1 and "the postgres user cannot write" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.full("two clones, four queued experiments against one MLflow server, a DVC remote between them")
@pytest.mark.timeout(2400)
def test_two_people_run_queued_sweeps_at_once_against_one_server(server, tmp_path):
    result = team_sweeps.run(server.uri, tmp_path, per_clone=2)
    failed = [c["check"] for c in result["checks"] if not c["holds"]]
    assert not failed, json.dumps(result, indent=1)[-6000:]


def _workspace(root: Path, uri: str, rounds: int, local_epochs: int = 1) -> tuple[Path, dict]:
    """Shards and pools of the tiny synthetic setting, ready for `fedccrl train`."""
    env = {
        **team_sweeps.env_for(uri),
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "6",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    }
    params = apply_overrides(
        yaml.safe_load((REPO / "params.yaml").read_text()),
        [
            *team_sweeps.TINY,
            f"train.rounds={rounds}",
            f"train.local_epochs={local_epochs}",
            "train.algorithms=[fedavg]",
        ],
    )
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for args in (
        ["download", "--out", "data/raw", "--report", "data/download.json"],
        ["partition", "--raw", "data/raw", "--out", "data/shards"],
        ["pools", "--shards", "data/shards", "--out", "data/pools"],
    ):
        team_sweeps.sh(["fedccrl", *args], root, env)
    return root, env


TRAIN = [
    "fedccrl",
    "train",
    "--shards",
    "data/shards",
    "--pools",
    "data/pools",
    "--algorithm",
    "fedavg",
    "--seed",
    "0",
    "--out",
    "models",
    "--checkpoints",
    "ck",
]


def _child_rounds(uri: str) -> dict[str, list[int]]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("fedccrl-synthetic")
    if exp is None:
        return {}
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`fedccrl.role` = 'child'")
    return {r.info.run_id: sorted(m.step for m in client.get_metric_history(r.info.run_id, "target_acc")) for r in runs}


def _wait_for_round(uri: str, rnd: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "training ended before the fault"
        try:
            if any(len(steps) >= rnd for steps in _child_rounds(uri).values()):
                return
        except Exception:  # the server is starting up
            pass
        time.sleep(0.5)
    raise AssertionError(f"round {rnd} never reached {uri}")


@pytest.mark.full("a training run while its tracking server and database are killed and restarted")
@pytest.mark.timeout(1200)
def test_the_server_and_its_database_restart_under_a_run_and_no_round_is_lost_or_doubled(tmp_path):
    srv = Server(service_dir(tmp_path))
    try:
        assert srv.ctl("start").returncode == 0
        # rounds of seconds, not a tenth of one: each fault below lands while the run is still training
        ws, env = _workspace(tmp_path, srv.uri, rounds=6, local_epochs=30)
        log = open(tmp_path / "train.log", "w")
        proc = subprocess.Popen(TRAIN, cwd=ws, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            _wait_for_round(srv.uri, 1, proc)
            srv.kill_mlflow()  # kill -9 of the tracking server ...
            time.sleep(3)
            assert srv.ctl("start").returncode == 0  # ... and back: the run waits in MLflow's retries
            _wait_for_round(srv.uri, 3, proc)
            srv.kill_postgres()  # its database stopped at once (no shutdown checkpoint) ...
            time.sleep(3)
            assert srv.ctl("start").returncode == 0  # ... and back
            assert proc.wait(timeout=900) == 0, (tmp_path / "train.log").read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
        (steps,) = _child_rounds(srv.uri).values()
        assert steps == [1, 2, 3, 4, 5, 6]  # every round once

        # unreachable for longer than the retries: one clear line naming the server, then a rerun resumes
        params = yaml.safe_load((ws / "params.yaml").read_text())
        params["train"]["rounds"] = 4
        (ws / "p2.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        fail_env = {**env, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"}
        train2 = [*TRAIN[:-4], "--out", "models2", "--checkpoints", "ck2", "--params", "p2.yaml"]
        proc = subprocess.Popen(
            train2, cwd=ws, env=fail_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 300  # round 1 of the second child run in the server
        while len(_child_rounds(srv.uri)) < 2 or min(map(len, _child_rounds(srv.uri).values())) < 1:
            assert proc.poll() is None and time.monotonic() < deadline, "the second run never logged round 1"
            time.sleep(0.1)
        srv.kill_mlflow()
        _, err = proc.communicate(timeout=600)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and srv.uri in errors[0], err[-4000:]
        assert srv.ctl("start").returncode == 0
        p = subprocess.run(train2, cwd=ws, env=env, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-4000:]
        rounds = _child_rounds(srv.uri)
        assert len(rounds) == 2 and sorted(map(tuple, rounds.values())) == [(1, 2, 3, 4), (1, 2, 3, 4, 5, 6)]
    finally:
        srv.ctl("stop")
        shutil.rmtree(srv.dir, ignore_errors=True)
