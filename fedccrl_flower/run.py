"""Launch the Flower engine from Python (pipeline/train.py with `train.engine: flower`, and the tests).

Two modes, one ServerApp/ClientApp (fedccrl_flower/app/pyproject.toml, package data, describes the
app; its FAB holds only that file, the code comes from the installed fedccrl_core / fedccrl_flower
packages, the data from each SuperNode's own folders):

- simulation: a SuperLink started with `--simulation`, then `flwr run <APP_DIR> <connection>
  --federation-config "num-supernodes=N ..."`; Flower's Ray backend runs the ClientApps, node k
  gets partition-id=k (-> the k-th source client of the manifest).
- deployment: a SuperLink and one SuperNode per source client as separate processes (`--insecure`
  on 127.0.0.1; node config client-id/shards/pools/state-dir), then `flwr run`. With
  `superlink: host:port` the launcher starts nothing and submits to that SuperLink (TLS with
  `root_certificates`); the ServerApp then runs on the SuperLink's host and writes its work folder
  there, so the launcher must share that filesystem (run the train stage on the SuperLink host).

The ServerApp reports through <work_dir>/run-<run id>/: rounds.jsonl (each record is passed to
`on_round` as it appears, e.g. ChildRun.log_round), status.json, result.pt (-> RunResult). Every
process the launcher starts runs in its own process group and is killed (with its descendants) on
exit.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from fedccrl_core import contract
from fedccrl_core.checkpoint import torch_load
from fedccrl_core.errors import FedCCRLError
from fedccrl_core.federation.engine import RunResult
from fedccrl_core.fsio import write_text
from fedccrl_core.procs import die_with_parent
from fedccrl_flower import messages as M
from fedccrl_flower.server_app import ServerSpec, report_dir
from fedccrl_flower.settings import FlowerSettings

APP_DIR = Path(__file__).resolve().parent / "app"  # the Flower App's pyproject.toml, installed with the package
BIN = Path(sys.executable).parent
CONNECTION = "fedccrl"
LOG = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731


class FlowerRunError(FedCCRLError, RuntimeError):
    """The Flower run failed; the message carries the ServerApp's reason (one line in `fedccrl train`)."""


