"""Round checkpoints of the round loop: verified before they replace anything, a fallback when the
latest is corrupt, per-client state written incrementally into one file per round, pruned when the
run completes.

Layout for a checkpoint path P (e.g. models/.../checkpoint.pt):
  P                    the latest round (`RoundCheckpoint`): global and best weights, history, server state, run
                       info, and `client_records` {client id: (round t, offset, length) of its newest state}
  P.prev               the round before, kept until P has been written and read back (a fallback if P is torn)
  P.corrupt            a latest checkpoint that could not be read (kept for inspection until completion)
  P.clients/r<t>.bin   the states (optimizer, LR schedule, `extra`) of the clients trained in round t,
                       one record per client, appended as each client finishes training
  P.ledger.json        train.privacy's ledger (privacy/ledger_file.py): every release charged so
                       far, replaced at each release, so it can be ahead of P; plain numbers, kept after the run
  P.study.json         the study the run's releases are also appended to (privacy/study_ledger.py; the pipeline's)

A round writes P and one state file holding the clients it trained, nothing else: the bytes a round writes follow the clients it trained, not the number of clients, and a round costs
one file and one fsync however many clients it trains (one file per client cost an fsync each). A
record is raw tensor bytes behind a small pickle (`write_record`), so reading one client back reads
only its own bytes. A state file is deleted once neither P nor P.prev names it; a round file whose
named records fill less than half of it has them copied (bytes as they are) into the round being
written, so the files on disk stay under about twice the live states. `prune()` (run completed)
deletes P.prev and every state file P does not name. `drop_client_states()` (a train.privacy run ended) deletes them
all and rewrites P naming none: what the clients never released does not outlive the run.


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import os
import pickle
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ConfigDict, Field

from fedccrl_core.federation.round_record import RoundRecord
from fedccrl_core.foundation.errors import UntrustedFileError
from fedccrl_core.foundation.fsio import atomic_file, atomic_path
from fedccrl_core.foundation.records import Record, parse_record
from fedccrl_core.learning.model_file import torch_load

ALIGN = 64  # every record and every tensor's bytes start at a multiple of this (aligned views on read)
_HEAD = struct.Struct("<QQ")  # pickle length, number of out-of-band buffers; then one <Q length per buffer


class CheckpointFallbackWarning(UserWarning):
    """The latest checkpoint was unreadable; the run resumes from the one before it."""


class RoundState(Record):
    """What the round loop (fedccrl_core/federation/loop.py) saves after a round, to resume after it."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    global_weights: dict[str, torch.Tensor] = Field(alias="global")
    best: dict[str, torch.Tensor]  # the weights of the best-validation round so far
    best_round: int
    best_val: float
    history: list[RoundRecord]  # the round records so far (federation/round_record.py)
    run_info: dict[str, Any]  # what the run must match to resume from this checkpoint
    server_state: dict[str, Any]  # Algorithm.server_state()
    engine: str
    privacy: list[list[Any]] | None = None  # train.privacy's accountant (its releases); absent when off
    states: dict[str, dict[str, Any]] | None = None  # client states of the single-file format (before state files)


class RoundCheckpoint(RoundState):
    """The checkpoint file P: the round's state, its round and the client records it names."""

    round: int
    client_records: dict[str, tuple[int, int, int]]  # client id -> (round t, offset, length) of its newest state


# ---- one client's record: tensors as raw bytes, the rest pickled ----------------------------------
def _tensor_from(dtype: str | None, shape: tuple, data: np.ndarray, device=None) -> torch.Tensor:
    t = torch.from_numpy(data)
    if dtype is not None:  # a dtype numpy lacks (bfloat16, ...): its bytes, viewed back
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):  # the name comes from the file: only a dtype is looked up
            raise pickle.UnpicklingError(f"it names {dtype!r} as a tensor dtype")
        t = t.view(dt).reshape(shape)
    return t if device is None else t.to(device)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):  # the bytes leave the pickle as one out-of-band buffer
            t = obj.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            if not t.is_contiguous():
                t = t.contiguous()
            try:
                return _tensor_from, (None, None, t.numpy())
            except TypeError:  # no numpy dtype
                return _tensor_from, (
                    str(t.dtype).removeprefix("torch."),
                    tuple(t.shape),
                    t.reshape(-1).view(torch.uint8).numpy(),
                )
        return NotImplemented


