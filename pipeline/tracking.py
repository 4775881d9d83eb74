"""MLflow bookkeeping shared by the stages: one parent run per sweep, one child run per
(held-out domain, algorithm, seed); git commit and DVC stage as tags. MLflow's default store
(sqlite:///mlflow.db) unless MLFLOW_TRACKING_URI says otherwise."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import subprocess
import sys
from pathlib import Path

from fedccrl_core.runkey import code_hash, params_hash  # noqa: F401 (the run key is the library's)


OWNER_TAG = "fedccrl.owner"  # <host>:<pid>:<since> of the process that has the run open
SECONDS = 0.0  # wall seconds spent in MLflow calls (imports included) by this process; `fedccrl bench-repro`
_depth = 0


def timed(fn):
    """Count fn's wall time into SECONDS (outermost call only)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global SECONDS, _depth
        _depth += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _depth -= 1
            if _depth == 0:
                SECONDS += time.perf_counter() - t0
    return wrapper


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def project_root(cwd: Path | None = None) -> Path:
    """The repository whose mlflow.db the README's `mlflow ui` opens. `dvc exp run --temp` and `--queue` run
    the stages in a copy under <repo>/.dvc/tmp/exps/..., deleted afterwards: their runs belong to <repo>. DVC
    names the parent repository in DVC_ROOT for experiment runs; the path is the fallback."""
    if cwd is None and os.environ.get("DVC_ROOT"):
        return Path(os.environ["DVC_ROOT"]).resolve()
    cwd = (cwd or Path.cwd()).resolve()
    for p in (cwd, *cwd.parents):
        if p.name == "exps" and p.parent.name == "tmp" and p.parent.parent.name == ".dvc":
            return p.parent.parent.parent
    return cwd


@timed
def mlflow_module():
    """mlflow, pointed at MLFLOW_TRACKING_URI or, by default, sqlite:///<project_root()>/mlflow.db (an absolute
    path, so that every DVC way of running, --temp and --queue included, logs to the one store)."""
    import mlflow

    if not os.environ.get("MLFLOW_TRACKING_URI"):
        mlflow.set_tracking_uri(f"sqlite:///{project_root() / 'mlflow.db'}")
    _create_sqlite_store_whole(mlflow.get_tracking_uri())
    return mlflow


def _create_sqlite_store_whole(uri: str) -> None:
    """A new SQLite store comes into being whole or not at all. MLflow creates its tables in many migration
    steps, and a process killed among them (kill -9 of `train` while its MLflow starts up) leaves a store that
    every later run fails on with a traceback ("table _alembic_tmp_experiments already exists"). So a missing
    store is built in an fsio scratch folder beside it and hard-linked into place (a store another process
    created meanwhile wins); a scratch folder left by a killed process is removed by the next run."""
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri[len("sqlite:///"):])
    if path.exists() or not path.parent.is_dir():
        return
    try:
        from mlflow.tracking._tracking_service.utils import _get_sqlalchemy_store
    except ImportError:  # another MLflow: it creates the store itself
        return
    from fedccrl_core.fsio import scratch_dir

    with scratch_dir(path) as tmp:
        store = _get_sqlalchemy_store(f"sqlite:///{tmp / path.name}", None)  # MLflow's own creation and migrations
        store.engine.dispose()
        try:
            os.link(tmp / path.name, path)
        except FileExistsError:
            pass


@timed
def set_experiment(name: str):
    """Get or create the experiment, in MLflow's classic (model development) UI mode. A NEW experiment keeps
    its artifacts under FEDCCRL_MLFLOW_ARTIFACTS (tests point it at a temp folder) or, with the default store,
    <project_root()>/mlartifacts, never inside a DVC temp copy."""
    mlflow = mlflow_module()
    if mlflow.get_experiment_by_name(name) is None:
        if os.environ.get("FEDCCRL_MLFLOW_ARTIFACTS"):
            root = Path(os.environ["FEDCCRL_MLFLOW_ARTIFACTS"]).resolve()
        elif not os.environ.get("MLFLOW_TRACKING_URI"):
            root = project_root() / "mlartifacts"
        else:
            root = None
        if root is not None:
            try:
                mlflow.create_experiment(name, artifact_location=(root / name).as_uri(),
                                         tags={"mlflow.experimentKind": "custom_model_development"})
            except Exception:  # created meanwhile by another process
                pass
    exp = mlflow.set_experiment(name)
    if exp.tags.get("mlflow.experimentKind") != "custom_model_development":  # the classic UI, not GenAI
        mlflow.MlflowClient().set_experiment_tag(exp.experiment_id, "mlflow.experimentKind", "custom_model_development")
    return exp


def dvc_experiment_name() -> str | None:
    """The name of the DVC experiment running this stage (`dvc exp run` sets DVC_EXP_NAME), else None."""
    return os.environ.get("DVC_EXP_NAME") or None


