"""`fedccrl export` with export.int8: a static INT8 copy of an exported ONNX model, and the gate it must pass.

ONNX Runtime's own static quantization (onnxruntime.quantization.quantize_static): QDQ format, weights int8 per
output channel, activations uint8 per tensor (the U8S8 pair that ONNX Runtime's x86 kernels run fastest), ranges
from MinMax calibration on source-domain training images of the shards: never the held-out domain, whose test
images then measure the copy. The copy is refused (Int8Refused, no file) when its held-out accuracy falls more
than `max_drop` points below the float32 model's. It sits beside the export as model.int8.onnx with the export's
metadata plus its precision and calibration (serving/fedccrl_serving/metadata.py).

Imports no torch: the inputs are normalized by serving's numpy transform (pinned to the training one).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedccrl_core.foundation.errors import FedCCRLError
from fedccrl_pipeline.onnx_parity import cpu_session
from fedccrl_serving.metadata import INPUT_NAME, INT8, OUTPUT_NAME, PRECISION_KEY, ServingMetadata, parse_metadata
from fedccrl_serving.preprocess import normalize

# params.yaml export.int8_* (pipeline/fedccrl_pipeline/params.py reads these defaults; so does `fedccrl export`)
MAX_DROP_POINTS = 1.0  # the copy is refused below float32's held-out accuracy minus this many points
CALIBRATION_IMAGES = 256  # source-domain training images that calibrate the activation ranges
CALIBRATION_BATCH = 16
QUANTIZATION = "onnxruntime quantize_static: QDQ, weights int8 per channel, activations uint8 per tensor, MinMax"


class Int8Refused(FedCCRLError):
    """The INT8 copy loses more held-out accuracy than export.int8_max_drop allows."""


@dataclass(frozen=True)
class Int8Figures:
    """The INT8 copy's gate (parity.json's "int8"): its file, both models' held-out accuracy on `n_images` images,
    the drop in points and the most allowed, what calibrated it, and its size in bytes."""

    file: str
    float32_accuracy: float
    int8_accuracy: float
    accuracy_drop_points: float
    max_drop_points: float
    calibration_images: int
    calibration_domains: tuple[str, ...]
    n_images: int
    bytes: int


@dataclass(frozen=True)
class Int8Settings:
    """export.int8_calibration_images and export.int8_max_drop (points of accuracy)."""

    calibration_images: int = CALIBRATION_IMAGES
    max_drop: float = MAX_DROP_POINTS


def calibration_set(shards: Path, held_out: str, n: int, private: bool = False) -> tuple[np.ndarray, list[str]]:
    """Up to n source-domain training images of the shards (uint8 NHWC), spread evenly over the source clients and
    over each one's rows, and the domains they come from. The held-out domain's rows are never read: its clients are
    skipped and a mixed client's rows of it dropped (load_client exclude_domain). For a model trained under
    train.privacy (`private`) their val rows instead: the INT8 copy's activation ranges are exact functions of the
    images they come from, and no run of the study trains on val rows (data/shards.py held_out_parts)."""
    from fedccrl_core.data.manifest import client_ids, domain_name, load_manifest
    from fedccrl_core.data.shards import load_client

    manifest = load_manifest(shards)
    name = domain_name(manifest, held_out)
    clients = client_ids(manifest, exclude_domain=name)
    if not clients:
        raise FedCCRLError(
            f"{shards}: no source-domain client to calibrate the INT8 model on (the shards hold only {name}); "
            "calibration never uses the held-out domain: give shards with the training domains"
        )
    entries = {c.id: c for c in manifest.clients}
    parts, domains = [], set()
    for i, cid in enumerate(clients):
        quota = n // len(clients) + (i < n % len(clients))
        shard = load_client(shards, cid, exclude_domain=name, mmap=True)
        pool = shard.val_x if private else shard.train_x
        if quota == 0 or len(pool) == 0:
            continue
        rows = np.unique(np.linspace(0, len(pool) - 1, min(quota, len(pool))).round().astype(np.int64))
        parts.append(np.asarray(pool[rows]))
        entry = entries[cid]
        counts = entry.train_domain_counts
        domains |= {d for d in counts if d != name} if counts is not None else {entry.domain}
    if not parts:
        what = "val" if private else "training"
        raise FedCCRLError(f"{shards}: the source-domain clients hold no {what} images to calibrate on")
    return np.concatenate(parts), sorted(domains)


class _Batches:
    """onnxruntime's CalibrationDataReader (a protocol: any object with get_next) over normalized uint8 images, CALIBRATION_BATCH at a time."""

    def __init__(self, images_u8: np.ndarray, meta: ServingMetadata):
        self.images, self.meta, self.start = images_u8, meta, 0

    def get_next(self) -> dict | None:
        if self.start >= len(self.images):
            return None
        chunk = self.images[self.start : self.start + CALIBRATION_BATCH]
        self.start += CALIBRATION_BATCH
        return {INPUT_NAME: normalize(chunk, self.meta)}


