"""The records a model card is made from (`CardRecords`, which model_card.py renders), read and checked
before `fedccrl export` does any work: the run's history.json, the evaluate stage's result of the run
(contract.result_file under --results; absent: the card says its accuracy is the export's parity check only), the
training data (the shards' manifest, or a deployment's federation file with --federation) and its sha256, and the
sweep's ε per image from the MLflow parent run (only when the export logs to MLflow)."""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fedccrl_core.foundation import contract
from fedccrl_core.foundation.errors import DataError
from fedccrl_core.learning.model_meta import ModelMeta

if TYPE_CHECKING:
    from fedccrl_core.data.manifest import ShardManifest
    from fedccrl_core.federation.history import RunHistory
    from fedccrl_core.outcomes.evaluated import EvaluatedRun
    from fedccrl_core.outcomes.site_scores import SitesEvaluated
    from fedccrl_flower.sites import FederationFile
    from fedccrl_pipeline.checked_export import ExportParity


@dataclass(frozen=True)
class SweepEpsilon:
    """The sweep's ε per image (the MLflow parent's dp_epsilon_sweep_per_image), or why it is not known here."""

    value: float | None
    runs: int | None = None  # how many finished runs it composes
    why_not: str = ""


@dataclass(frozen=True)
class CardRecords:
    """What a card is made from: the exported model's meta, the run's history, the export's parity figures
    (parity.json's record, with the INT8 gate when the copy was written), the evaluate stage's result (None: `evaluated_note` says
    why), the training data (the research pipeline's shard manifest, or a deployment's federation file) and the
    dataset's hash, and the sweep's ε per image."""

    meta: ModelMeta
    history: RunHistory
    parity: ExportParity
    evaluated: EvaluatedRun | None
    evaluated_note: str  # where the result was read, or why there is none
    manifest: ShardManifest | None
    federation: FederationFile | None
    dataset_hash: tuple[str, str]  # (what was hashed, sha256)
    sweep: SweepEpsilon
    sites: SitesEvaluated | None = None  # `fedccrl evaluate-sites`' result of this model, if one ran


# what a run's records must agree on with the model they describe
SAME_RUN = ("dataset", "algorithm", "seed", "held_out_domain", "params_hash", "mlflow_run_id")


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass(frozen=True)
class CardSources:
    """Everything of a card but the model's meta and the export's parity figures (known after the export)."""

    history: RunHistory
    evaluated: EvaluatedRun | None
    evaluated_note: str
    manifest: ShardManifest | None
    federation: FederationFile | None
    dataset_hash: tuple[str, str]
    sweep: SweepEpsilon
    sites: SitesEvaluated | None = None

    def records(self, meta: ModelMeta, parity: ExportParity) -> CardRecords:
        s = self
        return CardRecords(
            meta,
            s.history,
            parity,
            s.evaluated,
            s.evaluated_note,
            s.manifest,
            s.federation,
            s.dataset_hash,
            s.sweep,
            s.sites,
        )


def _same_run(meta: ModelMeta, other: dict, where: Path) -> None:
    """DataError naming `where` when its record is of another run than the model's meta."""
    mine = meta.to_dict()
    differ = [k for k in SAME_RUN if k in other and other[k] is not None and mine.get(k) not in (None, other[k])]
    if differ:
        pairs = ", ".join(f"{k} {other[k]!r} (the model's: {mine.get(k)!r})" for k in differ)
        raise DataError(f"{where}: the record of another run than the model's: {pairs}")


def _evaluated(results: Path | None, run: Path, meta: ModelMeta):
    """The evaluate stage's result of `run` under `results`, or None and why (said on stderr too)."""
    if results is None:
        why = "no --results given"
    else:
        path = contract.result_file(results, run.parent.parent.parent, run)
        if path.is_file():
            from fedccrl_core.outcomes.evaluated import load_result

            result = load_result(path)
            _same_run(meta, result.to_dict(), path)
            return result, f"`{path}`"
        why = f"{path} not found"
    print(f"notice: model card: {why}; its accuracy is the export's parity check only", file=sys.stderr)
    return None, why