def changed_params(sweep_params: dict, baseline_yaml: str | None = None) -> dict | None:
    """The params of this sweep that differ from the committed params.yaml (`git show HEAD:params.yaml`: the
    experiment's baseline, also inside `dvc exp run --temp/--queue` copies), as dotted keys; None without git."""
    import yaml

    if baseline_yaml is None:
        try:
            p = subprocess.run(["git", "show", "HEAD:params.yaml"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        if p.returncode != 0:
            return None
        baseline_yaml = p.stdout
    try:
        base = flatten(yaml.safe_load(baseline_yaml) or {})
    except yaml.YAMLError:
        return None
    now = flatten(sweep_params)
    return {k: v for k, v in now.items() if k in base and base[k] != v}


def sweep_run_name(exp_name: str | None, sweep_params: dict, sweep_key: str, baseline_yaml: str | None = None) -> str:
    """A parent run's name: the DVC experiment and its changed params (`gauge-damn train.fedccrl.lambda1=1`),
    `default` for the committed params, `sweep-<key>` when there is no git baseline to compare with."""
    changed = changed_params(sweep_params, baseline_yaml)
    if changed is None:
        return exp_name or f"sweep-{sweep_key[:8]}"
    parts = [exp_name] if exp_name else []
    parts += [f"{k}={v}" for k, v in changed.items()] or ([] if exp_name else ["default"])
    name = " ".join(parts)
    return name if len(name) <= 250 else name[:249] + "…"   # MLflow's run-name limit


@timed
def parent_run_id(experiment: str, sweep_key: str, sweep_params: dict) -> str:
    """Find or create the sweep's parent run (tagged fedccrl.sweep=<key>)."""
    mlflow = mlflow_module()
    exp = set_experiment(experiment)
    client = mlflow.MlflowClient()
    found = client.search_runs([exp.experiment_id], filter_string=f"tags.`fedccrl.sweep` = '{sweep_key}' "
                               "and tags.`fedccrl.role` = 'parent'", max_results=1)
    if found:
        return found[0].info.run_id
    exp_name = dvc_experiment_name()
    tags = {"fedccrl.sweep": sweep_key, "fedccrl.role": "parent", "git_commit": git_commit(),
            "mlflow.source.git.commit": git_commit().removesuffix("-dirty")}
    if exp_name:
        tags["dvc.exp_name"] = exp_name
    run = client.create_run(exp.experiment_id, run_name=sweep_run_name(exp_name, sweep_params, sweep_key), tags=tags)
    for k, v in list(flatten(sweep_params).items())[:500]:
        client.log_param(run.info.run_id, k, str(v)[:6000])
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def log_dataset(client, run_id: str, name: str, path: Path, context: str = "training", profile: dict | None = None):
    """Dataset lineage (the run's Inputs in the UI, what mlflow.log_input records): the dataset named by the
    file that describes it (the partition's manifest.json), with that file's sha256 as its digest."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    path = Path(path).resolve()
    ds = Dataset(name=name, digest=file_digest(path), source_type="local",
                 source=json.dumps({"uri": path.as_uri()}), profile=json.dumps(profile or {}))
    client.log_inputs(run_id, datasets=[DatasetInput(ds, tags=[InputTag("mlflow.data.context", context)])])


@timed
def run_status(run_id: str) -> str | None:
    """The run's status (RUNNING, FINISHED, KILLED, FAILED), None when the store has no such run."""
    mlflow = mlflow_module()
    try:
        return mlflow.MlflowClient().get_run(run_id).info.status
    except Exception:  # MlflowException RESOURCE_DOES_NOT_EXIST (or an unreadable store)
        return None


def _run_exists(mlflow, run_id: str) -> bool:
    try:
        mlflow.MlflowClient().get_run(run_id)
        return True
    except Exception:  # MlflowException RESOURCE_DOES_NOT_EXIST (or an unreadable store: start afresh)
        return False


class ChildRun:
    """The child run of one training; resumable by run id after an interrupted train. Written against
    MlflowClient with explicit run ids (not the fluent API's one active run), so one train process can keep
    the runs of several held-out domains open at once."""

    @timed
    def __init__(self, experiment: str, parent_id: str, name: str, params: dict, tags: dict,
                 resume_run_id: str | None = None, dataset: dict | None = None, system_metrics_s: float | None = None,
                 on_created=None):
        """params: flat (dotted keys); dataset: log_dataset's keywords, logged once on a new run;
        system_metrics_s: sample CPU, RAM (GPU where present) into system/* metrics every this many seconds
        until finish(), None = off; on_created(run_id): called as soon as a new run exists, before its params are
        logged, so the caller records the id at once (a kill while the rest starts up leaves no unknown run)."""
        self.mlflow = mlflow_module()
        exp = set_experiment(experiment)
        self.client = self.mlflow.MlflowClient()
        self.logged_rounds: set[int] = set()
        if resume_run_id and not _run_exists(self.mlflow, resume_run_id):
            # the store was deleted or replaced (e.g. mlflow.db removed): heal instead of a traceback
            print(f"warning: MLflow run {resume_run_id} named by the resume state no longer exists in "
                  f"{self.mlflow.get_tracking_uri()}; starting a fresh run", file=sys.stderr, flush=True)
            resume_run_id = None
        self.resumed = bool(resume_run_id)
        owner = f"{socket.gethostname()}:{os.getpid()}:{time.time():.0f}"  # who, since when (owner_alive)
        if resume_run_id:
            self.client.update_run(resume_run_id, status="RUNNING")
            self.client.set_tag(resume_run_id, OWNER_TAG, owner)
            self.run_id = resume_run_id
        else:
            run = self.client.create_run(exp.experiment_id, run_name=name,
                                         tags={**tags, "mlflow.parentRunId": parent_id, OWNER_TAG: owner})
            self.run_id = run.info.run_id
            if on_created is not None:
                on_created(self.run_id)
            from mlflow.entities import Param

            items = [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]
            for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=items[i:i + 100])
            if dataset:
                log_dataset(self.client, self.run_id, **dataset)
        self._close_orphans(exp.experiment_id, tags)
        self.experiment_id = exp.experiment_id
        self.monitor = None
        if system_metrics_s:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self.monitor = SystemMetricsMonitor(self.run_id, sampling_interval=system_metrics_s,
                                                resume_logging=bool(resume_run_id),
                                                tracking_uri=self.mlflow.get_tracking_uri())
            self.monitor.start()

    def _close_orphans(self, experiment_id: str, tags: dict) -> None:
        """Runs of this same training (held-out domain, algorithm, seed) left RUNNING by a process of this host
        that no longer runs (kill -9, then a rerun that could not continue them, e.g. after a code change) are
        marked KILLED, with a notice: a RUNNING run always has a live process."""
        from fedccrl_core.fsio import owner_alive

        same = " and ".join(f"tags.`{k}` = '{tags[k]}'" for k in ("held_out", "algorithm", "seed") if k in tags)
        if not same:
            return
        host = socket.gethostname()
        for run in self.client.search_runs([experiment_id], filter_string=f"{same} and attributes.status = 'RUNNING'"):
            who = run.data.tags.get(OWNER_TAG, "")
            if run.info.run_id == self.run_id or not who.startswith(f"{host}:"):
                continue  # this run, or one whose process lives on another machine (or is older than the tag)
            try:
                pid, since = (int(x) for x in who.split(":")[1:3])
            except ValueError:
                continue
            if not owner_alive(pid, since):
                self.client.set_terminated(run.info.run_id, status="KILLED")
                print(f"notice: MLflow run {run.info.run_id} was left RUNNING by process {pid}, which is no longer "
                      f"running; marked KILLED", file=sys.stderr, flush=True)

    @timed
    def log_metrics(self, metrics: dict, step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def backfill(self, history: list[dict]) -> list[int]:
        """Log every round of the finished training's history that this run lacks, and return their numbers.
        A resumed run can lack rounds: its process was killed after a round's checkpoint but before the round
        reached MLflow (a worker checkpoints while the parent logs), or its store was deleted (a fresh run, see above)."""
        from fedccrl_core import contract

        have = set(self.logged_rounds)
        if self.resumed:
            have |= {int(m.step) for m in self.client.get_metric_history(self.run_id, contract.TARGET_ACC)}
        missing = [rec for rec in history if int(rec[contract.ROUND]) not in have]
        for rec in missing:
            self.log_round(rec)
        return [int(rec[contract.ROUND]) for rec in missing]

    @timed
    def log_round(self, rec: dict) -> None:
        from fedccrl_core import contract

        rnd = int(rec[contract.ROUND])
        self.logged_rounds.add(rnd)
        self.log_metrics({k: v for k, v in rec.items()
                          if k != contract.ROUND and isinstance(v, (int, float)) and v is not None}, step=rnd)
        if rec.get(contract.VAL_PRED_CLASSES) == 1:  # federation/loop.py warned: the model predicts one class
            self.client.set_tag(self.run_id, "fedccrl.collapsed", f"round {rnd}")
        for kind in ("dropped", "refused"):  # the Flower engine's round record: who and why (server_app.py)
            who = rec.get(f"{kind}_clients") or []
            for d in who:
                if d.get("client"):
                    self.log_metrics({f"{kind}/{d['client']}": 1}, step=rnd)
            if who:
                self.client.set_tag(self.run_id, f"fedccrl.{kind}.round_{rnd}", json.dumps(who, sort_keys=True)[:5000])

    @timed
    def finish(self, status: str = "FINISHED") -> None:
        if self.monitor is not None:
            self.monitor.finish()
            self.monitor = None
        self.client.set_terminated(self.run_id, status=status)
