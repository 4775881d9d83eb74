"""One path from the params file to finished run folders, that the train stage (`fedccrl train`, both engines) and the
deployment (`fedccrl federate`) call: the params read and checked whole (`load_train_config`), the settings every run
shares (`run_settings`), and the planned jobs trained and tracked (`train_tracked`: fedccrl_core/federation/workers.py
runs them, pipeline/fedccrl_pipeline/train_tracking.py records them in MLflow, each run's folder written by
fedccrl_core/federation/finish.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fedccrl_core.foundation.errors import ParamError
from fedccrl_pipeline.params import ParamsFile, validate_params
from fedccrl_pipeline.params_yaml import read_yaml

if TYPE_CHECKING:
    from fedccrl_core.federation.plan import RunSettings, TrainJob
    from fedccrl_pipeline.train_tracking import TrainTracking


def check_algorithm(name: str, option: str = "--algorithm") -> None:
    from fedccrl_core.algorithms import ALGORITHMS

    if name not in ALGORITHMS:
        raise ParamError(
            f"{option}: got {name!r}; must be one of {', '.join(ALGORITHMS)} (params.yaml train.algorithms)"
        )


def load_train_config(path: Path, algorithm: str, downloads: bool = True) -> ParamsFile:
    """The whole params file, typed, with `algorithm` (--algorithm) checked as one to be trained; ParamError with
    one line per problem, before any data is read and before MLflow. `downloads=False`: this machine downloads no
    data (a deployment's operator: the sites hold it), so dataset.source does not apply."""
    check_algorithm(algorithm)
    return validate_params(read_yaml(path), (algorithm,), downloads)


def run_settings(cfg: ParamsFile) -> RunSettings:
    """What every run of the stage shares (fedccrl_core/federation/plan.py RunSettings), from the typed params: the
    `auto` backbone and pretrained weights resolved for the dataset."""
    from fedccrl_core.data.registry import resolve_backbone, resolve_pretrained
    from fedccrl_core.federation.plan import RunSettings

    t = cfg.train
    return RunSettings(
        dataset=cfg.dataset.name,
        backbone=resolve_backbone(cfg.model.backbone, cfg.dataset.name),
        pretrained=resolve_pretrained(cfg.model.pretrained, cfg.dataset.name),
        local=cfg.local,
        engine=t.engine,
        device=t.device,
        client_fraction=t.client_fraction,
        concurrent_clients=t.concurrent_clients,
        client_state=t.client_state,
        eval_batch_size=cfg.evaluate.batch_size,
    )


def train_tracked(
    jobs: list[TrainJob],
    workers: int,
    shards: Path | None,
    pools: Path | None,
    tracking: TrainTracking,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Train `jobs`, `workers` at a time, each run an MLflow child run closed with its outcome: FINISHED, KILLED
    (Ctrl-C, SIGTERM: resumable) or FAILED. A store that fails is left to its own error (the rerun resumes the runs
    it left RUNNING). `progress`: each round's line (RoundRecord.progress) where the rounds are not logged by this
    machine's processes (a deployment's ServerApp logs on the SuperLink's host)."""
    from fedccrl_core.federation.round_record import RoundRecord
    from fedccrl_core.federation.workers import run_jobs
    from fedccrl_pipeline.mlflow_store import TrackingStoreError

    def on_message(kind: str, index: int, payload) -> None:
        if progress is not None and kind == "round" and isinstance(payload, RoundRecord):
            job = next(j for j in jobs if j.index == index)
            progress(f"[{job.algorithm} {job.target}] {payload.progress(job.settings.local.rounds)}")
        tracking.on_message(kind, index, payload)

    try:
        run_jobs(jobs, workers, shards, pools, tracking.start, on_message)
    except TrackingStoreError:  # nothing more can be told to the store
        raise
    except (KeyboardInterrupt, SystemExit):  # fedccrl_core/foundation/procs.py: resumable, not failed
        tracking.finish_all("KILLED")
        raise
    except BaseException:
        tracking.finish_all("FAILED")
        raise
