"""The trained-model file format shared by train, evaluate, export and serving.

A model file is written by `save_model` with torch.save:
    {"format": "fedccrl-model/1", "state_dict": {...}, "meta": {...}}
meta is a `ModelMeta` (backbone, num_classes, classes, image_size, mean, std required; a training run also
writes resize, dataset, domains, held_out_domain, algorithm, seed, round, params_hash, git_commit, ...), checked
when the file is read (`load_meta`, `load_model`).

Every torch file of the project (model files, round checkpoints, the Flower result) holds tensors and
plain data only (dict, list, tuple, str, int, float, bool, None) and is read by `torch_load`, with
torch's weights-only unpickler: a model file comes from anyone who can hand one over, and a full
unpickler runs whatever code its pickle names.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from fedccrl_core.foundation.errors import FedCCRLError, UntrustedFileError
from fedccrl_core.foundation.fsio import atomic_file
from fedccrl_core.foundation.records import parse_record
from fedccrl_core.learning.model_meta import ModelMeta
from fedccrl_core.learning.models import FedModel, build_model

FORMAT = "fedccrl-model/1"


def atomic_torch_save(obj, path: str | Path) -> None:
    """torch.save through fedccrl_core.foundation.fsio.atomic_file: never a half-written file."""
    with atomic_file(path, "wb") as f:
        torch.save(obj, f)


def torch_load(path: str | Path, map_location="cpu"):
    """torch.load of tensors and plain data only: no pickled code runs. A file that names any other object
    raises UntrustedFileError naming the file and those objects; an unreadable one raises as torch does."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # not a zip-format torch file: an unreadable one, reported as such
            unsafe = []
        if unsafe:
            raise UntrustedFileError(
                f"{path}: refused: it holds objects other than tensors and plain data "
                f"({', '.join(unsafe[:5])}); nothing in it was loaded or run"
            ) from e
        raise


def save_model(path: str | Path, model: FedModel, meta: ModelMeta) -> None:
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    atomic_torch_save({"format": FORMAT, "state_dict": state, "meta": meta.to_dict()}, path)


def _load(path: str | Path, map_location="cpu") -> tuple[dict[str, torch.Tensor], ModelMeta]:
    """A fedccrl model file's state dict and meta; FedCCRLError naming the file (and the meta's field) otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FedCCRLError(f"{path}: model file not found")
    try:
        blob = torch_load(path, map_location)
    except UntrustedFileError:
        raise
    except Exception as e:
        raise FedCCRLError(f"{path}: not a readable fedccrl model file ({e.__class__.__name__})") from e
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise FedCCRLError(f"{path}: not a fedccrl model file (expected format {FORMAT})")
    if not isinstance(blob.get("state_dict"), dict):
        raise FedCCRLError(f"{path}: not a fedccrl model file (no state_dict)")
    return blob["state_dict"], parse_record(ModelMeta, blob.get("meta"), f"{path}: meta")


def load_meta(path: str | Path) -> ModelMeta:
    """The meta of a model file (as load_model's), without building the model."""
    return _load(path)[1]


def load_model(path: str | Path, map_location: str = "cpu", builders: dict | None = None) -> tuple[FedModel, ModelMeta]:
    """Rebuild the FedModel (no pretrained download) and load its weights. Returns (model in eval mode, meta).

    `builders` maps an algorithm name to its `build_model` (an algorithm that adds modules knows its
    structure); `fedccrl_core.algorithms.load_model` passes the registry's. This module stays below the
    algorithms (docs/architecture.md, "Layers") and falls back to the plain f = g . h without them."""
    state, meta = _load(path, map_location)
    builder = (builders or {}).get(meta.algorithm)
    if builder is not None:
        model = builder(meta.backbone, meta.num_classes, "none", meta.hparams)
    else:
        model = build_model(meta.backbone, meta.num_classes, pretrained="none")
    model.load_state_dict(state)
    model.eval()
    return model, meta
