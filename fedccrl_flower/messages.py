"""What travels between the ServerApp and the ClientApps, defined once for both sides.

Message types (Flower's): QUERY asks a client for its upload (Algorithm 1 lines 3-6; FedCCRL's F_i,
Eq. 8), TRAIN sends it the global weights and its payload (line 7; FedCCRL's F_pool minus F_i)
and returns its local weights, n_i and metrics (lines 8-22), EVALUATE sends a site the aggregated
weights (after line 23) and returns its evaluation counts (evalsets.py).

Record keys (RecordDict content):
    QUERY  server -> client   CONFIG (ConfigRecord; under train.privacy.max_epsilon with CHARGED)
           client -> server   INFO (ConfigRecord: client id, n_i), UPLOAD (ArrayRecord, absent if None); or a
                              refusal: INFO (client id, REFUSAL, and n_i when its size exceeds CHARGED's ratio)
    TRAIN  server -> client   CONFIG, WEIGHTS (ArrayRecord), PAYLOAD (ArrayRecord, absent if None)
           client -> server   INFO, WEIGHTS, METRICS (MetricRecord)
    EVALUATE server -> client CONFIG, WEIGHTS
           client -> server   INFO, EVAL (ConfigRecord: the counts below)
    SITE_EVAL_QUERY server -> client  CONFIG;  client -> server INFO (client id, or its REFUSAL)
    SITE_EVAL       server -> client  CONFIG (with SPLIT), WEIGHTS;  client -> server INFO, EVAL

Every array that arrives is checked before use (`record_to_arrays`, `validate_weights`,
`validate_upload`): declared vs. decoded dtype/shape, the expected keys/shapes/dtypes, and
finiteness. A failed check raises `MalformedUpdate`; the server logs it and drops that reply.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, TypeVar

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MessageType, MetricRecord, RecordDict

from fedccrl_core.foundation import contract
from fedccrl_core.privacy.charged import ChargedRelease
from fedccrl_flower import node_config

# ---- message types ----------------------------------------------------------------------------
QUERY = MessageType.QUERY
TRAIN = MessageType.TRAIN
EVALUATE = MessageType.EVALUATE
# an evaluation-only run (site_evaluation.py): a named action of QUERY (does this site's data fit the model?) and of
# EVALUATE (the model's weights -> this site's counts), routed to the ClientApp's handlers of that name
SITE_EVAL_ACTION = "site_eval"
SITE_EVAL_QUERY = f"{QUERY}.{SITE_EVAL_ACTION}"
SITE_EVAL = f"{EVALUATE}.{SITE_EVAL_ACTION}"

# ---- record keys inside Message.content ---------------------------------------------------------
CONFIG, INFO, UPLOAD = contract.MSG_CONFIG, contract.MSG_INFO, contract.MSG_UPLOAD
PAYLOAD, WEIGHTS, METRICS = contract.MSG_PAYLOAD, contract.MSG_WEIGHTS, contract.MSG_METRICS
EVAL = contract.MSG_EVAL

# ---- fields of the CONFIG / INFO ConfigRecords ---------------------------------------------------
F_SPEC = "spec"  # JSON of the client-side spec (algorithm, LocalConfig, hparams, model, seed, ...)
F_ROUND = "round"
F_CLIENT_ID = "client-id"  # in TRAIN config: the client the server addresses; in INFO: who answers
F_N = "n"  # n_i (Eq. 2); 0 in a QUERY reply: an evaluation-only site (it holds only the held-out domain)
F_REFUSAL = "refusal"  # in a QUERY reply's INFO, instead of n: why this site's data does not fit the run (its check)
# in an EVAL record (per class k of the federation's class list: a list of num_classes ints)
F_VAL_LABELS = "val-labels"  # the site's val images of class k (source validation)
F_VAL_CORRECT = "val-correct"  # of them, predicted correctly by the global model
F_VAL_PREDICTED = "val-predicted"  # val images the global model predicts as k
F_TARGET_N = "target-n"  # the site's images of the held-out domain (an int)
F_TARGET_CORRECT = "target-correct"  # of them, predicted correctly (an int)
F_SPLIT = "split"  # in a SITE_EVAL config: the images the site counts, "val" | "all" (train + val)
F_SKIP_UPLOAD = "skip-upload"  # in QUERY config: client ids whose upload the server does not need (JSON list)
# in QUERY config under train.privacy.max_epsilon: [n, k], the statistics release the pre-round check charged
# (privacy/charged.py); a client whose k_i / n_i exceeds k / n refuses (F_REFUSAL, with its F_N) before any row
F_CHARGED = "charged"

# ---- keys of Context.state on a SuperNode (ClientState, never sent) ------------------------------
STATE_ARRAYS = "fedccrl.client-state.arrays"
STATE_TREE = "fedccrl.client-state.tree"
STATE_HELD_OUT = "fedccrl.held-out"  # {run key: the held-out domain of that run's first message} (held_out_pin.py)

# ---- node config (flower-supernode --node-config) and run config ([tool.flwr.app.config]) -------
NODE_CLIENT_ID = node_config.NODE_CLIENT_ID  # the node config's keys are declared in node_config.py (without torch)
NODE_PARTITION_ID = node_config.NODE_PARTITION_ID
NODE_SHARDS = node_config.NODE_SHARDS
NODE_POOLS = node_config.NODE_POOLS
NODE_STATE_DIR = node_config.NODE_STATE_DIR
NODE_DEVICE = node_config.NODE_DEVICE
RUN_SPEC = "spec"  # run config: the server spec (JSON)
RUN_TASK = "task"  # run config: what the ServerApp runs; TASK_SITE_EVAL, or absent: a training
TASK_SITE_EVAL = "evaluate-sites"  # RUN_SPEC then holds a SiteEvalSpec (spec.py)
RUN_SHARDS = "shards"  # run config fallbacks for simulation (one filesystem)
RUN_POOLS = "pools"
RUN_STATE_DIR = "client-state-dir"


class MalformedUpdate(ValueError):
    """A reply whose arrays cannot be used; it is refused, never aggregated."""


R = TypeVar("R", ArrayRecord, ConfigRecord, MetricRecord)


def record(content: RecordDict, key: str, kind: type[R]) -> R:
    """content[key] (KeyError when absent), which must be a `kind`: MalformedUpdate otherwise."""
    rec = content[key]
    if not isinstance(rec, kind):
        raise MalformedUpdate(f"record '{key}' is a {type(rec).__name__}, expected a {kind.__name__}")
    return rec


def charged_field(charged: ChargedRelease) -> list[int]:
    """The QUERY config's F_CHARGED value."""
    return [charged.n, charged.k]


