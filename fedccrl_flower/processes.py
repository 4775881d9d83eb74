"""The launcher's child processes (SuperLink, SuperNodes): each in its own process group, logging to a file,
watched and stopped with psutil. Stopping signals the group and every descendant (Flower detaches some, e.g.
SuperExec, into sessions of their own), waits for them with `psutil.wait_procs` and kills what is left, so no
process outlives the launcher; each child also dies with the launcher (fedccrl_core/foundation/procs.py)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import psutil

from fedccrl_core.foundation.errors import FedCCRLError
from fedccrl_core.foundation.procs import guarded

BIN = Path(sys.executable).parent


class FlowerRunError(FedCCRLError, RuntimeError):
    """The Flower run failed; the message carries the ServerApp's reason (one line in `fedccrl train`)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flower_env(flwr_home: Path, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["FLWR_HOME"] = str(flwr_home)
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    env.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
    env.setdefault("RAY_DEDUP_LOGS", "0")
    env.update(extra or {})
    return env


class Proc:
    """A child process in its own process group, logging to a file."""

    health_url: str  # a supernode's health endpoint (set by fedccrl_flower/federation.py)

    def __init__(self, name: str, args: list[str], env: dict, log_path: Path, cwd: Path | None = None):
        self.name, self.args, self.log_path = name, args, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        if shutil.which(args[0], path=env.get("PATH")) is None:  # as Popen would, before the guard's exec
            raise FileNotFoundError(f"{name}: no executable {args[0]!r}")
        self.popen = psutil.Popen(
            guarded(args),
            env=env,
            cwd=cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fedccrl_core/foundation/procs.py: dies with the launcher
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_all(self, sig: int) -> list[psutil.Process]:
        """`sig` to the process group and every descendant; returns the processes signalled."""
        procs = [self.popen]
        with suppress(psutil.Error):
            procs += self.popen.children(recursive=True)
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)
        for p in procs:
            with suppress(psutil.Error):
                p.send_signal(sig)
        return procs

    def close(self) -> None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # whatever is left in the group
        with suppress(psutil.TimeoutExpired):
            self.popen.wait(timeout=10)
        self._log.close()

    def stop(self, sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
        stop_all([self], sig, grace)

    def kill(self) -> None:
        """Abrupt death (SIGKILL, no deactivation at the SuperLink): the fault tests' 'killed SuperNode'."""
        self.stop(signal.SIGKILL, grace=0.0)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def stop_all(procs: list[Proc], sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
    """Signal every process (groups and descendants) at once, wait up to `grace` seconds for all of them
    (psutil.wait_procs), then SIGKILL the rest."""
    signalled = [p for proc in procs for p in proc.signal_all(sig)]
    _, alive = psutil.wait_procs(signalled, timeout=grace)
    for p in alive:
        with suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=10)
    for proc in procs:
        proc.close()


def wait_http(url: str, proc: Proc, timeout: float) -> None:
    """Until `url` answers 2xx (a Flower health endpoint); FlowerRunError if `proc` exits or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            proc.popen.wait(timeout=0.3)  # psutil: returns once the process has exited
            raise FlowerRunError(f"{proc.name} exited with code {proc.popen.returncode}:\n{proc.tail()}")
        except psutil.TimeoutExpired:
            pass
        with suppress(httpx.HTTPError):
            if httpx.get(url, timeout=0.5).is_success:
                return
    raise FlowerRunError(f"{proc.name} did not come up within {timeout:.0f}s:\n{proc.tail()}")