# Every class or function a client state's pickle names besides `_tensor_from` (optimizer and LR-schedule
# state dicts, `extra`): numpy's rebuilder of an out-of-band array (numpy.core or numpy._core by version)
# and its dtype, OrderedDict. A pickle names what it calls when loaded, so nothing else is looked up.
_ALLOWED = {
    (f.__module__, f.__name__): f  # type: ignore[union-attr]  # __reduce_ex__(5)[0] is numpy's rebuilder function here, typed as str | callable
    for f in (np.zeros(1).__reduce_ex__(5)[0], np.dtype, collections.OrderedDict)
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, buffers, device):
        super().__init__(file, buffers=buffers)
        self.device = device

    def find_class(self, module, name):
        if module == __name__ and name == "_tensor_from":
            return functools.partial(_tensor_from, device=self.device)
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a client state never holds") from None


def _pad(n: int) -> int:
    return -n % ALIGN


def write_record(state, f) -> int:
    """Append one client's state to the open file `f` (positioned at a multiple of ALIGN); returns the
    record's length, padding included."""
    bufs: list[pickle.PickleBuffer] = []
    meta = io.BytesIO()
    _Pickler(meta, protocol=5, buffer_callback=bufs.append).dump(state)
    raws = [b.raw() for b in bufs]
    head = _HEAD.pack(meta.tell(), len(raws)) + struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws))
    n = f.write(head) + f.write(meta.getbuffer())
    n += f.write(b"\0" * _pad(n))
    for r in raws:
        n += f.write(r)
        n += f.write(b"\0" * _pad(n))
    return n


def read_record(buf: np.ndarray, device=None):
    """The state `write_record` wrote, from its bytes; tensors are views of `buf` (CPU) or copies on
    `device`."""
    mv = memoryview(buf)  # type: ignore[arg-type]  # an ndarray is a buffer; numpy's stubs declare __buffer__ for Python >= 3.12 only
    meta_len, nbuf = _HEAD.unpack_from(mv, 0)
    lens = struct.unpack_from(f"<{nbuf}Q", mv, _HEAD.size)
    pos = _HEAD.size + 8 * nbuf
    meta = mv[pos : pos + meta_len]
    pos += meta_len
    pos += _pad(pos)
    views = []
    for n in lens:
        views.append(mv[pos : pos + n])
        pos += n
        pos += _pad(pos)
    dev = None if device is None or torch.device(device).type == "cpu" else device
    return _Unpickler(io.BytesIO(meta), views, dev).load()


