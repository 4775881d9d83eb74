"""A team's MLflow tracking server on this machine's loopback: `make tracking-server` (start), `make
tracking-server-stop`, `make tracking-server-status`.

Two real services, their files in one folder of the workspace (--dir, default .tracking/, git- and DVC-ignored):
- PostgreSQL from Debian's `postgresql` package: a cluster made by `initdb` in <dir>/postgres and run by `pg_ctl`,
  listening on 127.0.0.1 only, one role `mlflow` with a password generated here (<dir>/postgres-password, mode 600)
  and a database `mlflow`;
- `mlflow server` with that database as its backend store and `--serve-artifacts` to <dir>/artifacts (clients
  send and fetch artifacts through the server: they need no access to its disk).

`start` prints the MLFLOW_TRACKING_URI to export. Every command is idempotent: `start` with both running only
prints the URI; `stop` with nothing running says so. PostgreSQL refuses to run as root: as root, its commands run
as the `postgres` user that Debian's package creates, and the cluster folder belongs to it.

Usage: python scripts/tracking_server.py {start,stop,status} [--dir DIR] [--pg-port N] [--port N]
(ports also from FEDCCRL_PG_PORT and FEDCCRL_MLFLOW_PORT; defaults 5433 and 5001).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from fedccrl_core.foundation.fsio import write_text

HOST = "127.0.0.1"
ROLE = DATABASE = "mlflow"


def say(msg: str) -> None:
    print(f"tracking-server: {msg}", file=sys.stderr, flush=True)


class Paths:
    def __init__(self, root: Path):
        self.root = root.resolve()
        self.cluster, self.socket = self.root / "postgres", self.root / "postgres-socket"
        self.password, self.pg_log = self.root / "postgres-password", self.root / "postgres.log"
        self.artifacts, self.mlflow_log, self.pid = (
            self.root / "artifacts",
            self.root / "mlflow.log",
            self.root / "mlflow.pid",
        )
        self.port_file = self.root / "ports"


def pg_bin(name: str) -> str:
    """A PostgreSQL server program: on PATH, else the newest /usr/lib/postgresql/<version>/bin (Debian's layout)."""
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0
    )
    for d in reversed(versions):
        if (d / name).is_file():
            return str(d / name)
    raise SystemExit(f"tracking-server: {name} not found: install PostgreSQL (Debian: apt-get install postgresql)")


