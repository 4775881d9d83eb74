"""A deployment's releases in the operator's study ledger (fedccrl_core/privacy/study_ledger.py; docs/privacy.md,
"One ledger per study").

The ServerApp of `fedccrl federate` runs on the SuperLink's host, which does not share the operator's disk: it finds
no study pointer, appends to no study ledger, and its round records carry its releases to the tracking server
(contract.DP_RELEASES, fedccrl_core/federation/round_record.py LedgerReleases). `fedccrl federate` is then the run's
one writer: `counted` appends each record's releases as the run is followed, and `catch_up`, before the study's
budget check, those that an earlier `federate` of the same run (its run key) left on the tracking server uncounted
(it stopped following). A release is keyed by its run's ledger and its index there (study_ledger.py
append_reported), so a record read twice, a resumed run's inherited releases and both paths count it once. A
ServerApp that did read the pointer (a shared disk, a local simulation) appended its releases itself and its
records carry none: nothing here writes for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedccrl_core.federation.plan import TrainJob
    from fedccrl_core.federation.round_record import RoundRecord, SpentRecord
    from fedccrl_pipeline.study_privacy import Study


def count_record(study: Study, job: TrainJob, rec: RoundRecord | SpentRecord) -> tuple[int, int]:
    """The releases record `rec` of `job` carries, counted in `study`: (how many were new, how many were counted
    already); (0, 0) for a record that carries none."""
    from fedccrl_core.privacy.study_ledger import append_reported
    from fedccrl_pipeline.study_privacy import pointer_of

    rel = rec.dp_releases
    if rel is None:
        return 0, 0
    releases = [list(r) for r in rel.releases]
    added = append_reported(pointer_of(study, job), job.run_key, rel.ledger, rel.start, releases)
    return len(added), len(releases) - len(added)


def counted(train: Callable, study: Study, log: Callable[[str], None]) -> Callable:
    """`train` (a TrainJob.flower_train) whose on_round first counts each record's releases in `study`; once the run
    is done, a run ledger of which the study misses releases (a record lost on the way) is said on stderr."""
    from fedccrl_core.foundation import contract

    def train_counted(job: TrainJob, *, on_round=None, **kwargs):
        ledgers: set[str] = set()

        def on_record(rec: RoundRecord | SpentRecord) -> None:
            new, old = count_record(study, job, rec)
            if rec.dp_releases is not None:
                ledgers.add(rec.dp_releases.ledger)
                again = f" ({old} counted before)" if old else ""
                log(f"study {study.key}: round {rec.round}: {new} release(s) counted in {study.ledger}{again}")
            if on_round is not None:
                on_round(rec)

        result = train(job, on_round=on_record, **kwargs)
        charged = len(result.extra.get(contract.PRIVACY_RELEASES, []))
        for ledger in sorted(ledgers):
            have = counted_releases(study, ledger)
            if have < charged:
                log(
                    f"study {study.key}: WARNING: the run's ledger {ledger} charged {charged} release(s), the study "
                    f"{study.ledger} counts {have} of them: its epsilon per image is under-counted"
                )
        return result

    return train_counted


def counted_releases(study: Study, ledger: str) -> int:
    """How many releases of the run ledger `ledger` the study counts."""
    from fedccrl_core.privacy.study_ledger import read_study

    _, entries = read_study(study.ledger)
    return sum((e.release or "").startswith(f"{ledger}/") for e in entries)


def catch_up(study: Study, job: TrainJob, log: Callable[[str], None]) -> None:
    """Before the study's budget check of a `fedccrl federate` of `job`: every Flower run that reported to an MLflow
    child run of the same run key is read from the tracking server and its releases counted (those counted already
    are skipped), each named on stderr with its status and what it added; one that is still running is said to be,
    with what it reports later not counted yet; one whose records cannot be read is named as not counted."""
    from fedccrl_core.foundation.errors import DataError
    from fedccrl_flower.spec import ReportTo
    from fedccrl_flower.tracked_report import TrackedReader, reported_runs
    from fedccrl_pipeline.mlflow_store import mlflow_module, store_errors
    from fedccrl_pipeline.train_tracking import RUN_KEY_TAG

    mlflow = mlflow_module()
    uri = mlflow.get_tracking_uri()
    query = f"tags.`{RUN_KEY_TAG}` = '{job.run_key}' and tags.`fedccrl.role` = 'child'"
    with store_errors(uri):
        runs = mlflow.search_runs(search_all_experiments=True, filter_string=query, output_format="list")
        for run in runs:
            for flower_run in reported_runs(run.data.tags):
                reader = TrackedReader(ReportTo(tracking_uri=uri, run_id=run.info.run_id), flower_run)
                where = f"Flower run {flower_run} (MLflow run {run.info.run_id})"
                try:
                    status = reader.status().get("status", "not started")
                    new = old = 0
                    for rec in reader.new_records(0):
                        n, o = count_record(study, job, rec)
                        new, old = new + n, old + o
                except DataError as e:
                    log(f"study {study.key}: NOT COUNTED: the releases of {where}: {e}")
                    continue
                if new or old:
                    log(f"study {study.key}: caught up {where}, {status}: {new} release(s) counted now, {old} before")
                if status not in ("completed", "failed", "stopped"):
                    log(
                        f"study {study.key}: {where} is {status}: the releases it reports from now on are not "
                        "counted until a `fedccrl federate` of this run runs again"
                    )