def read_charged(cfg: ConfigRecord) -> ChargedRelease | None:
    """The QUERY config's F_CHARGED (None when absent); ValueError naming the field when it is not [n, k]."""
    if F_CHARGED not in cfg:
        return None
    v = cfg[F_CHARGED]
    if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
        raise ValueError(f"QUERY config '{F_CHARGED}' is {v!r}, expected [n, k] (two integers)")
    try:
        return ChargedRelease(int(v[0]), int(v[1]))
    except ValueError as e:
        raise ValueError(f"QUERY config '{F_CHARGED}': {e}") from None


# ---- arrays <-> ArrayRecord -------------------------------------------------------------------
def _to_numpy(v) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        if v.dtype == torch.bfloat16:
            raise TypeError("bfloat16 tensors have no numpy dtype; cast to float32 before sending")
        return v.detach().cpu().contiguous().numpy()
    if isinstance(v, np.ndarray):
        return np.ascontiguousarray(v)
    raise TypeError(f"expected a tensor or ndarray, got {type(v).__name__}")


def arrays_to_record(arrays: dict[str, Any]) -> ArrayRecord:
    """A dict of tensors/ndarrays (a state_dict, FedCCRL's {mu, sigma}) as an ArrayRecord."""
    return ArrayRecord({k: Array(_to_numpy(v)) for k, v in arrays.items()})


