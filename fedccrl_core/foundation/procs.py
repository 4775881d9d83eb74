"""The process policy every fedccrl process and child process follows, so that no stage outlives what started it and a killed run stays resumable.

- `die_with_parent()`: Linux PR_SET_PDEATHSIG, so a stage (or the guard of a Flower SuperLink/SuperNode started by
  the launcher through `guarded`, which then ends every process the SuperLink or SuperNode started) receives SIGTERM
  when the process that started it dies: SIGTERM to `dvc repro` no longer
  orphans a trainer that a rerun would then race with.
- `sigterm_as_exit()`: SIGTERM raises SystemExit in the main thread, so `finally` blocks run: temporary
  outputs are removed, child processes stopped and MLflow runs marked KILLED.


Floor 0 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
STOP_GRACE_S = 3.0  # a guarded command's descendants: from SIGTERM to SIGKILL (child_guard.py)


def _prctl(option: int, value: int) -> bool:
    """Linux prctl(option, value); False elsewhere or when the call fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except OSError:
        return False


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits. Linux only; elsewhere a no-op
    (returns False). `parent`: the pid the parent must have; when this process has another parent already (the
    parent died before prctl took effect), it sends itself `sig` at once (without `parent`: when its parent is
    init). A child process started by a fedccrl process arranges this itself at its start (`guarded`)."""
    if not _prctl(PR_SET_PDEATHSIG, int(sig)):
        return False
    orphaned = os.getppid() == 1 if parent is None else os.getppid() != parent
    if orphaned:
        os.kill(os.getpid(), sig)
    return True


def become_subreaper() -> bool:
    """Linux PR_SET_CHILD_SUBREAPER: a descendant of this process whose parent exits is re-parented to this process
    (not to init), so this process can still find and end it. Elsewhere a no-op (returns False)."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def guarded(args: list[str]) -> list[str]:
    """The command line that runs `args` as a child that ends, with everything it started, when this process dies:
    a Python process of fedccrl_core/foundation/child_guard.py asks for the death signal, checks that this process
    is still its parent, becomes the subreaper of its descendants and runs `args` as its own child (in its process
    group); it passes a stop signal on and ends every descendant left. `-P`: the child's working directory is not
    on its module path."""
    return [sys.executable, "-P", "-m", "fedccrl_core.foundation.child_guard", str(os.getpid()), "--", *args]


def _exit_on_signal(signum, frame):
    # once: a second SIGTERM (dvc forwarding it, then PR_SET_PDEATHSIG when dvc exits) must not interrupt
    # the clean-up that the first one started; SIGKILL still ends a clean-up that hangs
    signal.signal(signum, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def sigterm_as_exit() -> None:
    """SIGTERM -> SystemExit(143) in the main thread (signal handlers can only be set there)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_signal)
