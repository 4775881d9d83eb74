"""`fedccrl export`'s engine: a trained FedModel -> one ONNX file with the fedccrl metadata inside (the
format: serving/fedccrl_serving/metadata.py), and its parity with PyTorch on the held-out domain.

It imports torch (the exporter and the parity reference), so it lives here and not in the torch-free `serving`.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np

from fedccrl_core import __version__
from fedccrl_core.foundation.errors import FedCCRLError
from fedccrl_core.learning.model_file import ModelMeta
from fedccrl_serving.metadata import (
    FORMAT_KEY,
    FORMAT_VERSION,
    INPUT_NAME,
    INT_KEYS,
    JSON_KEYS,
    OUTPUT_NAME,
    REQUIRED_KEYS,
    TEXT_KEYS,
)

# an export's folder: the model and its parity figures (export_checked)
ONNX_FILE, PARITY_FILE = "model.onnx", "parity.json"

# protobuf cannot serialize one message of 2 GiB or more; a single-file ONNX must stay below it.
MAX_ONNX_BYTES = 2**31 - 1


class ParityError(FedCCRLError):
    """The ONNX model disagrees with the PyTorch model beyond the allowed tolerance."""


def metadata_props(meta: ModelMeta) -> dict[str, str]:
    """The model file's meta (fedccrl_core.learning.model_file) -> the string key/values stored in the ONNX file
    (serving/fedccrl_serving/metadata.py names the meta fields each is written from)."""
    values = {k: getattr(meta, k, None) for k in (*REQUIRED_KEYS, *JSON_KEYS, *INT_KEYS, *TEXT_KEYS)}  # its fields
    missing = [k for k in REQUIRED_KEYS if values.get(k) is None]
    if missing:
        raise FedCCRLError(f"model meta lacks {', '.join(missing)}: cannot write the serving preprocessing")
    if len(meta.classes) != meta.num_classes:
        raise FedCCRLError(f"model meta: {len(meta.classes)} class names for num_classes={meta.num_classes}")
    import torch

    props = {FORMAT_KEY: str(FORMAT_VERSION), "fedccrl_version": __version__, "torch_version": torch.__version__}
    for key in JSON_KEYS:
        if values.get(key) is not None:
            props[key] = json.dumps(values[key])
    for key in INT_KEYS:
        if values.get(key) is not None:
            props[key] = str(values[key])
    for key in TEXT_KEYS:
        if values.get(key) is not None:
            props[key] = str(values[key])
    return props


def _architecture(model, meta: ModelMeta) -> tuple:
    """What fixes the exported graph of a model: its modules with their settings (the module tree as PyTorch prints
    it: types, kernel sizes, strides, eps, ...), every state entry's name, shape and dtype, and the input size. Two
    models of one architecture differ only in the values of their weights."""
    return (
        repr(model),
        tuple((k, tuple(v.shape), str(v.dtype)) for k, v in model.state_dict().items()),
        meta.image_size,
    )


def _trace(model, size: int, example_batch: int):
    """torch's dynamo exporter on `model`, unoptimized: the graph (an onnx_ir Model), whose initializers are the model's
    parameters and buffers under their state_dict names. The batch axis is dynamic (torch.export.Dim); the example
    batch has >= 2 images so the exporter cannot specialize it to 1."""
    import torch

    example = torch.randn(example_batch, 3, size, size, generator=torch.Generator().manual_seed(0))
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        program = torch.onnx.export(
            model,
            (example,),
            None,
            dynamo=True,
            external_data=False,
            verbose=False,
            optimize=False,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_shapes=({0: batch},),
        )
    assert program is not None  # dynamo=True returns the ONNXProgram
    return program.model


def _program_with_weights(traced, model, own_trace: bool):
    """The traced graph with `model`'s weights as its initializers, then the exporter's own optimization
    (ONNXProgram.optimize: constant folding, which folds each BatchNorm into its convolution from these weights).
    A graph traced from another model that holds an initializer which is no state entry (a constant of that
    trace) is not reused: None."""
    import onnx_ir as ir
    import torch

    graph = traced.clone()  # the trace itself stays as traced, for the next model
    state = model.state_dict()
    if not own_trace and any(name not in state for name in graph.graph.initializers):
        return None
    for name, value in graph.graph.initializers.items():
        if name not in state:
            continue
        weights = state[name].detach().cpu().numpy()
        if tuple(value.shape) != weights.shape or value.dtype != ir.DataType.from_numpy(weights.dtype):
            raise FedCCRLError(
                f"ONNX export: initializer {name} is {value.dtype} {tuple(value.shape)} in the traced "
                f"graph, {weights.dtype} {weights.shape} in the model"
            )
        value.const_value = ir.Tensor(weights, name=name)
    program = torch.onnx.ONNXProgram(graph, None)
    program.optimize()
    return program


def export_onnx(model, meta: ModelMeta, dest: str | Path, example_batch: int = 2, traces: dict | None = None) -> Path:
    """Export `model` with torch's dynamo exporter to ONE self-contained .onnx at `dest`.

    The graph is traced unoptimized, the model's weights are put in as its initializers, and then optimized as
    torch.onnx.export(optimize=True) does. `traces`, a dict the caller keeps across models, holds one trace per
    architecture (`_architecture`): a further model of an architecture already traced reuses that trace with its
    own weights, which is the same graph as tracing it again (up to the names of intermediate values:
    tests/test_export.py) at a twentieth of the time. The file is checked with onnx.checker (full check) after
    writing. Not atomic: the caller writes to a temp name.
    """
    import onnx

    if example_batch < 2:
        raise ValueError("export_onnx: example_batch must be >= 2 (a batch of 1 gets specialized)")
    props = metadata_props(meta)
    model = model.eval().cpu()
    arch = _architecture(model, meta)
    traced = traces.get(arch) if traces is not None else None
    program = _program_with_weights(traced, model, own_trace=False) if traced is not None else None
    if program is None:
        traced = _trace(model, meta.image_size, example_batch)
        program = _program_with_weights(traced, model, own_trace=True)
        if traces is not None:
            traces[arch] = traced
    proto = program.model_proto
    del proto.metadata_props[:]
    for key, value in props.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    proto.doc_string = (
        f"fedccrl {meta.algorithm or '?'} model ({meta.backbone}), "
        f"held-out domain {meta.held_out_domain or '?'}; see metadata_props"
    )
    nbytes = proto.ByteSize()
    if nbytes >= MAX_ONNX_BYTES:
        raise FedCCRLError(f"ONNX model is {nbytes / 2**30:.2f} GiB: a single-file ONNX must be < 2 GiB")
    dest = Path(dest)
    with open(dest, "wb") as f:
        f.write(proto.SerializeToString())
    onnx.checker.check_model(str(dest), full_check=True)
    return dest


def cpu_session(path: str | Path):
    """An onnxruntime session on the CPU provider (the reference for parity)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # its idle threads sleep rather than spin: the parity check runs beside other work (`fedccrl publish`)
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def parity(
    session, model, images_u8: np.ndarray, mean, std, labels: np.ndarray | None = None, batch_size: int = 256
) -> dict:
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
    result = {"n_images": n, "max_abs_logit_diff": max_diff, "top1_agreement": agree / n}
    if labels is not None:
        result.update(onnx_accuracy=correct_onnx / n, torch_accuracy=correct_torch / n)
    return result


