"""A SuperLink connection for the `flwr` CLI (`Federation`: run submission, status, stop, logs), and a local
federation (`LocalFederation`: a SuperLink on 127.0.0.1 and, in deployment, SuperNodes, as child processes,
`--insecure`; processes.py stops them all when it closes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fedccrl_core.foundation.fsio import write_text
from fedccrl_core.foundation.procs import STOP_GRACE_S, guarded
from fedccrl_flower import messages as M
from fedccrl_flower.node_config import node_config_arg
from fedccrl_flower.processes import BIN, FlowerRunError, Proc, flower_env, free_port, stop_all, wait_http
from fedccrl_flower.spec import ServerSpec, SiteEvalSpec

APP_DIR = Path(__file__).resolve().parent / "app"  # the Flower App's pyproject.toml, installed with the package
CONNECTION = "fedccrl"
LOG = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731


class Federation:
    """A SuperLink connection for the `flwr` CLI (FLWR_HOME/config.toml), and run submission/status."""

    def __init__(self, workdir: Path, address: str, root_certificates: str = "", log=LOG):
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.address, self.log = address, log
        self.flwr_home = self.workdir / "flwr-home"
        self.flwr_home.mkdir(exist_ok=True)
        self.env = flower_env(self.flwr_home)
        conn: dict[str, str | bool] = {"address": address}
        conn.update(
            {"root-certificates": str(Path(root_certificates).resolve())} if root_certificates else {"insecure": True}
        )
        import tomli_w

        write_text(
            self.flwr_home / "config.toml", tomli_w.dumps({"superlink": {"default": CONNECTION, CONNECTION: conn}})
        )

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """The `flwr` CLI, run so that it ends when this process dies (fedccrl_core/foundation/procs.py `guarded`):
        a killed `fedccrl federate` leaves no `flwr run` behind. Past `timeout` seconds its guard gets SIGTERM,
        which it passes on before it ends every process left (child_guard.py), then subprocess.TimeoutExpired is
        raised: `subprocess.run`'s SIGKILL would end the guard alone and leave `flwr` running."""
        with subprocess.Popen(
            guarded([str(BIN / "flwr"), *args]),
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=self.workdir,
        ) as p:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.communicate(timeout=STOP_GRACE_S + 10)
                except subprocess.TimeoutExpired:  # a guard that does not end within its grace: killed
                    p.kill()
                    p.communicate()
                raise
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def submit(
        self,
        spec: ServerSpec | SiteEvalSpec,
        run_config: dict | None = None,
        federation_config: str = "",
        app_dir: Path = APP_DIR,
    ) -> int:
        """`flwr run <app_dir> <connection> --run-config <toml>`: the spec (a training's, or an evaluation-only run's
        with its RUN_TASK in `run_config`) travels in the run config."""
        import tomli_w

        cfg = {M.RUN_SPEC: spec.to_json(), **(run_config or {})}
        Path(spec.work_dir).mkdir(parents=True, exist_ok=True)
        path = write_text(Path(spec.work_dir) / "run_config.toml", tomli_w.dumps(cfg))
        args = ["run", str(app_dir), CONNECTION, "--run-config", str(path), "--format", "json"]
        if federation_config:
            args += ["--federation-config", federation_config]
        p = self.flwr(*args)
        try:
            out = json.loads(p.stdout[p.stdout.index("{") :])
        except ValueError:
            out = {}
        if p.returncode != 0 or not out.get("success"):
            raise FlowerRunError(f"flwr run failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        return int(out["run-id"])

    def status(self, run_id: int) -> dict:
        p = self.flwr("ls", CONNECTION, "--run-id", str(run_id), "--format", "json", timeout=60)
        try:
            runs = json.loads(p.stdout[p.stdout.index("{") :]).get("runs") or []
        except ValueError:
            return {}
        return runs[0] if runs else {}

    def stop_run(self, run_id: int) -> None:
        self.flwr("stop", str(run_id), CONNECTION, timeout=60)

    def server_log(self, run_id: int) -> str:
        p = self.flwr("log", str(run_id), CONNECTION, "--show", timeout=60)
        return p.stdout[-6000:]

    def check_alive(self) -> None:
        """Nothing to watch: the SuperLink is not this process's child."""

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
            args = [
                str(BIN / "flower-superlink"),
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
            ]
            if simulation:
                args.append("--simulation")
            self.superlink = Proc("superlink", args, self.env, self.workdir / "logs" / "superlink.log")
            wait_http(f"http://127.0.0.1:{self.port}/health", self.superlink, startup_s)
            self.log(f"flower: SuperLink on 127.0.0.1:{self.port} ({'simulation' if simulation else 'deployment'})")
        except BaseException:
            self.close()
            raise

    def add_supernode(
        self,
        name: str,
        node_config: dict,
        threads: int = 0,
        wait: bool = True,
        bin_dir: Path | None = None,
        cwd: Path | None = None,
    ) -> Proc:
        """One SuperNode (`--insecure`, node config e.g. client-id/shards/pools/state-dir); `threads`
        sets OMP_NUM_THREADS (torch's intra-op threads) for its ClientApps (0: torch's default);
        `wait=False` returns at once (then call `wait_supernodes`). `bin_dir`: the bin folder of
        another Python environment where fedccrl is installed (e.g. from its wheel): the SuperNode and
        its ClientApps run from there, with no PYTHONPATH, in `cwd`."""
        if self.simulation:
            raise ValueError("a simulation SuperLink runs its own simulated SuperNodes")
        port = free_port()
        args = [
            str((bin_dir or BIN) / "flower-supernode"),
            "--insecure",
            "--superlink",
            self.address,
            "--port",
            str(port),
            "--node-config",
            node_config_arg(node_config),
        ]
        k = self._restarts[name] = self._restarts.get(name, -1) + 1
        env = {**self.env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else self.env
        if bin_dir is not None:
            env = {key: v for key, v in env.items() if key != "PYTHONPATH"}
            env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"  # flwr-clientapp of that environment
        proc = Proc(f"supernode {name}", args, env, self.workdir / "logs" / f"supernode-{name}-{k}.log", cwd=cwd)
        proc.health_url = f"http://127.0.0.1:{port}/health"
        self.supernodes[name] = proc
        if wait:
            wait_http(proc.health_url, proc, self.startup_s)
        return proc

    def wait_supernodes(self) -> None:
        for proc in self.supernodes.values():
            wait_http(proc.health_url, proc, self.startup_s)

    def check_alive(self) -> None:
        if self.superlink is not None and not self.superlink.alive():
            raise FlowerRunError(f"the SuperLink exited ({self.superlink.popen.returncode}):\n{self.superlink.tail()}")

    def close(self) -> None:
        """Every SuperNode, then the SuperLink (the SuperNodes deactivate while it still listens)."""
        stop_all(list(self.supernodes.values()))
        self.supernodes.clear()
        if self.superlink is not None:
            stop_all([self.superlink])
            self.superlink = None
