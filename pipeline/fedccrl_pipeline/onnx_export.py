"""The ONNX exporter: a trained FedModel -> one ONNX file with the fedccrl metadata inside (the format:
serving/fedccrl_serving/metadata.py). Its parity with PyTorch is onnx_parity.py; `fedccrl export`'s checked export,
both together with the outputs written whole, is checked_export.py.

It imports torch (the exporter traces the model), so it lives here and not in the torch-free `serving`.
"""

from __future__ import annotations

import json
from pathlib import Path

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

# protobuf cannot serialize one message of 2 GiB or more; a single-file ONNX must stay below it.
MAX_ONNX_BYTES = 2**31 - 1


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