def as_postgres(cmd: list[str]) -> list[str]:
    """PostgreSQL's programs refuse root: run them as the `postgres` user then."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def pg_run(cmd: list[str], what: str) -> None:
    """A PostgreSQL program; its own message when it fails, as one line naming what it was doing."""
    p = subprocess.run(as_postgres(cmd), capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        said = " ".join((p.stderr or p.stdout).split())[-800:]
        raise SystemExit(f"tracking-server: {what} failed: {said}")


def check_reachable(path: Path) -> None:
    """As root, PostgreSQL runs as the `postgres` user, which must reach the folder (every parent traversable)."""
    if os.geteuid() == 0 and subprocess.run(as_postgres(["test", "-w", str(path)]), timeout=60).returncode != 0:
        raise SystemExit(
            f"tracking-server: the postgres user cannot write {path} (PostgreSQL refuses to run as root "
            "and runs as postgres): choose a --dir whose parent folders every user may enter"
        )


def own(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


def backend_uri(p: Paths, pg_port: int) -> str:
    return f"postgresql+psycopg://{ROLE}:{p.password.read_text().strip()}@{HOST}:{pg_port}/{DATABASE}"


def pg_running(p: Paths) -> bool:
    if not (p.cluster / "PG_VERSION").is_file():
        return False
    return (
        subprocess.run(
            as_postgres([pg_bin("pg_ctl"), "status", "-D", str(p.cluster)]), capture_output=True, timeout=60
        ).returncode
        == 0
    )


def start_postgres(p: Paths, pg_port: int) -> None:
    if not (p.cluster / "PG_VERSION").is_file():
        say(f"initdb {p.cluster}")
        p.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(p.cluster, ignore_errors=True)  # a half-made cluster of an interrupted first start
        p.cluster.mkdir(mode=0o700)
        own(p.cluster)
        if p.password.is_symlink() or (p.password.exists() and not p.password.is_file()):
            raise SystemExit(f"tracking-server: {p.password} is not a plain file; remove it first")
        p.password.unlink(missing_ok=True)  # a half-made cluster's; created anew, mode 600 from the start
        fd = os.open(p.password, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")
        pwfile = p.root / f".pwfile-{os.getpid()}"  # initdb reads it as the postgres user; removed at once
        try:
            fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(p.password.read_text())
            own(pwfile)
            check_reachable(p.cluster)
            pg_run(
                [
                    pg_bin("initdb"),
                    "-D",
                    str(p.cluster),
                    "-U",
                    ROLE,
                    f"--pwfile={pwfile}",
                    "--auth=scram-sha-256",
                    "-E",
                    "UTF8",
                    "--no-instructions",
                ],
                f"initdb {p.cluster}",
            )
        finally:
            pwfile.unlink(missing_ok=True)
    if pg_running(p):
        return
    p.socket.mkdir(exist_ok=True)
    own(p.socket)
    if not p.pg_log.exists():
        p.pg_log.touch()
        own(p.pg_log)
    say(f"PostgreSQL on {HOST}:{pg_port}")
    pg_run(
        [
            pg_bin("pg_ctl"),
            "start",
            "-D",
            str(p.cluster),
            "-l",
            str(p.pg_log),
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {pg_port} -k {p.socket} -c listen_addresses={HOST}",
        ],
        f"PostgreSQL on {HOST}:{pg_port} (its log: {p.pg_log})",
    )
    import psycopg

    password = p.password.read_text().strip()
    with psycopg.connect(
        host=HOST, port=pg_port, user=ROLE, password=password, dbname="postgres", autocommit=True
    ) as con:
        if con.execute("select 1 from pg_database where datname = %s", (DATABASE,)).fetchone() is None:
            con.execute(f'create database "{DATABASE}"')


def mlflow_pid(p: Paths) -> int | None:
    """The server's process id, when it runs (its process group leader, started by this script)."""
    try:
        pid = int(p.pid.read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start_mlflow(p: Paths, pg_port: int, port: int, wait_s: float = 180) -> None:
    if mlflow_pid(p) is not None and healthy(port):
        return
    p.artifacts.mkdir(parents=True, exist_ok=True)
    say(f"mlflow server on {HOST}:{port} (backend PostgreSQL {HOST}:{pg_port}/{DATABASE}, artifacts {p.artifacts})")
    env = {**os.environ, "MLFLOW_BACKEND_STORE_URI": backend_uri(p, pg_port)}  # not on its command line
    env.pop("MLFLOW_TRACKING_URI", None)
    with open(p.mlflow_log, "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--serve-artifacts",
                "--artifacts-destination",
                str(p.artifacts),
                "--host",
                HOST,
                "--port",
                str(port),
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # a service: it outlives this command, `stop` ends it
    write_text(p.pid, f"{proc.pid}\n")
    deadline = time.monotonic() + wait_s  # the first start creates MLflow's tables
    while not healthy(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_mlflow(p)
            raise SystemExit(
                f"tracking-server: mlflow server did not come up on {HOST}:{port}; its log: {p.mlflow_log}"
            )
        time.sleep(0.5)


def stop_mlflow(p: Paths) -> bool:
    pid = mlflow_pid(p)
    if pid is None:
        p.pid.unlink(missing_ok=True)
        return False
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):  # the server and its workers: one group
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            continue
        break
    p.pid.unlink(missing_ok=True)
    return True


def ports(args, p: Paths) -> tuple[int, int]:
    """--pg-port/--port, else the ports of the last start (so stop and status need none), else the defaults."""
    saved = p.port_file.read_text().split() if p.port_file.is_file() else []
    pg = args.pg_port or int(os.environ.get("FEDCCRL_PG_PORT") or (saved[0] if saved else 5433))
    web = args.port or int(os.environ.get("FEDCCRL_MLFLOW_PORT") or (saved[1] if len(saved) > 1 else 5001))
    return pg, web


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("start", "stop", "status"))
    ap.add_argument("--dir", type=Path, default=Path(".tracking"), help="the services' files (default .tracking)")
    ap.add_argument("--pg-port", type=int, default=None)
    ap.add_argument("--port", type=int, default=None, help="the MLflow server's port")
    args = ap.parse_args(argv)
    p = Paths(args.dir)
    pg_port, port = ports(args, p)
    uri = f"http://{HOST}:{port}"
    if args.action == "start":
        start_postgres(p, pg_port)
        start_mlflow(p, pg_port, port)
        write_text(p.port_file, f"{pg_port} {port}\n")
        say("running; in each shell that logs to it:")
        print(f"export MLFLOW_TRACKING_URI={uri}")
    elif args.action == "stop":
        stopped = stop_mlflow(p)
        pg = pg_running(p)
        if pg:
            pg_run([pg_bin("pg_ctl"), "stop", "-D", str(p.cluster), "-m", "fast", "-w"], "stopping PostgreSQL")
        say(
            f"mlflow server {'stopped' if stopped else 'was not running'}; "
            f"PostgreSQL {'stopped' if pg else 'was not running'}"
        )
    else:
        up_pg, up_web = pg_running(p), mlflow_pid(p) is not None and healthy(port)
        print(f"PostgreSQL {HOST}:{pg_port}: {'running' if up_pg else 'stopped'}")
        print(f"mlflow server {uri}: {'running' if up_web else 'stopped'}")
        if up_pg and up_web:
            print(f"export MLFLOW_TRACKING_URI={uri}")
        return 0 if up_pg and up_web else 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
