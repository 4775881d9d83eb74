"""The ONNX Runtime side of serving: a fedccrl export loaded and checked against its metadata, the execution
providers (CUDA when asked and usable, else the CPU), and class probabilities for batches of image files."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedccrl_serving.console import Fatal, note
from fedccrl_serving.metadata import (
    INPUT_NAME,
    INT8,
    OUTPUT_NAME,
    NotAFedccrlModel,
    check_graph,
    int8_path,
    parse_metadata,
)
from fedccrl_serving.preprocess import check_resize_policy, preprocess_files


def model_file(path: Path, int8: bool) -> Path:
    """The file `fedccrl-serve` loads: MODEL itself, or with --int8 its INT8 copy beside it (model.int8.onnx)."""
    if not int8:
        return path
    found = int8_path(path)
    if not found.exists() and path.exists():
        raise Fatal(
            f"{found}: no INT8 model beside {path} (export it with params export.int8: true, or "
            "`fedccrl export ... --int8 true`)"
        )
    return found


class ServedModel:
    """An onnxruntime session of a fedccrl export plus its metadata (the only source of preprocessing).
    int8: the file must be an INT8 copy (its metadata says precision int8)."""

    def __init__(self, path: Path, device: str = "auto", int8: bool = False):
        import onnxruntime as ort

        if not path.is_file():
            raise Fatal(f"{path}: model file not found" if not path.exists() else f"{path}: not a file")
        ort.set_default_logger_severity(3)
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        requested = _providers(device)
        try:
            self.session = ort.InferenceSession(str(path), sess_options=opts, providers=requested)
        except Exception as e:  # onnxruntime raises its own exception types
            first = (str(e).splitlines() or [e.__class__.__name__])[0][:200]
            raise NotAFedccrlModel(f"{path}: not a readable ONNX model ({first})") from e
        self.meta = parse_metadata(self.session.get_modelmeta().custom_metadata_map, str(path))
        check_resize_policy(self.meta, str(path))
        if int8 and self.meta.precision != INT8:
            raise NotAFedccrlModel(f"{path}: --int8, but the file's metadata says precision {self.meta.precision}")
        names_in = [i.name for i in self.session.get_inputs()]
        names_out = [o.name for o in self.session.get_outputs()]
        if names_in != [INPUT_NAME] or OUTPUT_NAME not in names_out:
            raise NotAFedccrlModel(
                f"{path}: expected input '{INPUT_NAME}' and output '{OUTPUT_NAME}', "
                f"found inputs {names_in} outputs {names_out}"
            )
        self.input_name, self.output_name = INPUT_NAME, OUTPUT_NAME
        out_shape = next(o.shape for o in self.session.get_outputs() if o.name == OUTPUT_NAME)
        check_graph(self.meta, self.session.get_inputs()[0].shape, out_shape, str(path))
        self.path = path
        used = self.session.get_providers()
        if "CUDAExecutionProvider" in requested and "CUDAExecutionProvider" not in used:
            note(f"--device {device}: onnxruntime could not start CUDAExecutionProvider; falling back to CPU")
        self.device = "cuda" if "CUDAExecutionProvider" in used else "cpu"

    def logits(self, x: np.ndarray) -> np.ndarray:
        if len(x) == 0:
            return np.zeros((0, len(self.meta.classes)), np.float32)
        out = self.session.run([self.output_name], {self.input_name: x})[0]
        if out.ndim != 2 or out.shape[1] != len(self.meta.classes):
            raise Fatal(
                f"{self.path}: the model returned logits of shape {list(out.shape)} for "
                f"{len(self.meta.classes)} class names in its metadata"
            )
        return out


def _providers(device: str) -> list[str]:
    """CUDA first when asked (or auto) and usable; otherwise CPU, with a notice when cuda was asked for."""
    import onnxruntime as ort

    if device == "cpu":
        return ["CPUExecutionProvider"]
    reason = None
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        reason = "this onnxruntime build has no CUDAExecutionProvider"
    elif not _cuda_driver_present():
        reason = "no CUDA driver (libcuda.so.1) on this machine"
    if reason is None:
        try:  # onnxruntime-gpu finds the CUDA/cuDNN libraries of the nvidia-* wheels this way
            ort.preload_dlls()
        except Exception:  # older builds lack it; the session falls back by itself
            pass
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if device == "cuda":
        note(f"--device cuda: {reason}; falling back to CPU")
    return ["CPUExecutionProvider"]


def _cuda_driver_present() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = np.exp(z - z.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def predict_paths(model: ServedModel, paths: list[Path], batch_size: int, workers: int, quiet: bool):
    """Yield (path, probabilities or None, error or None) for every path, in order, batch by batch."""
    done = 0
    for start in range(0, len(paths), batch_size):
        chunk = paths[start : start + batch_size]
        x, good, errors = preprocess_files(chunk, model.meta, workers)
        probs = dict(zip(good, softmax(model.logits(x)))) if good else {}
        for i, p in list(probs.items()):
            if not np.isfinite(p).all():  # NaN/inf weights or inputs: an error record, never "score": NaN
                del probs[i]
                errors[i] = "the model returned non-finite scores (NaN or inf) for this image"
        for i, path in enumerate(chunk):
            yield path, probs.get(i), errors.get(i)
        done += len(chunk)
        if not quiet:
            note(f"{done}/{len(paths)} images")
