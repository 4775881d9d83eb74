"""The study ledger (fedccrl_core/privacy/study_ledger.py) where the pipeline needs it: which study a `fedccrl train` or
`fedccrl federate` belongs to and where its ledger lies (train.privacy.study, train.privacy.study_dir), the budget
train.privacy.max_sweep_epsilon checked against what the study already spent plus the runs this process plans, before
it reads a shard or opens an MLflow run, and the pointer beside each run's round checkpoint that makes the round loop
append its releases to the study's ledger.

Where: <project root>/.fedccrl/studies by default. project_root() (mlflow_store.py) is the repository whose
workspace DVC's `--queue` and `--temp` experiments copy (DVC_ROOT, or the parent of .dvc/tmp/exps), so every copy,
every engine and every attempt of a run reaches the one file, as they reach the one MLflow store."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fedccrl_core.foundation.errors import ParamError
from fedccrl_pipeline.sweep_privacy import KEY, SweepPlan

if TYPE_CHECKING:
    from fedccrl_core.federation.plan import TrainJob
    from fedccrl_core.privacy.study_ledger import StudyPointer
    from fedccrl_pipeline.params import ParamsFile

DEFAULT_DIR = Path(".fedccrl") / "studies"  # under the project's root
STUDY_TAG = "fedccrl.study"  # the parent run: the study key
STUDY_EPSILON = "dp_epsilon_study_per_image"  # the parent: over every release the study recorded; /<domain>
STUDY_RUNS = "dp_study_attempts"  # the parent: how many attempts of runs that value composes


@dataclass(frozen=True)
class Study:
    key: str
    data: str  # the hash of what describes the images
    name: str  # train.privacy.study
    ledger: Path


def study_of(cfg: ParamsFile, data_key: str) -> Study | None:
    """The study of runs on the images described by `data_key` (TrainJob.data_key); None without DP or with a seeded
    noise (no epsilon applies: its releases are not the study's)."""
    s = cfg.train.privacy
    if not s.enabled or s.seeded:
        return None
    from fedccrl_core.privacy.study_ledger import SUFFIX, study_key
    from fedccrl_pipeline.mlflow_store import project_root

    root = project_root()
    folder = root / (Path(s.study_dir) if s.study_dir else DEFAULT_DIR)  # an absolute study_dir stays itself
    key = study_key(data_key, s.study)
    return Study(key, data_key, s.study, folder.resolve() / f"{key}{SUFFIX}")


def check_study_budget(
    cfg: ParamsFile, study: Study, plan: SweepPlan, algorithm: str, seed: int, targets: list[str]
) -> dict[str, float] | None:
    """With max_sweep_epsilon set, the study's epsilon per image spent so far, {domain: epsilon}, and ParamError
    naming max_sweep_epsilon, the study and the numbers when that plus this process's runs (algorithm x seed x
    targets, every round: a resumed run is charged in full, the worst case) would take a domain past it; before any
    shard or MLflow run. None when no budget is set (nothing to check)."""
    from fedccrl_core.privacy.study_ledger import read_study, study_runs
    from fedccrl_core.privacy.sweep_epsilon import per_image_epsilon
    from fedccrl_pipeline.sweep_privacy import planned_sweep

    s = cfg.train.privacy
    if not s.max_sweep_epsilon:
        return None
    _, entries = read_study(study.ledger)
    spent_runs = study_runs(entries)
    spent = per_image_epsilon(spent_runs, s.delta)
    own = SweepPlan(plan.domains, [algorithm], [seed], targets, plan.sizes)
    planned = planned_sweep(cfg, own, algorithm, seed, targets)
    total = per_image_epsilon([*spent_runs, *planned], s.delta)
    over = {d: e for d, e in total.items() if e > s.max_sweep_epsilon}
    if over:
        d = max(over, key=lambda k: over[k])
        mine = per_image_epsilon(planned, s.delta).get(d, 0.0)
        raise ParamError(
            f"params.yaml: key '{KEY}': got {s.max_sweep_epsilon:g}; study {study.key}{_named(study)} "
            f"({study.ledger}) already spent epsilon {spent.get(d, 0.0):.3f} per image of domain {d} "
            f"({sum(d in r.trained_domains for r in spent_runs)} attempt(s) of runs), and this command's "
            f"{len(planned)} run(s) plan {mine:.3f} alone: together {over[d]:.3f} at delta {s.delta:g}, above it. "
            f"Raise {KEY}, raise the noise multipliers, train fewer runs, or start a new study on purpose "
            "(train.privacy.study: docs/privacy.md)"
        )
    return spent


def _named(study: Study) -> str:
    return f" (named {study.name!r})" if study.name else ""


def pointer_of(study: Study, job: TrainJob) -> StudyPointer:
    """The study pointer of `job`: its study's ledger, the run's name and the domains it trains on."""
    from fedccrl_core.privacy.study_ledger import StudyPointer

    return StudyPointer(
        fedccrl_study_pointer=1,
        ledger=str(study.ledger),
        study=study.key,
        data=study.data,
        name=study.name,
        run=f"{job.algorithm} s{job.seed} held-out {job.target}",
        trained_domains=list(job.sources),
    )


def write_pointers(study: Study, jobs: list[TrainJob]) -> None:
    """Beside each job's round checkpoint, the pointer that makes its round loop append every release to the study's
    ledger (the study's folder created here)."""
    from fedccrl_core.privacy.study_ledger import write_pointer

    study.ledger.parent.mkdir(parents=True, exist_ok=True)
    for job in jobs:
        write_pointer(Path(job.ckpt), pointer_of(study, job))


def join_study(
    cfg: ParamsFile, plan: SweepPlan, algorithm: str, seed: int, targets: list[str], jobs: list[TrainJob]
) -> Study | None:
    """The study of `jobs` (None without DP or with a seeded noise): its budget checked (check_study_budget) and
    their pointers written (write_pointers), before any shard is read or an MLflow run opened."""
    study = study_of(cfg, jobs[0].data_key) if jobs else None
    if study is not None:
        check_study_budget(cfg, study, plan, algorithm, seed, targets)
        write_pointers(study, jobs)
    return study


def study_metrics(study: Study, delta: float) -> dict[str, float]:
    """The parent run's metrics of the study: its epsilon per image (the worst domain's, and /<domain>) over every
    release recorded, and how many attempts of runs it composes; {} before any release."""
    from fedccrl_core.privacy.study_ledger import read_study, study_epsilon, study_runs
    from fedccrl_pipeline.sweep_privacy import epsilon_metrics

    _, entries = read_study(study.ledger)
    eps = study_epsilon(entries, delta)
    return {**epsilon_metrics(STUDY_EPSILON, eps), STUDY_RUNS: len(study_runs(entries))} if eps else {}