class RoundCheckpoints:
    def __init__(self, path: str | Path, device, log: Callable[[str], None] = print):
        self.path = Path(path)
        self.prev = self.path.with_name(self.path.name + ".prev")
        self.client_dir = self.path.with_name(self.path.name + ".clients")
        self.corrupt = self.path.with_name(self.path.name + ".corrupt")
        self.ledger = self.path.with_name(self.path.name + ".ledger.json")
        self.device, self.log = device, log
        self.client_records: dict[str, tuple[int, int, int]] = {}  # of the latest checkpoint written or loaded
        self._prev_records: dict[str, tuple[int, int, int]] = {}
        self.bytes_written = 0  # by the last save (checkpoint plus the round's state file)
        self._pending: dict[str, tuple[int, int, int]] = {}  # records written this round, named by no checkpoint yet
        self._store: contextlib.ExitStack | None = None  # the round's state file being written
        self._store_round, self._store_pos = 0, 0
        self._store_file: io.BufferedWriter | None = None

    # ---- reading ------------------------------------------------------------------------------
    def round_file(self, rnd: int) -> Path:
        return self.client_dir / f"r{rnd}.bin"

    def _parse(self, path: Path) -> RoundCheckpoint:
        """The checkpoint file at `path`, checked field by field (ValueError naming the file and the field)."""
        ck = torch_load(path, self.device)
        if not isinstance(ck, dict) or "round" not in ck:
            raise ValueError("not a round checkpoint")
        if "client_files" in ck:
            raise ValueError("a checkpoint of the one-file-per-client format (before round state files)")
        return parse_record(RoundCheckpoint, ck, path.name, ValueError)

    def _read(self, path: Path) -> RoundCheckpoint:
        ck = self._parse(path)
        recs = ck.client_records
        sizes = {
            r: self.round_file(r).stat().st_size if self.round_file(r).is_file() else -1
            for r in {rec[0] for rec in recs.values()}
        }
        missing = [c for c, (r, off, n) in recs.items() if sizes[r] < off + n]
        if missing:
            raise FileNotFoundError(f"client state record(s) missing: {missing[:3]}")
        return ck

    def load(self, accept: Callable[[RoundCheckpoint], str | None]) -> RoundCheckpoint | None:
        """The newest readable checkpoint that `accept` does not reject (it returns a reason), else None."""
        for path in (self.path, self.prev):
            if not path.is_file():
                continue
            try:
                ck = self._read(path)
            except UntrustedFileError:  # not a torn write to fall back from: someone else's file, refused
                raise
            except Exception as e:
                msg = f"checkpoint {path} unreadable ({e.__class__.__name__}: {str(e)[:120]})"
                if path == self.path and self.prev.is_file():
                    warnings.warn(f"{msg}; falling back to {self.prev.name}", CheckpointFallbackWarning, stacklevel=2)
                    self.log(
                        f"WARNING: {msg}; falling back to {self.prev} (the corrupt one is kept as "
                        f"{self.corrupt.name} until the run completes)"
                    )
                    os.replace(self.path, self.corrupt)  # never rotated into P.prev by the next save
                else:
                    self.log(f"{msg}; starting from round 1")
                continue
            reason = accept(ck)
            if reason:
                self.log(f"checkpoint {path} {reason}; starting from round 1")
                return None
            self.client_records = dict(ck.client_records)
            return ck
        return None

    def _raw(self, rec: tuple[int, int, int]) -> np.ndarray:
        rnd, off, n = rec
        buf = np.empty(n, dtype=np.uint8)
        with open(self.round_file(rnd), "rb") as f:
            f.seek(off)
            if f.readinto(memoryview(buf)) != n:  # type: ignore[arg-type]  # an ndarray is a buffer (see read_record)
                raise EOFError(f"{self.round_file(rnd)}: record at {off} is truncated")
        return buf

    def load_client(self, cid: str) -> dict | None:
        """The newest saved state of one client (None: it never trained, or its state is not kept); reads
        that client's record only."""
        rec = self.client_records.get(cid)
        if rec is None:
            return None
        try:
            return read_record(self._raw(rec), self.device)
        except pickle.UnpicklingError as e:
            raise UntrustedFileError(
                f"{self.round_file(rec[0])}: refused: the state of client {cid} {e}; nothing in it was loaded or run"
            ) from e

    def client_states(self) -> dict[str, dict | None]:
        """Every client state the latest checkpoint names (for inspection and tests; the engine loads
        only the sampled clients' states, with `load_client`)."""
        self.client_records = dict(self._parse(self.path).client_records)
        return {cid: self.load_client(cid) for cid in sorted(self.client_records)}

    # ---- writing ------------------------------------------------------------------------------
    def _open_round(self, rnd: int) -> None:
        if self._store is not None and self._store_round == rnd:
            return
        self._abort_round()
        stack = contextlib.ExitStack()
        tmp = stack.enter_context(atomic_path(self.round_file(rnd)))  # fsynced and renamed at close
        self._store_file = stack.enter_context(open(tmp, "xb"))
        self._store, self._store_round, self._store_pos, self._pending = stack, rnd, 0, {}

    def _abort_round(self) -> None:
        if self._store is not None:  # a round that never reached save(): its temporary file goes
            with contextlib.suppress(BaseException):
                self._store.__exit__(RuntimeError, RuntimeError("round abandoned"), None)
        self._store, self._store_file, self._pending = None, None, {}

    def _append(self, cid: str, write: Callable) -> None:
        n = write(self._store_file)
        self._pending[cid] = (self._store_round, self._store_pos, n)
        self._store_pos += n

    def write_client(self, cid: str, rnd: int, state: dict) -> None:
        """Append one client's state after round `rnd` to that round's file, as soon as it has trained
        (it can then leave memory). No checkpoint names it until `save(rnd, ...)`: a crash before that
        leaves only a temporary file, removed by the next run."""
        self._open_round(rnd)
        self._append(cid, lambda f: write_record(state, f))

    def _compact(self, records: dict) -> None:
        """Copy the live records of older round files that are less than half live into this round's."""
        live: dict[int, list[str]] = {}
        for cid, rec in records.items():
            if rec[0] != self._store_round:
                live.setdefault(rec[0], []).append(cid)
        for rnd, cids in sorted(live.items()):
            size = self.round_file(rnd).stat().st_size
            if 2 * sum(records[c][2] for c in cids) < size:
                for cid in cids:
                    raw = self._raw(records[cid])
                    self._append(cid, lambda f, raw=raw: f.write(memoryview(raw)))

    def save(self, rnd: int, main: RoundState, trained: dict[str, dict]) -> int:
        """Write round `rnd`: the states of the clients in `trained` (besides those `write_client`
        wrote this round) into the round's file, closed with one fsync, then the checkpoint itself
        (read back before it replaces P; P becomes P.prev). Returns the bytes written this round."""
        for cid, state in trained.items():
            self.write_client(cid, rnd, state)
        written = 0
        records = dict(self.client_records)
        if self._store is not None and self._store_round == rnd:
            records.update(self._pending)
            self._compact(records)
            records.update(self._pending)
            assert self._store_file is not None  # opened with the round's store
            self._store_file.close()
            stack, self._store, self._store_file = self._store, None, None
            stack.close()  # fsync, rename to P.clients/r<rnd>.bin
            written += self.round_file(rnd).stat().st_size
        else:
            self._abort_round()
        self._pending = {}
        # read back before it replaces anything; then P becomes P.prev and the new file P (fsio.atomic_file)
        ck = RoundCheckpoint.model_validate({**main.to_dict(), "round": rnd, "client_records": records})
        with atomic_file(self.path, "wb", verify=self._read, previous=self.prev) as f:
            torch.save(ck.to_dict(), f)
        written += self.path.stat().st_size
        self._prev_records, self.client_records = self.client_records, records
        self._delete_unreferenced({**self._named(self._prev_records), **self._named(records)})
        self.bytes_written = written
        return written

    def prune(self) -> None:
        """The run completed: keep only the latest checkpoint and the state files it names."""
        self.prev.unlink(missing_ok=True)
        self.corrupt.unlink(missing_ok=True)
        self._prev_records = {}
        self._delete_unreferenced(self._named(self.client_records))

    def has_client_states(self) -> bool:
        """Whether any file of this checkpoint may hold a client's state (P.clients/, P.prev, P.corrupt, or P naming
        a client record)."""
        if self.client_dir.is_dir() or self.prev.exists() or self.corrupt.exists():
            return True
        if not self.path.is_file():
            return False
        ck = self._parse(self.path)
        return bool(ck.client_records or ck.states)

    def drop_client_states(self) -> None:
        """The run ended under train.privacy: the clients' states (optimizer moments, `extra`: never released,
        neither clipped nor noised) leave the files the operator keeps. P is rewritten naming no client record
        (read back before it replaces P), then P.prev, P.corrupt and every file of P.clients go, the folder too. A
        rerun resumes from P, its clients starting afresh."""
        self._abort_round()
        if self.path.is_file():
            ck = self._parse(self.path)
            if ck.client_records or ck.states:
                kept = ck.model_copy(update={"client_records": {}})  # validated already: its values, fewer
                with atomic_file(self.path, "wb", verify=self._read) as f:
                    torch.save(kept.model_dump(by_alias=True, exclude_unset=True, exclude={"states"}), f)
        self.client_records, self._prev_records = {}, {}
        self.prev.unlink(missing_ok=True)
        self.corrupt.unlink(missing_ok=True)
        if self.client_dir.is_dir():
            for f in self.client_dir.iterdir():
                f.unlink(missing_ok=True)
            self.client_dir.rmdir()

    def _named(self, records: dict) -> dict[str, None]:
        return {self.round_file(r[0]).name: None for r in records.values()}

    def _delete_unreferenced(self, keep: dict[str, None]) -> None:
        if not self.client_dir.is_dir():
            return
        for f in self.client_dir.iterdir():
            if f.name not in keep and not f.name.startswith("."):  # temporary files are fsio's to sweep
                f.unlink(missing_ok=True)