def record_to_arrays(record: ArrayRecord, what: str) -> dict[str, np.ndarray]:
    """Decode every Array, checking that its declared dtype/shape match the decoded bytes."""
    out = {}
    for k, arr in record.items():
        try:
            a = arr.numpy()
        except Exception as e:  # undecodable bytes, wrong stype, pickled objects (allow_pickle=False)
            raise MalformedUpdate(f"{what}: array '{k}' cannot be decoded ({e.__class__.__name__}: {e})") from e
        if str(a.dtype) != str(arr.dtype) or tuple(a.shape) != tuple(arr.shape):
            raise MalformedUpdate(
                f"{what}: array '{k}' declares {arr.dtype}{list(arr.shape)} but holds {a.dtype}{list(a.shape)}"
            )
        if a.dtype.kind not in "biuf":
            raise MalformedUpdate(f"{what}: array '{k}' has non-numeric dtype {a.dtype}")
        out[k] = np.array(a, copy=True)  # writable, owned
    return out


def record_nbytes(record) -> int:
    """Bytes of one record as it travels (Flower's count_bytes: serialized arrays plus key names)."""
    return int(record.count_bytes())


def content_nbytes(content: RecordDict) -> int:
    return sum(record_nbytes(r) for r in content.values())


# ---- validation ---------------------------------------------------------------------------------
def validate_weights(
    received: dict[str, np.ndarray], reference: dict[str, torch.Tensor], what: str
) -> dict[str, torch.Tensor]:
    """Client weights vs. the global weights: same keys, shapes and dtypes, finite floats.
    Returns them as CPU tensors; raises MalformedUpdate naming the first problem."""
    missing = sorted(set(reference) - set(received))
    extra = sorted(set(received) - set(reference))
    if missing or extra:
        raise MalformedUpdate(
            f"{what}: keys differ from the global model (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    out = {}
    for k, ref in reference.items():
        a = received[k]
        ref_dtype = str(ref.dtype).removeprefix("torch.")
        if tuple(a.shape) != tuple(ref.shape):
            raise MalformedUpdate(f"{what}: '{k}' has shape {list(a.shape)}, expected {list(ref.shape)}")
        if str(a.dtype) != ref_dtype:
            raise MalformedUpdate(f"{what}: '{k}' has dtype {a.dtype}, expected {ref_dtype}")
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise MalformedUpdate(f"{what}: '{k}' contains NaN or infinite values")
        out[k] = torch.from_numpy(a)
    return out


def upload_signature(upload: dict[str, np.ndarray] | None):
    """What every client's upload must share to be pooled: keys, dtypes, ranks and per-row shapes,
    and which arrays have equally many rows (FedCCRL: mu and sigma are both [ceil(r n_i), 3], row j
    of both from the same sample, Eq. 8; the row count itself may differ between clients)."""
    if upload is None:
        return None
    groups: dict = {}
    for k, a in upload.items():
        groups.setdefault(a.shape[0] if a.ndim else None, []).append(k)
    return (
        tuple(sorted((k, str(a.dtype), a.ndim, tuple(a.shape[1:])) for k, a in upload.items())),
        tuple(sorted(tuple(sorted(g)) for g in groups.values())),
    )


def validate_upload(upload: dict[str, np.ndarray] | None, what: str) -> None:
    """An upload on its own: finite numbers (its shape is checked against the others' by
    `consensus_signature`)."""
    if upload is None:
        return
    for k, a in upload.items():
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise MalformedUpdate(f"{what}: upload '{k}' contains NaN or infinite values")


def consensus_signature(signatures: dict[str, Any]):
    """The most common signature among the clients that uploaded (ties: the first client id's); an
    upload that differs from it is refused (it could not be pooled with the others). No upload
    (None) is always fine: the algorithm sent nothing this round."""
    signatures = {c: s for c, s in signatures.items() if s is not None}
    if not signatures:
        return None
    counts = Counter(signatures.values())
    best = max(counts.values())
    for cid in sorted(signatures):
        if counts[signatures[cid]] == best:
            return signatures[cid]


def metrics_from_record(record: MetricRecord, what: str) -> dict[str, float]:
    out = {}
    for k, v in record.items():
        if isinstance(v, list) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise MalformedUpdate(f"{what}: metric '{k}' is not a number")
        if not math.isfinite(float(v)):
            raise MalformedUpdate(f"{what}: metric '{k}' is not finite ({v})")
        out[k] = float(v)
    return out