def example_images(images_u8: np.ndarray) -> np.ndarray:
    """The input example logged with the MLflow model: the first two images of the held-out domain."""
    return np.ascontiguousarray(images_u8[:2])


def _remove(paths) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def _all_or_none(outputs):
    """Outputs that appear together or not at all: each one already in place is removed when the body fails."""
    try:
        yield
    except BaseException:
        _remove(outputs)
        raise


def export_checked(
    model_path: Path,
    shards: Path,
    out: Path,
    min_agreement: float,
    batch_size: int,
    publish=None,
    traces: dict | None = None,
    int8=None,
    *,
    card_maker,
) -> dict:
    """A trained model -> out/model.onnx + out/parity.json + out/MODEL_CARD.md (`fedccrl export`). Parity is
    measured on every image of the held-out domain (ONNX Runtime CPU vs PyTorch); below `min_agreement` a
    ParityError, and no output. Outputs appear only on success: the card and parity.json first, then model.onnx
    renamed from a temp name, so a model.onnx is always complete; stale outputs of an earlier export are removed
    before anything else happens, and those in place when a later step fails are removed again.
    card_maker(model_path) reads the model card's records before any work (an error there leaves no output) and
    returns card(meta, result) -> the card's text (model_card.py), made after the checks passed and written with
    the outputs; publish(onnx_path, meta, result, example_u8, card_text), if given, runs after it and
    before the outputs appear (the stage logs the model to MLflow there). `traces`: as export_onnx's.
    int8 (quantize.Int8Settings), if given: also out/model.int8.onnx, calibrated on the shards' source domains and
    gated on the held-out images after the parity check (quantize.checked_int8; its figures under parity.json's
    "int8"); a refused copy (Int8Refused) leaves no output, as a failed parity check does."""
    import sys

    from fedccrl_core.algorithms import load_model
    from fedccrl_core.data.shards import load_domain_test
    from fedccrl_core.foundation import contract
    from fedccrl_core.foundation.fsio import atomic_path, write_text
    from fedccrl_serving.metadata import card_path, int8_path

    final_onnx, final_parity, final_card = out / ONNX_FILE, out / PARITY_FILE, card_path(out / ONNX_FILE)
    outputs = (final_onnx, final_parity, int8_path(final_onnx), final_card)
    _remove(outputs)  # as DVC does: a failed export leaves no earlier output behind
    if model_path.is_dir():
        model_path = model_path / contract.MODEL_FILE
    card = card_maker(model_path)
    model, meta = load_model(model_path)
    meta.require(model_path, "held_out_domain")
    x, y = load_domain_test(shards, meta.held_out_domain)
    if x.shape[1:] != (meta.image_size, meta.image_size, 3):
        raise ValueError(
            f"{shards}: held-out images are {x.shape[1:]}, the model expects "
            f"{meta.image_size}x{meta.image_size}x3 (shards from another image size?)"
        )
    # renamed to model.onnx after the card and parity.json (and model.int8.onnx, when asked for) are written; a
    # failure on the way removes those already in place (_all_or_none)
    with _all_or_none(outputs), atomic_path(final_onnx) as tmp_onnx, contextlib.ExitStack() as int8_out:
        export_onnx(model, meta, tmp_onnx, traces=traces)
        session = cpu_session(tmp_onnx)
        result = parity(session, model, x, meta.mean, meta.std, labels=y, batch_size=batch_size)
        result.update(
            min_agreement=min_agreement, held_out_domain=meta.held_out_domain, onnx_bytes=tmp_onnx.stat().st_size
        )
        print(
            f"parity on {result['n_images']} {meta.held_out_domain} images: top-1 agreement "
            f"{result['top1_agreement']:.6f}, max |logit diff| {result['max_abs_logit_diff']:.3g}",
            file=sys.stderr,
        )
        if result["top1_agreement"] < min_agreement:
            raise ParityError(
                f"ONNX/PyTorch top-1 agreement {result['top1_agreement']:.6f} < --min-agreement {min_agreement} "
                f"on {result['n_images']} images (max |logit diff| {result['max_abs_logit_diff']:.3g}); "
                "no model.onnx written"
            )
        if int8 is not None:
            from fedccrl_pipeline.quantize import checked_int8

            tmp_int8 = int8_out.enter_context(atomic_path(int8_path(final_onnx)))
            assert meta.held_out_domain is not None  # require() raised otherwise
            result["int8"] = checked_int8(tmp_onnx, tmp_int8, shards, meta.held_out_domain, (x, y), int8, batch_size)
            result["int8"]["file"] = int8_path(final_onnx).name  # not the temporary name it was written under
        text = card(meta, result)
        if publish is not None:
            publish(tmp_onnx, meta, result, example_images(x), text)
        write_text(final_card, text)
        write_text(final_parity, json.dumps(result, indent=1) + "\n")
    print(f"wrote {final_onnx} ({result['onnx_bytes'] / 1e6:.1f} MB), {final_parity} and {final_card}", file=sys.stderr)
    if int8 is not None:
        print(f"wrote {int8_path(final_onnx)} ({int8_path(final_onnx).stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return result