# ---- processes ------------------------------------------------------------------------------------
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

    def __init__(self, name: str, args: list[str], env: dict, log_path: Path, cwd: Path | None = None):
        self.name, self.args, self.log_path = name, args, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self.popen = subprocess.Popen(args, env=env, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True,
                                      preexec_fn=die_with_parent)  # fedccrl_core/procs.py: dies with the launcher
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def _descendants(self) -> list[int]:
        try:
            import psutil

            return [c.pid for c in psutil.Process(self.pid).children(recursive=True)]
        except Exception:  # psutil missing or the process is gone
            return []

    def stop(self, sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
        """Signal the process group and every descendant (Flower detaches some: SuperExec), then
        SIGKILL whatever is left after `grace` seconds."""
        pids = [self.pid] + self._descendants()
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in pids[1:]:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.1)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def kill(self) -> None:
        """Abrupt death (SIGKILL, no deactivation at the SuperLink): the fault tests' 'killed SuperNode'."""
        self.stop(signal.SIGKILL, grace=0.0)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _wait_http(url: str, proc: Proc, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise FlowerRunError(f"{proc.name} exited with code {proc.popen.returncode}:\n{proc.tail()}")
        try:
            if httpx.get(url, timeout=0.5).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise FlowerRunError(f"{proc.name} did not come up within {timeout:.0f}s:\n{proc.tail()}")


class Federation:
    """A SuperLink connection for the `flwr` CLI (FLWR_HOME/config.toml), and run submission/status."""

    def __init__(self, workdir: Path, address: str, root_certificates: str = "", log=LOG):
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.address, self.log = address, log
        self.flwr_home = self.workdir / "flwr-home"
        self.flwr_home.mkdir(exist_ok=True)
        self.env = flower_env(self.flwr_home)
        conn = {"address": address}
        conn.update({"root-certificates": str(Path(root_certificates).resolve())} if root_certificates
                    else {"insecure": True})
        import tomli_w

        write_text(self.flwr_home / "config.toml", tomli_w.dumps({"superlink": {"default": CONNECTION,
                                                                               CONNECTION: conn}}))

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "flwr"), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=self.workdir)

    def submit(self, spec: ServerSpec, run_config: dict | None = None, federation_config: str = "",
               app_dir: Path = APP_DIR) -> int:
        """`flwr run <app_dir> <connection> --run-config <toml>`: the spec travels in the run config."""
        import tomli_w

        cfg = {M.RUN_SPEC: json.dumps(asdict(spec)), **(run_config or {})}
        Path(spec.work_dir).mkdir(parents=True, exist_ok=True)
        path = write_text(Path(spec.work_dir) / "run_config.toml", tomli_w.dumps(cfg))
        args = ["run", str(app_dir), CONNECTION, "--run-config", str(path), "--format", "json"]
        if federation_config:
            args += ["--federation-config", federation_config]
        p = self.flwr(*args)
        try:
            out = json.loads(p.stdout[p.stdout.index("{"):])
        except ValueError:
            out = {}
        if p.returncode != 0 or not out.get("success"):
            raise FlowerRunError(f"flwr run failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        return int(out["run-id"])

    def status(self, run_id: int) -> dict:
        p = self.flwr("ls", CONNECTION, "--run-id", str(run_id), "--format", "json", timeout=60)
        try:
            runs = json.loads(p.stdout[p.stdout.index("{"):]).get("runs") or []
        except ValueError:
            return {}
        return runs[0] if runs else {}

    def stop_run(self, run_id: int) -> None:
        self.flwr("stop", str(run_id), CONNECTION, timeout=60)

    def server_log(self, run_id: int) -> str:
        p = self.flwr("log", str(run_id), CONNECTION, "--show", timeout=60)
        return p.stdout[-6000:]

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class LocalFederation(Federation):
    """A SuperLink on 127.0.0.1 (and, in deployment, SuperNodes) as child processes, `--insecure`."""

    def __init__(self, workdir: Path, simulation: bool = False, log=LOG, startup_s: float = 60.0):
        self.port = free_port()
        super().__init__(workdir, f"127.0.0.1:{self.port}", log=log)
        self.simulation, self.startup_s = simulation, startup_s
        self.supernodes: dict[str, Proc] = {}
        self.superlink: Proc | None = None
        self._restarts: dict[str, int] = {}
        try:
            args = [str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(self.port),
                    "--disable-runtime-dependency-installation"]
            if simulation:
                args.append("--simulation")
            self.superlink = Proc("superlink", args, self.env, self.workdir / "logs" / "superlink.log")
            _wait_http(f"http://127.0.0.1:{self.port}/health", self.superlink, startup_s)
            self.log(f"flower: SuperLink on 127.0.0.1:{self.port} ({'simulation' if simulation else 'deployment'})")
        except BaseException:
            self.close()
            raise

    def add_supernode(self, name: str, node_config: dict, threads: int = 0, wait: bool = True,
                      bin_dir: Path | None = None, cwd: Path | None = None) -> Proc:
        """One SuperNode (`--insecure`, node config e.g. client-id/shards/pools/state-dir); `threads`
        sets OMP_NUM_THREADS (torch's intra-op threads) for its ClientApps (0: torch's default);
        `wait=False` returns at once (then call `wait_supernodes`). `bin_dir`: the bin folder of
        another Python environment where fedccrl is installed (e.g. from its wheel): the SuperNode and
        its ClientApps run from there, with no PYTHONPATH, in `cwd`."""
        if self.simulation:
            raise ValueError("a simulation SuperLink runs its own simulated SuperNodes")
        port = free_port()
        cfg = " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in node_config.items())
        args = [str((bin_dir or BIN) / "flower-supernode"), "--insecure", "--superlink", self.address, "--port",
                str(port), "--node-config", cfg]
        k = self._restarts[name] = self._restarts.get(name, -1) + 1
        env = {**self.env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else self.env
        if bin_dir is not None:
            env = {key: v for key, v in env.items() if key != "PYTHONPATH"}
            env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"  # flwr-clientapp of that environment
        proc = Proc(f"supernode {name}", args, env, self.workdir / "logs" / f"supernode-{name}-{k}.log", cwd=cwd)
        proc.health_url = f"http://127.0.0.1:{port}/health"
        self.supernodes[name] = proc
        if wait:
            _wait_http(proc.health_url, proc, self.startup_s)
        return proc

    def wait_supernodes(self) -> None:
        for proc in self.supernodes.values():
            _wait_http(proc.health_url, proc, self.startup_s)

    def check_alive(self) -> None:
        if self.superlink is not None and not self.superlink.alive():
            raise FlowerRunError(f"the SuperLink exited ({self.superlink.popen.returncode}):\n{self.superlink.tail()}")

    def close(self) -> None:
        for proc in list(self.supernodes.values()):
            proc.stop()
        self.supernodes.clear()
        if self.superlink is not None:
            self.superlink.stop()
            self.superlink = None


# ---- run and wait --------------------------------------------------------------------------------
def wait_for_result(fed: Federation, run_id: int, work_dir: Path, on_round: Callable[[dict], None] | None = None,
                    timeout: float = 0.0, poll_s: float = 0.5, status_every_s: float = 15.0) -> RunResult:
    """Follow the run's rounds.jsonl (calling on_round per record) until the ServerApp reports completion."""
    on_round = on_round or (lambda rec: None)
    work_dir = report_dir(work_dir, run_id)
    seen, t0, next_status = 0, time.monotonic(), time.monotonic() + status_every_s

    def drain():
        nonlocal seen
        path = work_dir / contract.FLOWER_ROUNDS_FILE
        if not path.is_file():
            return
        lines = path.read_text().splitlines()
        complete = lines if path.read_text().endswith("\n") else lines[:-1]
        for line in complete[seen:]:
            on_round(json.loads(line))
        seen = len(complete)

    while True:
        drain()
        st_path = work_dir / contract.FLOWER_STATUS_FILE
        st = json.loads(st_path.read_text()) if st_path.is_file() else {}
        if st.get("status") == "completed":
            drain()
            res = torch_load(work_dir / contract.FLOWER_RESULT_FILE)
            return RunResult(res["history"], res["final_weights"], res["best_weights"], res["best_round"],
                             resumed_from=res["resumed_from"], extra={**res["extra"], "run_id": run_id})
        if st.get("status") in ("failed", "stopped"):
            raise FlowerRunError(f"Flower run {run_id} {st['status']}: {st.get('error')}")
        if isinstance(fed, LocalFederation):
            fed.check_alive()
        now = time.monotonic()
        if now >= next_status:
            next_status = now + status_every_s
            flwr_status = fed.status(run_id).get("status", "")
            if flwr_status.startswith("finished"):
                time.sleep(2.0)  # the ServerApp may be writing its status right now
                st = json.loads(st_path.read_text()) if st_path.is_file() else {}
                if st.get("status") not in ("completed", "failed", "stopped"):
                    raise FlowerRunError(f"Flower run {run_id} ended as {flwr_status} without a result; "
                                         f"ServerApp log:\n{fed.server_log(run_id)}")
        if timeout and now - t0 > timeout:
            fed.stop_run(run_id)
            raise FlowerRunError(f"Flower run {run_id} did not finish within {timeout:.0f}s")
        time.sleep(poll_s)


def source_clients(shards: str | Path, held_out: str) -> list[str]:
    from fedccrl_core.data.shards import client_ids, load_manifest

    return client_ids(load_manifest(shards), held_out)


def run_flower(settings: FlowerSettings, spec: ServerSpec, pools: str | Path, on_round=None,
               log=LOG) -> RunResult:
    """Run one training on the Flower engine (settings.mode) and return the in-process engine's RunResult."""
    work = Path(spec.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ids = source_clients(spec.shards, spec.held_out)
    settings.model_copy(update={"min_clients": max(settings.min_clients, spec.min_clients)}).require_clients(
        len(ids), spec.held_out)
    spec.num_clients = spec.num_clients or settings.num_clients or len(ids)
    shards, pools = str(Path(spec.shards).resolve()), str(Path(pools).resolve())
    state_dir = str(work / "client-state")
    if settings.mode == "simulation":
        fed_cfg = (f"num-supernodes={len(ids)} client-resources-num-cpus={int(settings.client_cpus)} "
                   f"client-resources-num-gpus={float(settings.client_gpus)}")
        if settings.ray_cpus:
            fed_cfg += f" init-args-num-cpus={settings.ray_cpus}"
        with LocalFederation(work / "federation", simulation=True, log=log) as fed:
            run_id = fed.submit(spec, {M.RUN_SHARDS: shards, M.RUN_POOLS: pools, M.RUN_STATE_DIR: state_dir}, fed_cfg)
            log(f"flower simulation: run {run_id}, {len(ids)} simulated SuperNodes")
            return wait_for_result(fed, run_id, work, on_round, settings.run_timeout_s)
    if settings.superlink:
        with Federation(work / "federation", settings.superlink, settings.root_certificates, log=log) as fed:
            run_id = fed.submit(spec)
            log(f"flower deployment: run {run_id} on SuperLink {settings.superlink}")
            return wait_for_result(fed, run_id, work, on_round, settings.run_timeout_s)
    threads = settings.client_threads or max(1, (os.cpu_count() or 1) // len(ids))
    with LocalFederation(work / "federation", log=log) as fed:
        for cid in ids:
            fed.add_supernode(cid, {M.NODE_CLIENT_ID: cid, M.NODE_SHARDS: shards, M.NODE_POOLS: pools,
                                    M.NODE_STATE_DIR: state_dir}, threads, wait=False)
        fed.wait_supernodes()
        run_id = fed.submit(spec)
        log(f"flower deployment: run {run_id}, SuperLink + {len(ids)} SuperNodes on 127.0.0.1")
        return wait_for_result(fed, run_id, work, on_round, settings.run_timeout_s)


def train_with_flower(flower_params: dict | None, *, algorithm: str, local, hparams: dict, backbone: str,
                      pretrained: str, num_classes: int, seed: int, held_out: str, shards: str | Path,
                      pools: str | Path, device: str, eval_batch_size: int, client_fraction: float,
                      checkpoint: str | Path, run_info: dict, on_round=None, log=LOG,
                      client_state: str = "persistent") -> RunResult:
    """pipeline/train.py's `train.engine: flower` branch: params.yaml `train.flower` + the run -> RunResult.
    The ServerApp checkpoints where the in-process engine would (`checkpoint`), its work folder sits
    beside it (<checkpoint>.flower/)."""
    settings = FlowerSettings.from_mapping(flower_params)
    checkpoint = Path(checkpoint).resolve()
    spec = ServerSpec(algorithm=algorithm, local=local.model_dump(), hparams=dict(hparams), backbone=backbone,
                      num_classes=int(num_classes), seed=int(seed), held_out=held_out,
                      shards=str(Path(shards).resolve()), work_dir=str(checkpoint.with_suffix(".flower")),
                      pretrained=pretrained, client_fraction=float(client_fraction), device=device,
                      eval_batch_size=int(eval_batch_size),
                      **settings.model_dump(include=set(ServerSpec.FROM_SETTINGS)),
                      checkpoint=str(checkpoint), run_info=dict(run_info), client_state=client_state)
    return run_flower(settings, spec, pools, on_round=on_round, log=log)


__all__ = ["APP_DIR", "Federation", "FlowerRunError", "FlowerSettings", "LocalFederation", "Proc", "ServerSpec",
           "run_flower", "source_clients", "train_with_flower", "wait_for_result"]
