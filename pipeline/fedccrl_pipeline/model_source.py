"""Which trained model a command means: a model file, a run folder (the train stage's or `fedccrl federate`'s:
model.pt beside history.json), or an export folder (`fedccrl export`: model.onnx), whose ONNX metadata leads to
its weights: its run key (params_hash) and round name the run folder under `--models` whose history has that run
key and whose model file holds that round. The ONNX file itself cannot stand in for the weights: the exporter
folds each BatchNorm into its convolution (onnx_export.py), and a site runs the torch model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedccrl_core.foundation import contract
from fedccrl_core.foundation.errors import DataError


@dataclass(frozen=True)
class ModelSource:
    model_file: Path  # the fedccrl model file (model_file.py), read with torch's weights-only unpickler
    run_dir: Path  # its run folder (history.json beside it)


def resolve_model(path: Path, models: Path | None) -> ModelSource:
    """The model file and run folder `path` means (a model file, a run folder or an export folder; an export's run
    is looked up under `models`); DataError naming the path and what is missing."""
    from fedccrl_pipeline.checked_export import ONNX_FILE

    if path.is_file():
        return ModelSource(path, path.parent)
    if (path / contract.MODEL_FILE).is_file():
        return ModelSource(path / contract.MODEL_FILE, path)
    if (path / ONNX_FILE).is_file():
        return _of_export(path / ONNX_FILE, models)
    raise DataError(
        f"{path}: neither a model file, a run folder ({contract.MODEL_FILE}) nor an export folder ({ONNX_FILE})"
    )


def _of_export(onnx_file: Path, models: Path | None) -> ModelSource:
    """The run folder under `models` whose history has the export's run key, and its model file of the export's
    round (model.pt, else best.pt)."""
    import onnx

    from fedccrl_core.federation.history import load_history
    from fedccrl_core.learning.model_file import load_meta
    from fedccrl_serving.metadata import parse_metadata

    meta = parse_metadata({p.key: p.value for p in onnx.load(str(onnx_file)).metadata_props}, str(onnx_file)).props
    run_key, rnd = meta.get("params_hash"), meta.get("round")
    if not run_key or rnd is None:
        raise DataError(f"{onnx_file}: its metadata has no run key (params_hash) and round to find its weights by")
    if models is None:
        raise DataError(f"{onnx_file}: an export; give --models, the folder of run folders its weights are in")
    runs = [h.parent for h in sorted(models.rglob(contract.HISTORY_FILE)) if _run_key(h, load_history) == run_key]
    if len(runs) != 1:
        found = ", ".join(map(str, runs)) or "none"
        raise DataError(f"{onnx_file}: run key {run_key}: {len(runs)} run folders under {models} have it ({found})")
    for name in (contract.MODEL_FILE, contract.BEST_FILE):
        f = runs[0] / name
        if f.is_file() and load_meta(f).round == int(rnd):
            return ModelSource(f, runs[0])
    raise DataError(f"{onnx_file}: no model file of round {rnd} in {runs[0]} (the run was trained again since?)")


def _run_key(history_file: Path, load_history) -> str | None:
    try:
        return load_history(history_file.parent).meta.params_hash
    except DataError:  # not a run's history: not this export's run
        return None
