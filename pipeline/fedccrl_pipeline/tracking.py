"""The MLflow runs of the stages: one parent run per sweep, one child run per (held-out domain, algorithm, seed),
written against MlflowClient with explicit run ids. The store is pipeline/fedccrl_pipeline/mlflow_store.py's, the names
pipeline/fedccrl_pipeline/run_names.py's, the clean-up of dead processes' runs pipeline/fedccrl_pipeline/orphan_runs.py's."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from fedccrl_core.data.checksums import sha256_file
from fedccrl_core.federation.round_record import RoundRecord, SpentRecord
from fedccrl_pipeline.git_state import git_commit
from fedccrl_pipeline.mlflow_store import find_run, mlflow_module, set_experiment
from fedccrl_pipeline.orphan_runs import OWNER_TAG, close_orphans, owner
from fedccrl_pipeline.run_names import dvc_experiment_name, flatten, sweep_run_name

MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value


def parent_run_id(experiment: str, sweep_key: str, sweep_params: dict) -> str:
    """Find or create the sweep's parent run (tagged fedccrl.sweep=<key>). Processes that start the same sweep at
    once (queued experiments, two people) may each create one: each then keeps the first one created (by start
    time, then id), and deletes its own if that is another, before any child run names it."""
    mlflow = mlflow_module()
    exp = set_experiment(experiment)
    client = mlflow.MlflowClient()
    query = f"tags.`fedccrl.sweep` = '{sweep_key}' and tags.`fedccrl.role` = 'parent'"
    first = ["attributes.start_time ASC", "attributes.run_id ASC"]
    found = client.search_runs([exp.experiment_id], filter_string=query, max_results=1, order_by=first)
    if found:
        return found[0].info.run_id
    exp_name = dvc_experiment_name()
    commit = git_commit()
    tags = {
        "fedccrl.sweep": sweep_key,
        "fedccrl.role": "parent",
        "git_commit": commit,
        "mlflow.source.git.commit": commit.removesuffix("-dirty"),
    }
    if exp_name:
        tags["dvc.exp_name"] = exp_name
    run = client.create_run(exp.experiment_id, run_name=sweep_run_name(exp_name, sweep_params, sweep_key), tags=tags)
    for k, v in list(flatten(sweep_params).items())[:500]:
        client.log_param(run.info.run_id, k, str(v)[:MAX_PARAM_CHARS])
    client.set_terminated(run.info.run_id)
    oldest = client.search_runs([exp.experiment_id], filter_string=query, max_results=1, order_by=first)[0]
    if oldest.info.run_id != run.info.run_id:  # another process created the sweep's parent first: it wins
        client.delete_run(run.info.run_id)
    return oldest.info.run_id


def log_dataset(client, run_id: str, name: str, path: Path, context: str = "training", profile: dict | None = None):
    """Dataset lineage (the run's Inputs in the UI, what mlflow.log_input records): the dataset named by the
    file that describes it (the partition's manifest.json), with that file's sha256 as its digest."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    path = Path(path).resolve()
    ds = Dataset(
        name=name,
        digest=sha256_file(path)[:16],
        source_type="local",
        source=json.dumps({"uri": path.as_uri()}),
        profile=json.dumps(profile or {}),
    )
    client.log_inputs(run_id, datasets=[DatasetInput(ds, tags=[InputTag("mlflow.data.context", context)])])


def run_status(run_id: str) -> str | None:
    """The run's status (RUNNING, FINISHED, KILLED, FAILED), None when the store has no such run."""
    run = find_run(mlflow_module(), run_id)
    return run.info.status if run is not None else None


class ChildRun:
    """The child run of one training; resumable by run id after an interrupted train. Written against
    MlflowClient with explicit run ids (not the fluent API's one active run), so one train process can keep
    the runs of several held-out domains open at once."""

    def __init__(
        self,
        experiment: str,
        parent_id: str,
        name: str,
        params: dict,
        tags: dict,
        resume_run_id: str | None = None,
        dataset: dict | None = None,
        system_metrics_s: float | None = None,
        on_created=None,
    ):
        """params: flat (dotted keys); dataset: log_dataset's keywords, logged once on a new run;
        system_metrics_s: sample CPU, RAM (GPU where present) into system/* metrics every this many seconds
        until finish(), None = off; on_created(run_id): called as soon as a new run exists, before its params are
        logged, so the caller records the id at once (a kill while the rest starts up leaves no unknown run)."""
        self.mlflow = mlflow_module()
        exp = set_experiment(experiment)
        self.client = self.mlflow.MlflowClient()
        self.logged_rounds: set[int] = set()
        if resume_run_id and find_run(self.mlflow, resume_run_id) is None:
            # the store was deleted or replaced (e.g. mlflow.db removed): heal instead of a traceback
            print(
                f"warning: MLflow run {resume_run_id} named by the resume state no longer exists in "
                f"{self.mlflow.get_tracking_uri()}; starting a fresh run",
                file=sys.stderr,
                flush=True,
            )
            resume_run_id = None
        self.resumed = bool(resume_run_id)
        if resume_run_id:
            self.client.update_run(resume_run_id, status="RUNNING")
            self.client.set_tag(resume_run_id, OWNER_TAG, owner())
            self.run_id = resume_run_id
        else:
            run = self.client.create_run(
                exp.experiment_id, run_name=name, tags={**tags, "mlflow.parentRunId": parent_id, OWNER_TAG: owner()}
            )
            self.run_id = run.info.run_id
            if on_created is not None:
                on_created(self.run_id)
            self._log_params(params)
            if dataset:
                log_dataset(self.client, self.run_id, **dataset)
        close_orphans(self.client, exp.experiment_id, tags, self.run_id)
        self.experiment_id = exp.experiment_id
        self.monitor = None
        if system_metrics_s:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self.monitor = SystemMetricsMonitor(
                self.run_id,
                sampling_interval=system_metrics_s,
                resume_logging=bool(resume_run_id),
                tracking_uri=self.mlflow.get_tracking_uri(),
            )
            self.monitor.start()

    def _log_params(self, params: dict) -> None:
        """`params` (flattened to dotted keys, each value cut to MAX_PARAM_CHARS) onto the new run."""
        from mlflow.entities import Param

        items = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict, step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def backfill(self, history: list[RoundRecord]) -> list[int]:
        """Log every round of the finished training's history that this run lacks, and return their numbers.
        A resumed run can lack rounds: its process was killed after a round's checkpoint but before the round
        reached MLflow (a worker checkpoints while the parent logs), or its store was deleted (a fresh run, see above)."""
        from fedccrl_core.foundation import contract

        have = set(self.logged_rounds)
        if self.resumed:
            have |= {int(m.step) for m in self.client.get_metric_history(self.run_id, contract.TARGET_ACC)}
        missing = [rec for rec in history if rec.round not in have]
        for rec in missing:
            self.log_round(rec)
        return [rec.round for rec in missing]

    def log_round(self, rec: RoundRecord | SpentRecord) -> None:
        """One round's record as the engine sends it live (the loop's `on_round`, a worker's message): MLflow's
        metrics and tags at its step; a dropped or refused client by its client id (node id where none is known)."""
        rnd = rec.round
        self.logged_rounds.add(rnd)
        self.log_metrics(rec.numbers(), step=rnd)
        if not isinstance(rec, RoundRecord):
            return
        if rec.val_pred_classes == 1:  # federation/loop.py warned: the model predicts one class
            self.client.set_tag(self.run_id, "fedccrl.collapsed", f"round {rnd}")
        for kind, who in (("dropped", rec.dropped_clients or []), ("refused", rec.refused_clients or [])):
            for d in who:
                if d.client:
                    self.log_metrics({f"{kind}/{d.client}": 1}, step=rnd)
            if who:
                text = json.dumps([d.to_dict() for d in who], sort_keys=True)[:5000]
                self.client.set_tag(self.run_id, f"fedccrl.{kind}.round_{rnd}", text)

    def finish(self, status: str = "FINISHED") -> None:
        if self.monitor is not None:
            self.monitor.finish()
            self.monitor = None
        self.client.set_terminated(self.run_id, status=status)
