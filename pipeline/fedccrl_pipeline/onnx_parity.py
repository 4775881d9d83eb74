"""The parity of an exported ONNX model with its PyTorch model: both run on the same normalized images of the
held-out domain (ONNX Runtime's CPU provider, the reference), compared by logits, top-1 agreement and accuracy."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedccrl_core.foundation.errors import FedCCRLError
from fedccrl_serving.metadata import INPUT_NAME, OUTPUT_NAME


class ParityError(FedCCRLError):
    """The ONNX model disagrees with the PyTorch model beyond the allowed tolerance."""


@dataclass(frozen=True)
class ParityFigures:
    """What `parity` measured on `n_images` images: the largest absolute logit difference, the top-1 agreement of
    the two models and, with labels, the accuracy of each (None without labels)."""

    n_images: int
    max_abs_logit_diff: float
    top1_agreement: float
    onnx_accuracy: float | None = None
    torch_accuracy: float | None = None


def cpu_session(path: str | Path, threads: int = 0):
    """An onnxruntime session on the CPU provider (the reference for parity, the INT8 gate and its bench); threads 0
    is onnxruntime's own choice."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = threads
    # its idle threads sleep rather than spin: the parity check runs beside other work (`fedccrl publish`)
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def parity(
    session, model, images_u8: np.ndarray, mean, std, labels: np.ndarray | None = None, batch_size: int = 256
) -> ParityFigures:
    """Run the ONNX session and the PyTorch model on the same normalized batches.

    images_u8: uint8 NHWC (the held-out domain's shard images). Returns the largest absolute logit
    difference, the top-1 agreement of the two, and (with labels) the accuracy of each.
    """
    import torch

    from fedccrl_core.learning.statistics import normalize_u8

    n = len(images_u8)
    if n == 0:
        raise FedCCRLError("parity: no images to compare on (the held-out domain is empty)")
    model = model.eval().cpu()
    max_diff, agree, correct_onnx, correct_torch = 0.0, 0, 0, 0
    for start in range(0, n, batch_size):
        x = normalize_u8(torch.from_numpy(np.ascontiguousarray(images_u8[start : start + batch_size])), mean, std)
        with torch.no_grad():
            ref = model(x).numpy()
        got = session.run([OUTPUT_NAME], {INPUT_NAME: x.numpy()})[0]
        max_diff = max(max_diff, float(np.abs(got.astype(np.float64) - ref).max()))
        top_onnx, top_torch = got.argmax(1), ref.argmax(1)
        agree += int((top_onnx == top_torch).sum())
        if labels is not None:
            y = np.asarray(labels[start : start + batch_size])
            correct_onnx += int((top_onnx == y).sum())
            correct_torch += int((top_torch == y).sum())
    if labels is None:
        return ParityFigures(n, max_diff, agree / n)
    return ParityFigures(n, max_diff, agree / n, correct_onnx / n, correct_torch / n)
