"""Round checkpoints of the round loop: verified before they replace anything, a fallback when the
latest is corrupt, per-client state written incrementally, pruned when the run completes.

Layout for a checkpoint path P (e.g. models/.../checkpoint.pt):
  P                    the latest round: global and best weights, history, server state, run info, and
                       `client_files` {client id: round of its newest state file}
  P.prev               the round before, kept until P has been written and read back (issue 17 part 4)
  P.corrupt            a latest checkpoint that could not be read (kept for inspection until completion)
  P.clients/<cid>.r<t>.pt   one client's state (optimizer, LR schedule, `extra`) after round t

A round writes P and the state files of the clients it trained, nothing else (issue 18 part 1): the
bytes a round writes follow the clients it trained, not the number of clients. A state file is
deleted once neither P nor P.prev names it. `prune()` (run completed) deletes P.prev and every
state file P does not name.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Callable

import torch

from fedccrl_core.checkpoint import atomic_torch_save
from fedccrl_core.fsio import atomic_file


class CheckpointFallbackWarning(UserWarning):
    """The latest checkpoint was unreadable; the run resumes from the one before it."""


class RoundCheckpoints:
    def __init__(self, path: str | Path, device, log: Callable[[str], None] = print):
        self.path = Path(path)
        self.prev = self.path.with_name(self.path.name + ".prev")
        self.client_dir = self.path.with_name(self.path.name + ".clients")
        self.corrupt = self.path.with_name(self.path.name + ".corrupt")
        self.device, self.log = device, log
        self.client_files: dict[str, int] = {}  # of the latest checkpoint written or loaded
        self._prev_files: dict[str, int] = {}
        self.bytes_written = 0  # by the last save (checkpoint plus state files)
        self._pending: dict[str, int] = {}  # state files written this round, named by no checkpoint yet
        self._pending_bytes = 0

    # ---- reading ------------------------------------------------------------------------------
    def _read(self, path: Path):
        ck = torch.load(path, map_location=self.device, weights_only=False)
        if not isinstance(ck, dict) or "round" not in ck:
            raise ValueError("not a round checkpoint")
        missing = [c for c, r in (ck.get("client_files") or {}).items() if not self.state_file(c, r).is_file()]
        if missing:
            raise FileNotFoundError(f"client state file(s) missing: {missing[:3]}")
        return ck

    def load(self, accept: Callable[[dict], str | None]) -> dict | None:
        """The newest readable checkpoint that `accept` does not reject (it returns a reason), else None."""
        for path in (self.path, self.prev):
            if not path.is_file():
                continue
            try:
                ck = self._read(path)
            except Exception as e:
                msg = f"checkpoint {path} unreadable ({e.__class__.__name__}: {str(e)[:120]})"
                if path == self.path and self.prev.is_file():
                    warnings.warn(f"{msg}; falling back to {self.prev.name}", CheckpointFallbackWarning, stacklevel=2)
                    self.log(f"WARNING: {msg}; falling back to {self.prev} (the corrupt one is kept as "
                             f"{self.corrupt.name} until the run completes)")
                    os.replace(self.path, self.corrupt)  # never rotated into P.prev by the next save
                else:
                    self.log(f"{msg}; starting from round 1")
                continue
            reason = accept(ck)
            if reason:
                self.log(f"checkpoint {path} {reason}; starting from round 1")
                return None
            self.client_files = dict(ck.get("client_files") or {})
            return ck
        return None

    def state_file(self, cid: str, rnd: int) -> Path:
        return self.client_dir / f"{cid}.r{rnd}.pt"

    def load_client(self, cid: str) -> dict | None:
        """The newest saved state of one client (None: it never trained, or its state is not kept)."""
        rnd = self.client_files.get(cid)
        if rnd is None:
            return None
        return torch.load(self.state_file(cid, rnd), map_location=self.device, weights_only=False)

    def client_states(self) -> dict[str, dict]:
        """Every client state the latest checkpoint names (for inspection and tests; the engine loads
        only the sampled clients' states, with `load_client`)."""
        ck = torch.load(self.path, map_location=self.device, weights_only=False)
        self.client_files = dict(ck.get("client_files") or {})
        return {cid: self.load_client(cid) for cid in sorted(self.client_files)}

    # ---- writing ------------------------------------------------------------------------------
    def write_client(self, cid: str, rnd: int, state: dict) -> None:
        """One client's state after round `rnd`, as soon as it has trained (it can then leave memory).
        No checkpoint names the file until `save(rnd, ...)`: a crash before that leaves it unused, and
        the next save deletes it."""
        f = self.state_file(cid, rnd)
        atomic_torch_save(state, f)
        self._pending[cid] = rnd
        self._pending_bytes += f.stat().st_size

    def save(self, rnd: int, main: dict, trained: dict[str, dict]) -> int:
        """Write round `rnd`: the state files of the clients in `trained` (besides those `write_client`
        wrote this round), then the checkpoint itself (read back before it replaces P; P becomes
        P.prev). Returns the bytes written this round."""
        for cid, state in trained.items():
            self.write_client(cid, rnd, state)
        written, self._pending_bytes = self._pending_bytes, 0
        files = {**self.client_files, **{cid: r for cid, r in self._pending.items() if r == rnd}}
        self._pending = {}
        # read back before it replaces anything; then P becomes P.prev and the new file P (fsio.atomic_file)
        with atomic_file(self.path, "wb", verify=self._read, previous=self.prev) as f:
            torch.save({**main, "round": rnd, "client_files": files}, f)
        written += self.path.stat().st_size
        self._prev_files, self.client_files = self.client_files, files
        self._delete_unreferenced({**self._named(self._prev_files), **self._named(files)})
        self.bytes_written = written
        return written

    def prune(self) -> None:
        """The run completed: keep only the latest checkpoint and the state files it names."""
        self.prev.unlink(missing_ok=True)
        self.corrupt.unlink(missing_ok=True)
        self._prev_files = {}
        self._delete_unreferenced(self._named(self.client_files))

    def _named(self, files: dict[str, int]) -> dict[str, None]:
        return {self.state_file(c, r).name: None for c, r in files.items()}

    def _delete_unreferenced(self, keep: dict[str, None]) -> None:
        if not self.client_dir.is_dir():
            return
        for f in self.client_dir.iterdir():
            if f.name not in keep:
                f.unlink(missing_ok=True)