def sweep_epsilon(meta: ModelMeta, private: bool, use_mlflow: bool) -> SweepEpsilon:
    """The MLflow parent run's latest dp_epsilon_sweep_per_image (and how many runs it composes)."""
    if not private:
        return SweepEpsilon(None, why_not="not private")
    if not use_mlflow:
        return SweepEpsilon(None, why_not="the export ran without MLflow")
    if not meta.mlflow_run_id:
        return SweepEpsilon(None, why_not="the model records no MLflow run")
    from fedccrl_pipeline.mlflow_store import find_run, mlflow_module

    mlflow = mlflow_module()
    child = find_run(mlflow, meta.mlflow_run_id)
    parent_id = child.data.tags.get("mlflow.parentRunId") if child is not None else None
    parent = find_run(mlflow, parent_id) if parent_id else None
    metrics = parent.data.metrics if parent is not None else {}
    if contract.DP_EPSILON_SWEEP not in metrics:
        return SweepEpsilon(None, why_not=f"no {contract.DP_EPSILON_SWEEP} on the run's MLflow parent")
    runs = metrics.get(contract.DP_SWEEP_RUNS)  # run.data.metrics: each metric's latest step, the most complete
    return SweepEpsilon(metrics[contract.DP_EPSILON_SWEEP], int(runs) if runs is not None else None)


def _training_data(shards: Path | None, federation: Path | None, meta: ModelMeta):
    """(manifest, federation file, (what was hashed, its sha256)): a deployment's federation file when given, else
    the shards' manifest, which must hold a client of a training domain."""
    if federation is not None:
        from fedccrl_flower.sites import read_federation

        fed = read_federation(federation)
        _same_run(meta, {"dataset": fed.dataset}, federation)
        return None, fed, (f"the federation file {federation.name}", sha256_of(federation))
    from fedccrl_core.data.manifest import MANIFEST, load_manifest

    if shards is None:
        raise DataError("the model card's training data: give --shards (the run's partition) or --federation")
    manifest = load_manifest(shards)
    _same_run(meta, {"dataset": manifest.dataset}, shards / MANIFEST)
    if not any(c.domain != meta.held_out_domain for c in manifest.clients):
        raise DataError(
            f"{shards / MANIFEST}: no client of a training domain (only {meta.held_out_domain}): the shards are not "
            "the run's training data; for a deployment's export give --federation <federation file>"
        )
    return manifest, None, (f"the shard manifest {MANIFEST}", sha256_of(shards / MANIFEST))


def _sites_evaluated(path: Path, meta: ModelMeta) -> SitesEvaluated:
    """`fedccrl evaluate-sites`' result (sites.json, or its folder) of this model: DataError naming the file when it
    is another model's."""
    from fedccrl_core.outcomes.site_scores import load_scores

    path = path / "sites.json" if path.is_dir() else path
    result = load_scores(path)
    _same_run(meta, {"params_hash": result.run_key, "algorithm": result.algorithm}, path)
    _same_run(meta, {"held_out_domain": result.held_out_domain, "mlflow_run_id": result.mlflow_run_id}, path)
    return result


def read_sources(
    model_path: Path,
    shards: Path | None,
    results: Path | None,
    federation: Path | None,
    use_mlflow: bool,
    sites: Path | None = None,
) -> CardSources:
    """The card's records of the run whose model file is `model_path` (in its run folder beside history.json);
    `sites`: `fedccrl evaluate-sites`' result of the model (its sites.json or folder), if one ran."""
    from fedccrl_core.federation.history import load_history
    from fedccrl_core.learning.model_file import load_meta

    run = model_path.parent
    meta = load_meta(model_path)
    history = load_history(run)
    _same_run(meta, history.meta.to_dict(), run / contract.HISTORY_FILE)
    evaluated, note = _evaluated(results, run, meta)
    manifest, fed, dataset_hash = _training_data(shards, federation, meta)
    private = history.dp is not None and history.dp.mark is None and meta.privacy is None
    sweep = sweep_epsilon(meta, private, use_mlflow)
    evaluated_at_sites = _sites_evaluated(sites, meta) if sites is not None else None
    return CardSources(history, evaluated, note, manifest, fed, dataset_hash, sweep, evaluated_at_sites)
