"""The fedccrl metadata of an exported ONNX file: what serving reads, torch-free.

Contract of an exported file (fedccrl_format=1):
- one self-contained .onnx (weights inline, no side .data file), opset from torch's dynamo exporter
  (pipeline/fedccrl_pipeline/onnx_export.py writes it);
- input `images`: float32 [N, 3, S, S], already normalized: (u8 / 255 - mean) / std after the
  training eval resize; N is dynamic;
- output `logits`: float32 [N, num_classes];
- `metadata_props` (all strings): `fedccrl_format`, the preprocessing (image_size, mean, std,
  resize), the class names, and where the model came from (dataset, held-out domain, algorithm,
  seed, params hash, git commit, ...). Serving reads only these, never a config file.

An INT8 copy (`fedccrl export` with export.int8; pipeline/fedccrl_pipeline/quantize.py writes it) sits beside its
float32 export as model.int8.onnx (`int8_path`): the same input, output and metadata, plus `precision` = int8,
how it was quantized, and the count and domains of its calibration images. A float32 export has no `precision`.

Beside them, the model card (`card_path`, CARD_FILE): the model card `fedccrl export` generates from the run's records.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fedccrl_core.foundation.errors import FedCCRLError

FORMAT_KEY = "fedccrl_format"
FORMAT_VERSION = 1
INPUT_NAME = "images"
OUTPUT_NAME = "logits"

# How each metadata value is written: JSON for lists, decimal for ints, the text itself otherwise.
JSON_KEYS = ("classes", "mean", "std", "domains", "calibration_domains")
INT_KEYS = ("num_classes", "image_size", "seed", "round", "held_out_index", "calibration_images")
TEXT_KEYS = (
    "resize",
    "backbone",
    "dataset",
    "held_out_domain",
    "algorithm",
    "params_hash",
    "git_commit",
    "mlflow_run_id",
    "mlflow_experiment_id",
    "privacy",  # "not private (noise_seed)" on a model whose DP noise was seeded (fedccrl_core/privacy/settings.py)
    "precision",  # PRECISION_KEY: "int8" in an INT8 copy; absent (float32) in an export
    "quantization",  # an INT8 copy: how it was quantized (format, granularity, calibration method, onnxruntime)
)
REQUIRED_KEYS = ("classes", "num_classes", "image_size", "mean", "std", "resize")

PRECISION_KEY, FLOAT32, INT8 = "precision", "float32", "int8"
INT8_SUFFIX = ".int8.onnx"


CARD_FILE = "MODEL_CARD.md"  # an export's model card (pipeline/fedccrl_pipeline/model_card.py), beside model.onnx


def card_path(path: Path) -> Path:
    """The model card of an export (or of its INT8 copy): CARD_FILE in the model's folder."""
    return path.with_name(CARD_FILE)


def int8_path(path: Path) -> Path:
    """The INT8 copy of an export, beside it: model.onnx -> model.int8.onnx (an INT8 file names itself)."""
    if path.name.endswith(INT8_SUFFIX):
        return path
    stem = path.name[: -len(".onnx")] if path.name.endswith(".onnx") else path.name
    return path.with_name(stem + INT8_SUFFIX)


class NotAFedccrlModel(FedCCRLError):
    """An ONNX file without the fedccrl metadata contract (or unreadable as ONNX)."""


@dataclass(frozen=True)
class ServingMetadata:
    """What serving needs from an exported file; `props` keeps every stored key for `info`."""

    classes: tuple[str, ...]
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resize: str
    props: Mapping[str, str]

    @property
    def precision(self) -> str:
        """int8 for an INT8 copy, float32 for an export (which records none)."""
        return self.props.get(PRECISION_KEY, FLOAT32)

    def as_dict(self) -> dict:
        """Every stored key, decoded (JSON lists as lists, ints as ints)."""
        out = {}
        for key, value in sorted(self.props.items()):
            if key in JSON_KEYS:
                out[key] = json.loads(value)
            elif key in INT_KEYS or key == FORMAT_KEY:
                out[key] = int(value)
            else:
                out[key] = value
        return out


def parse_metadata(props: Mapping[str, str], source: str) -> ServingMetadata:
    """Validate the metadata of an ONNX file; raise NotAFedccrlModel naming `source` if it is not ours."""
    if FORMAT_KEY not in props:
        raise NotAFedccrlModel(f"{source}: an ONNX model but not a fedccrl export (no '{FORMAT_KEY}' metadata)")
    if props[FORMAT_KEY] != str(FORMAT_VERSION):
        raise NotAFedccrlModel(
            f"{source}: {FORMAT_KEY}={props[FORMAT_KEY]!r}, but this fedccrl-serve reads format {FORMAT_VERSION}"
        )
    try:
        missing = [k for k in REQUIRED_KEYS if k not in props]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        classes = tuple(str(c) for c in json.loads(props["classes"]))
        mean = tuple(float(v) for v in json.loads(props["mean"]))
        std = tuple(float(v) for v in json.loads(props["std"]))
        size = int(props["image_size"])
        if len(classes) != int(props["num_classes"]) or not classes:
            raise ValueError(f"{len(classes)} class names for num_classes={props['num_classes']}")
        twice = sorted({c for c in classes if classes.count(c) > 1})
        if twice:
            raise ValueError(f"class names must be unique; repeated: {', '.join(map(repr, twice))}")
        if len(mean) != 3 or len(std) != 3 or size <= 0:
            raise ValueError("mean/std must be 3 values each and image_size > 0")
        if not all(math.isfinite(v) for v in mean + std) or min(std) <= 0:
            raise ValueError(f"mean {list(mean)} and std {list(std)} must be finite numbers, std > 0")
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise NotAFedccrlModel(f"{source}: broken fedccrl metadata ({e})") from e
    return ServingMetadata(classes, size, mean, std, props["resize"], dict(props))


def check_graph(meta: ServingMetadata, input_shape: list, output_shape: list, source: str) -> None:
    """The metadata must describe the graph it sits in: input [N, 3, S, S] with S = image_size, and one
    logit per class name. A dimension the graph leaves symbolic (the batch) is not checked here; the
    logit count is checked again on every batch (fedccrl_serving.runtime.ServedModel.logits)."""

    def fixed(dim):
        return dim if isinstance(dim, int) and dim > 0 else None

    size = meta.image_size
    if len(input_shape) != 4 or any(fixed(d) not in (None, want) for d, want in zip(input_shape[1:], (3, size, size))):
        raise NotAFedccrlModel(
            f"{source}: the metadata says image_size={size} (input [N, 3, {size}, {size}]), but the "
            f"graph's input '{INPUT_NAME}' is {list(input_shape)}"
        )
    k = len(meta.classes)
    if len(output_shape) != 2 or fixed(output_shape[1]) not in (None, k):
        raise NotAFedccrlModel(
            f"{source}: the metadata names {k} classes, but the graph's output '{OUTPUT_NAME}' is {list(output_shape)}"
        )
