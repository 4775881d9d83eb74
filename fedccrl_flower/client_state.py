"""A client's state on its SuperNode (ClientState: optimizer, LR schedule, `extra`, e.g. FedBN's local BN layers):
kept in `Context.state` across rounds (ArrayRecord + ConfigRecord, see state_tree.pack_tree) and, with
`state-dir=<folder>`, mirrored to disk after every round (npz, no pickle), so a restarted SuperNode or a rerun
ServerApp continues from it. Two slots are kept (the newest and the one before), and round t trains from the newest
state made *before* round t: a round that is retrained after a ServerApp resume starts from the same state as the
first time.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context

from fedccrl_core.foundation.fsio import atomic_file
from fedccrl_core.learning.clients import ClientState
from fedccrl_flower import messages as M
from fedccrl_flower import state_tree
from fedccrl_flower.site_data import setting


def _state_file(context: Context, state_key: str, cid: str) -> Path | None:
    d = setting(context, M.NODE_STATE_DIR, M.RUN_STATE_DIR)
    return Path(d) / state_key / f"{cid}.npz" if d else None


def _book_from_context(context: Context, state_key: str, cid: str) -> dict | None:
    if M.STATE_TREE not in context.state or M.STATE_ARRAYS not in context.state:
        return None
    book = state_tree.unpack_tree(
        M.record(context.state, M.STATE_ARRAYS, ArrayRecord), M.record(context.state, M.STATE_TREE, ConfigRecord)
    )
    return book if (book.get("state_key"), book.get("client_id")) == (state_key, cid) else None


def _book_from_disk(path: Path | None, state_key: str, cid: str) -> dict | None:
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            book = state_tree.decode_tree({k[1:]: z[k] for k in z.files if k.startswith("a")}, str(z["tree"]))
    except Exception as e:  # a torn or foreign file: start fresh, say so
        print(f"client {cid}: state file {path} unreadable ({e.__class__.__name__}); ignoring it", flush=True)
        return None
    return book if (book.get("state_key"), book.get("client_id")) == (state_key, cid) else None


def load_client_state(context: Context, state_key: str, cid: str, rnd: int) -> tuple[ClientState, dict | None]:
    """The newest saved state (of the run `state_key` names) made before round `rnd` (fresh if none) and its slot."""
    books = [
        b
        for b in (
            _book_from_context(context, state_key, cid),
            _book_from_disk(_state_file(context, state_key, cid), state_key, cid),
        )
        if b
    ]
    books.sort(key=lambda b: max((s["round"] for s in b["slots"]), default=0), reverse=True)
    for book in books[:1]:
        for slot in sorted(book["slots"], key=lambda s: -s["round"]):
            if slot["round"] < rnd:  # a copy: the optimizer updates its loaded tensors in place
                return ClientState.from_dict(copy.deepcopy(slot["state"])), slot
    return ClientState(), None


def save_client_state(
    context: Context, state_key: str, cid: str, rnd: int, state: ClientState, base: dict | None
) -> None:
    book = {
        "state_key": state_key,
        "client_id": cid,
        "slots": [{"round": rnd, "state": state.to_dict()}] + ([base] if base else []),
    }
    arrays, tree = state_tree.pack_tree(book)
    context.state[M.STATE_ARRAYS] = arrays
    context.state[M.STATE_TREE] = tree
    path = _state_file(context, state_key, cid)
    if path is not None:  # npz, no pickle: written to a temp file, fsynced, renamed
        arrays_np, skeleton = state_tree.encode_tree(book)
        with atomic_file(path, "wb") as f:  # fedccrl_core.foundation.fsio
            np.savez(f, tree=np.array(skeleton), **{f"a{k}": v for k, v in arrays_np.items()})  # type: ignore[arg-type]  # keys a<k>, never allow_pickle
