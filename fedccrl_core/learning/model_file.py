"""The trained-model file format shared by train, evaluate, export and serving.

A model file is written by `save_model` with torch.save:
    {"format": "fedccrl-model/1", "state_dict": {...}, "meta": {...}}
meta holds at least: backbone, num_classes, classes, image_size, mean, std, resize,
dataset, domains, held_out_domain, algorithm, seed, round, params_hash, git_commit.

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
from fedccrl_core.learning.models import FedModel, build_model

FORMAT = "fedccrl-model/1"
REQUIRED_META = ("backbone", "num_classes", "classes", "image_size", "mean", "std")


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


def save_model(path: str | Path, model: FedModel, meta: dict) -> None:
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise ValueError(f"save_model: meta lacks {missing}")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    atomic_torch_save({"format": FORMAT, "state_dict": state, "meta": dict(meta)}, path)


def _load(path: str | Path, map_location="cpu") -> dict:
    """A fedccrl model file's {"format", "state_dict", "meta"}; FedCCRLError naming the file otherwise."""
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
    return blob


def load_meta(path: str | Path) -> dict:
    """The meta of a model file (as load_model's), without building the model."""
    return _load(path)["meta"]


def load_model(path: str | Path, map_location: str = "cpu", builders: dict | None = None) -> tuple[FedModel, dict]:
    """Rebuild the FedModel (no pretrained download) and load its weights. Returns (model in eval mode, meta).

    `builders` maps an algorithm name to its `build_model` (an algorithm that adds modules knows its
    structure); `fedccrl_core.algorithms.load_model` passes the registry's. This module stays below the
    algorithms (docs/architecture.md, "Layers") and falls back to the plain f = g . h without them."""
    blob = _load(path, map_location)
    meta = blob["meta"]
    builder = (builders or {}).get(meta.get("algorithm"))
    if builder is not None:
        model = builder(meta["backbone"], int(meta["num_classes"]), "none", meta.get("hparams"))
    else:
        model = build_model(meta["backbone"], int(meta["num_classes"]), pretrained="none")
    model.load_state_dict(blob["state_dict"])
    model.eval()
    return model, meta
