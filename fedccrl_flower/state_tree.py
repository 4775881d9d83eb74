"""A client's state between rounds (ClientState: optimizer, scheduler, extra), a nested structure of dicts, lists,
tuples, scalars, tensors and ndarrays, as numbered arrays plus a JSON skeleton that points at them: in Flower's
Context.state as records (`pack_tree`), on disk as an npz (client_state.py). No pickle anywhere."""

from __future__ import annotations

import json

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord


def encode_tree(tree) -> tuple[dict[str, np.ndarray], str]:
    """A nested structure of dicts (any scalar keys), lists, tuples, scalars, tensors and ndarrays as
    numbered arrays plus a JSON skeleton that points at them (no pickle anywhere)."""
    arrays: dict[str, np.ndarray] = {}

    def enc(x):
        if isinstance(x, torch.Tensor):
            key = str(len(arrays))
            t = x.detach().cpu()
            if t.dtype == torch.bfloat16:
                arrays[key] = t.view(torch.int16).numpy().copy()
                return {"__tensor__": key, "bf16": True}
            arrays[key] = t.contiguous().numpy()
            return {"__tensor__": key}
        if isinstance(x, np.ndarray):
            if x.dtype.kind not in "biufU":
                raise TypeError(f"encode_tree: cannot store an array of dtype {x.dtype}")
            key = str(len(arrays))
            arrays[key] = np.ascontiguousarray(x)
            return {"__ndarray__": key}
        if isinstance(x, dict):
            return {"__dict__": [[enc(k), enc(v)] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"__tuple__": [enc(v) for v in x]}
        if isinstance(x, list):
            return [enc(v) for v in x]
        if isinstance(x, (np.integer, np.floating, np.bool_)):
            return x.item()
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"encode_tree: cannot store a {type(x).__name__} in the client state")

    skeleton = json.dumps(enc(tree))
    return arrays, skeleton


def decode_tree(arrays, skeleton: str):
    """Inverse of encode_tree; `arrays` maps keys to ndarrays (or to Flower Arrays)."""

    def arr(key):
        a = arrays[key]
        return np.array(a.numpy() if isinstance(a, Array) else a, copy=True)

    def dec(x):
        if isinstance(x, list):
            return [dec(v) for v in x]
        if isinstance(x, dict):
            if "__tensor__" in x:
                t = torch.from_numpy(arr(x["__tensor__"]))
                return t.view(torch.bfloat16) if x.get("bf16") else t
            if "__ndarray__" in x:
                return arr(x["__ndarray__"])
            if "__tuple__" in x:
                return tuple(dec(v) for v in x["__tuple__"])
            if "__dict__" in x:
                return {dec(k): dec(v) for k, v in x["__dict__"]}
            raise ValueError(f"decode_tree: unknown node {sorted(x)}")
        return x

    return dec(json.loads(skeleton))


def pack_tree(tree) -> tuple[ArrayRecord, ConfigRecord]:
    """encode_tree as Flower records, for Context.state."""
    arrays, skeleton = encode_tree(tree)
    return ArrayRecord({k: Array(v) for k, v in arrays.items()}), ConfigRecord({"tree": skeleton})


def unpack_tree(arrays: ArrayRecord, config: ConfigRecord):
    return decode_tree(dict(arrays.items()), str(config["tree"]))
