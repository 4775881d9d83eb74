"""A trained run, finished: its model meta (what a model file says of itself: the data, the algorithm, the run key
and the provenance), its privacy summary and marks, and its folder (the run layout of fedccrl_core/foundation/
contract.py), written once here for every engine: the train stage's in-process and Flower runs and the deployment's
(`fedccrl federate`).


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fedccrl_core.federation.plan import TrainJob
from fedccrl_core.federation.round_record import RoundRecord, SpentRecord
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.numerics import numeric_platform
from fedccrl_core.learning.model_meta import ModelMeta

if TYPE_CHECKING:  # torch, imported by the process that trains
    from fedccrl_core.federation.history import RunHistory, RunPrivacySummary
    from fedccrl_core.federation.loop import RunResult

R = TypeVar("R", RoundRecord, SpentRecord)

DEPLOYED_PLATFORM = "flower deployment: trained on the sites' machines; written on {}"


def model_meta(job: TrainJob, hparams: dict, device: str) -> ModelMeta:
    """The meta of a run's model files and history: the data it trained on, the algorithm with its hyperparameters
    as built (`hparams`), the run key, the MLflow run, the code's commit, and the numeric platform of `device` (a
    deployment's: where it was written, the sites trained on theirs); a seeded run's not-private mark."""
    s = job.settings
    platform = numeric_platform(device)
    privacy = s.local.privacy
    mark = privacy.not_private_mark() if privacy is not None else None
    meta = ModelMeta(
        backbone=s.backbone,
        num_classes=len(job.classes),
        classes=job.classes,
        image_size=job.image_size,
        mean=list(s.local.mean),
        std=list(s.local.std),
        resize=job.resize,
        dataset=s.dataset,
        domains=job.domains,
        held_out_domain=job.target,
        held_out_index=job.index,
        algorithm=job.algorithm,
        seed=job.seed,
        hparams=hparams,
        params_hash=job.run_key,
        git_commit=job.commit,
        mlflow_run_id=job.mlflow_run_id,
        mlflow_experiment_id=job.mlflow_experiment_id,
        platform=DEPLOYED_PLATFORM.format(platform) if job.deployed else platform,
    )
    # a seeded run says so; other runs' meta has no privacy key (a record keeps only the keys it was given)
    return meta.model_copy(update={"privacy": mark}) if mark else meta


def seeded(job: TrainJob) -> bool:
    """train.privacy.noise_seed: the run's noise is seeded (not private), epsilon does not apply to it."""
    privacy = job.settings.local.privacy
    return privacy is not None and bool(privacy.not_private_mark())


def as_reported(job: TrainJob, rec: R) -> R:
    """A round record of `job` as the run reports it: a seeded run's has no epsilon (RoundRecord.without_epsilon)."""
    return rec.without_epsilon() if seeded(job) else rec


def privacy_summary(job: TrainJob, result: RunResult) -> RunPrivacySummary | None:
    """history.json's `dp` (contract.HISTORY_PRIVACY) of a DP run, None without DP: how its noise was drawn, the
    mark of a seeded run, the domains whose training images it trained on, and the releases its ledger charged
    (privacy/sweep_epsilon.py encode_releases), which the sweep's per-image epsilon composes."""
    privacy = job.settings.local.privacy
    if privacy is None or not privacy.enabled:
        return None
    from fedccrl_core.federation.history import RunPrivacySummary
    from fedccrl_core.privacy.sweep_epsilon import encode_releases

    mark = privacy.not_private_mark()
    optional = study_summary(Path(job.ckpt), privacy.delta)
    if mark:
        optional["mark"] = mark
    return RunPrivacySummary(
        noise=privacy.noise_source(),
        delta=privacy.delta,
        trained_domains=list(job.sources),
        releases=encode_releases(result.extra.get(contract.PRIVACY_RELEASES, [])),
        **optional,
    )


def study_summary(checkpoint: Path, delta: float) -> dict[str, Any]:
    """{study, study_epsilon} of the run whose round checkpoint is `checkpoint`, from the study ledger its pointer
    names (privacy/study_ledger.py); {} when it has none."""
    from fedccrl_core.privacy.study_ledger import read_pointer, read_study, study_epsilon

    pointer = read_pointer(checkpoint)
    if pointer is None:
        return {}
    _, entries = read_study(Path(pointer.ledger))
    return {"study": pointer.study, "study_epsilon": study_epsilon(entries, delta)}


def finish_run(job: TrainJob, model, hparams: dict, result: RunResult, device: str) -> RunHistory:
    """Write the run's folder job.out (complete or absent): its model files with their meta, its history (the
    records as reported) and privacy summary. Returns the history, typed."""
    meta = model_meta(job, hparams, device)
    records = [as_reported(job, rec) for rec in result.history]
    summary = privacy_summary(job, result)
    return write_run_folder(Path(job.out), model, meta, result, job.settings.local.rounds, records, summary)


def write_run_folder(
    out: Path,
    model,
    meta: ModelMeta,
    result: RunResult,
    rounds: int,
    records: list[RoundRecord] | None = None,
    privacy: RunPrivacySummary | None = None,
) -> RunHistory:
    """A trained run's folder, complete or absent (fsio.atomic_dir): MODEL_FILE (the final round's weights),
    BEST_FILE (the val-selected round's), HISTORY_FILE and HISTORY_CSV (`records`, default the result's round
    records, and the run's privacy summary). Returns the history, typed."""
    from fedccrl_core.federation.history import write_history
    from fedccrl_core.foundation.fsio import atomic_dir
    from fedccrl_core.learning.model_file import save_model

    # fedccrl_core.foundation.fsio: .<out>.tmp-<pid>-<token>, renamed into place when complete
    with atomic_dir(out) as tmp:
        model.load_state_dict(result.final_weights)
        save_model(tmp / contract.MODEL_FILE, model, meta.model_copy(update={"round": rounds}))
        model.load_state_dict(result.best_weights)
        save_model(tmp / contract.BEST_FILE, model, meta.model_copy(update={"round": result.best_round}))
        return write_history(tmp, meta, result.best_round, result.history if records is None else records, privacy)