def read_metadata(path: Path) -> ServingMetadata:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return parse_metadata({p.key: p.value for p in proto.metadata_props}, str(path))


def quantize(float_path: Path, dest: Path, calibration_u8: np.ndarray, domains: list[str]) -> None:
    """The INT8 copy of `float_path` written to `dest` (the caller makes it atomic), calibrated on `calibration_u8`
    (source-domain images, uint8 NHWC), with the float model's metadata plus its precision and calibration."""
    import onnx
    import onnxruntime
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    meta = read_metadata(float_path)
    reader = _Batches(calibration_u8, meta)
    with tempfile.TemporaryDirectory(prefix="fedccrl-int8-") as tmp:
        prepared = Path(tmp) / "prepared.onnx"  # shapes inferred and the graph folded, as ONNX Runtime advises
        quant_pre_process(str(float_path), str(prepared))
        quantize_static(
            str(prepared),
            str(dest),
            reader,
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,  # MinMax keeps only each tensor's min and max per batch: small memory
        )
    proto = onnx.load(str(dest))
    props = dict(meta.props)
    props.update(
        {
            PRECISION_KEY: INT8,
            "quantization": f"{QUANTIZATION} (onnxruntime {onnxruntime.__version__})",
            "calibration_images": str(len(calibration_u8)),
            "calibration_domains": json.dumps(domains),
        }
    )
    del proto.metadata_props[:]
    for key, value in props.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    proto.doc_string = f"INT8 copy ({QUANTIZATION}) of {float_path.name}; see metadata_props"
    onnx.save(proto, str(dest))


def accuracy(session, images_u8: np.ndarray, labels: np.ndarray, meta: ServingMetadata, batch_size: int) -> float:
    """Top-1 accuracy of an ONNX session on uint8 NHWC images, normalized as fedccrl-serve does."""
    correct = 0
    for start in range(0, len(images_u8), batch_size):
        x = normalize(images_u8[start : start + batch_size], meta)
        logits = session.run([OUTPUT_NAME], {INPUT_NAME: x})[0]
        correct += int((logits.argmax(1) == labels[start : start + batch_size]).sum())
    return correct / len(images_u8)


def checked_int8(
    float_path: Path,
    dest: Path,
    shards: Path,
    held_out: str,
    test: tuple[np.ndarray, np.ndarray],
    settings: Int8Settings,
    batch_size: int,
    private: bool = False,
) -> Int8Figures:
    """Quantize `float_path` to `dest` and gate it on the held-out test images `test` (uint8 NHWC, labels): both
    models' accuracy there, the drop in points, and what calibrated it. Int8Refused when the drop passes
    settings.max_drop; the caller then writes neither file. `private`: the model trained under train.privacy
    (calibration_set)."""
    import sys

    x, y = test
    images, domains = calibration_set(shards, held_out, settings.calibration_images, private)
    if len(images) < settings.calibration_images:
        print(
            f"INT8: calibrating on {len(images)} images, all the source-domain {'val' if private else 'training'} images "
            f"(export.int8_calibration_images={settings.calibration_images})",
            file=sys.stderr,
        )
    quantize(float_path, dest, images, domains)
    meta = read_metadata(float_path)
    acc_f = accuracy(cpu_session(float_path), x, y, meta, batch_size)
    acc_i = accuracy(cpu_session(dest), x, y, meta, batch_size)
    drop = 100 * (acc_f - acc_i)
    result = Int8Figures(
        file=dest.name,
        float32_accuracy=acc_f,
        int8_accuracy=acc_i,
        accuracy_drop_points=drop,
        max_drop_points=settings.max_drop,
        calibration_images=len(images),
        calibration_domains=tuple(domains),
        n_images=len(x),
        bytes=dest.stat().st_size,
    )
    print(
        f"INT8 on {len(x)} {held_out} images: accuracy {100 * acc_i:.2f} % against float32's {100 * acc_f:.2f} % "
        f"(drop {drop:.2f} points; calibrated on {len(images)} images of {', '.join(domains)})",
        file=sys.stderr,
    )
    if drop > settings.max_drop:
        raise Int8Refused(
            f"INT8 model refused: held-out accuracy {100 * acc_i:.2f} % is {drop:.2f} points below float32's "
            f"{100 * acc_f:.2f} % on {len(x)} {held_out} images (export.int8_max_drop={settings.max_drop:g}); "
            "no model written"
        )
    return result
