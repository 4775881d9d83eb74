"""`fedccrl train`'s MLflow side (pipeline/fedccrl_pipeline/train.py): one child run per held-out job under the sweep's parent run,
its params as params.yaml spells them with the values the run used (tracked_data.py), every round as it arrives."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fedccrl_core.federation.plan import RunIds
from fedccrl_core.foundation.runkey import params_hash
from fedccrl_pipeline.git_state import git_commit
from fedccrl_pipeline.mlflow_store import mlflow_module, store_errors, tracking_uri
from fedccrl_pipeline.run_names import dvc_experiment_name
from fedccrl_pipeline.sweep_privacy import PRIVACY_TAG
from fedccrl_pipeline.tracked_data import TrackedData, mlflow_params
from fedccrl_pipeline.tracking import ChildRun, parent_run_id, run_status

RUN_KEY_TAG = "fedccrl.run_key"  # a child run: its TrainJob.run_key

if TYPE_CHECKING:
    from fedccrl_core.federation.history import RunHistory
    from fedccrl_pipeline.study_privacy import Study


class TrainTracking:
    """`fedccrl train`'s MLflow side for one (algorithm, seed): the sweep's parent run (found or created on the
    first start), one ChildRun per held-out job, the round records as they arrive, and each run closed with its
    outcome. start(job) is run_jobs' `start`, on_message its `on_message` (fedccrl_core/federation/jobs.py)."""

    def __init__(
        self,
        cfg,
        settings,
        algorithm: str,
        seed: int,
        data: TrackedData,
        jobs: list,
        planned_epsilon: dict[str, float] | None = None,
        study: Study | None = None,
    ):
        """cfg: the ParamsFile; settings: the jobs' RunSettings; data: what the runs train on; jobs: TrainJobs
        (fedccrl_core/federation/plan.py); planned_epsilon: the sweep's planned epsilon per image
        (sweep_privacy.py check_sweep_budget), None without DP or with a seeded noise; study: the runs' study
        (study_privacy.py join_study), whose epsilon per image the parent reports, None likewise."""
        from fedccrl_core.algorithms import ALGORITHMS
        from fedccrl_core.foundation.fastpath import resolve_device

        params = cfg.as_written()  # the keys params.yaml sets, typed: `lr: 1e-3` is 0.001 here too
        swept = set(cfg.train.algorithms)  # the parent names only the groups of the sweep's algorithms
        sweep = {k: v for k, v in params.items() if k not in ("evaluate", "export", *data.exclude)}
        self.sweep_params = {
            **sweep,
            "train": {
                k: v
                for k, v in sweep.get("train", {}).items()
                if k not in ("held_out", "algorithms", "seeds") and (k not in ALGORITHMS or k in swept)
            },
            **data.sweep,
        }
        self.params, self.dataset, self.algorithm, self.seed, self.data, self.jobs = (
            params,
            settings.dataset,
            algorithm,
            seed,
            data,
            jobs,
        )
        self.experiment, self.commit = data.experiment, git_commit()
        self.device = resolve_device(settings.device).type  # what ran, not `auto`
        self.system_metrics_s = cfg.tracking.system_metrics_interval_s if cfg.tracking.system_metrics else None
        self.runs: dict[int, ChildRun] = {}
        self.parent: str | None = None
        self.uri = tracking_uri()
        privacy = cfg.train.privacy  # a DP run says how its noise was drawn: not bit-reproducible, or not private
        self.privacy_tags = {"fedccrl.privacy_noise": privacy.noise_source()} if privacy.enabled else {}
        mark = privacy.not_private_mark()  # a seeded run: epsilon not applicable, the parent and the child marked
        self.parent_tags = {PRIVACY_TAG: mark} if mark else {}
        self.privacy_tags.update(self.parent_tags)
        self.delta, self.planned_epsilon, self.study = privacy.delta, planned_epsilon, study
        self.sweep_key = params_hash(self.sweep_params)

    def start(self, job) -> RunIds:
        with store_errors(self.uri):  # a store or server that fails: one line naming it (TrackingStoreError)
            return self._start(job)

    def on_message(self, kind: str, index: int, payload) -> None:
        from fedccrl_core.federation.history import load_history

        doc = None
        if kind == "done":  # the run's own file, read outside the store's errors
            job = next(j for j in self.jobs if j.index == index)
            doc = load_history(Path(job.out))
        with store_errors(self.uri):
            self._on_message(kind, index, payload, doc)

    def _start(self, job) -> RunIds:
        from fedccrl_core.foundation.fsio import write_text
        from fedccrl_core.foundation.numerics import numeric_platform

        ckpt, dataset, data = job.ckpt, self.dataset, self.data
        side = ckpt.with_suffix(".mlflow.json")
        resumable = ckpt.is_file() or ckpt.with_name(ckpt.name + ".prev").is_file()  # federation/checkpoints.py
        recorded = json.loads(side.read_text())["run_id"] if side.is_file() else None
        # continue the recorded run when its checkpoint is there, and also when its process was killed before the
        # first checkpoint (the run is still RUNNING): one run per training, never a RUNNING one left behind
        resume_id = recorded if recorded and (resumable or run_status(recorded) == "RUNNING") else None
        sweep_key = self.sweep_key
        if self.parent is None:
            self.parent = parent_run_id(self.experiment, sweep_key, self.sweep_params)
            self._mark_parent()
        run = ChildRun(
            self.experiment,
            self.parent,
            f"{self.algorithm}-{dataset}-s{self.seed}-{job.target}",
            mlflow_params(self.params, job, self.device, data),
            {
                "git_commit": self.commit,
                "mlflow.source.git.commit": self.commit.removesuffix("-dirty"),
                **({"dvc.exp_name": dvc_experiment_name()} if dvc_experiment_name() else {}),
                "dvc_stage": f"{data.stage}@{self.algorithm}-{self.seed}",
                "fedccrl.role": "child",
                "fedccrl.engine": data.engine,
                RUN_KEY_TAG: job.run_key,
                "fedccrl.sweep": sweep_key,
                "held_out": job.target,
                "algorithm": self.algorithm,
                "seed": str(self.seed),
                "fedccrl.platform": numeric_platform(self.device),
                **self.privacy_tags,
            },
            resume_run_id=resume_id,
            dataset={"name": data.name, "path": data.path, "profile": {**data.profile, "held_out": job.target}},
            system_metrics_s=self.system_metrics_s,
            on_created=lambda run_id: write_text(side, json.dumps({"run_id": run_id})),
        )
        write_text(side, json.dumps({"run_id": run.run_id}))
        self.runs[job.index] = run
        return RunIds(self.commit, run.run_id, run.experiment_id)

    def _mark_parent(self) -> None:
        """The parent of a seeded sweep is marked not private; a DP sweep's parent gets its planned epsilon per
        image (every process of the sweep computes the same)."""
        from fedccrl_pipeline.study_privacy import STUDY_TAG
        from fedccrl_pipeline.sweep_privacy import SWEEP_PLANNED, epsilon_metrics

        assert self.parent is not None
        client = mlflow_module().MlflowClient()
        for k, v in self.parent_tags.items():
            client.set_tag(self.parent, k, v)
        if self.planned_epsilon:
            log_parent_metrics(client, self.parent, epsilon_metrics(SWEEP_PLANNED, self.planned_epsilon), 0)
        if self.study is not None:
            client.set_tag(self.parent, STUDY_TAG, self.study.key)
            self._report_study(client)

    def _report_study(self, client) -> None:
        """The study's epsilon per image over every release its ledger recorded (every run, attempt and workspace
        of the study), logged to the parent at step = the number of attempts composed."""
        from fedccrl_pipeline.study_privacy import STUDY_RUNS, study_metrics

        assert self.parent is not None and self.study is not None
        metrics = study_metrics(self.study, self.delta)
        if metrics:
            log_parent_metrics(client, self.parent, metrics, int(metrics[STUDY_RUNS]))

    def _report_sweep(self, experiment_id: str) -> None:
        """The sweep's epsilon per image over its finished child runs (their charged releases), logged to the
        parent at step = the number of runs composed: the latest step is the most complete."""
        from fedccrl_core.privacy.sweep_epsilon import per_image_epsilon
        from fedccrl_pipeline.sweep_privacy import SWEEP_EPSILON, SWEEP_RUNS, epsilon_metrics, finished_runs

        assert self.parent is not None
        client = mlflow_module().MlflowClient()
        runs = finished_runs(client, experiment_id, self.sweep_key)
        if runs:
            metrics = {**epsilon_metrics(SWEEP_EPSILON, per_image_epsilon(runs, self.delta)), SWEEP_RUNS: len(runs)}
            log_parent_metrics(client, self.parent, metrics, len(runs))

    def _on_message(self, kind: str, index: int, payload, doc: RunHistory | None) -> None:
        from fedccrl_pipeline.sweep_privacy import child_tags

        run = self.runs[index]
        if kind == "round":
            run.log_round(payload)
        elif kind == "done":
            job = next(j for j in self.jobs if j.index == index)
            assert doc is not None  # on_message reads it for "done"
            late = run.backfill(doc.rounds)  # every round in MLflow, also after a kill or a lost store
            if late:
                print(
                    f"[{self.algorithm} {job.target}] MLflow: round(s) {late} logged now (the run that trained "
                    f"them was interrupted before they reached MLflow)",
                    file=sys.stderr,
                    flush=True,
                )
            run.log_metrics(payload)
            tags = child_tags(doc.dp)
            for k, v in tags.items():
                run.client.set_tag(run.run_id, k, v)
            run.finish()
            if tags and self.planned_epsilon is not None:  # a DP run (not seeded) finished: the sweep's epsilon
                self._report_sweep(run.experiment_id)
            if self.study is not None:
                self._report_study(run.client)

    def finish_all(self, status: str) -> None:
        for run in self.runs.values():
            run.finish(status)


def log_parent_metrics(client, run_id: str, metrics: dict[str, float], step: int) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])
