"""Run Flower's own `flower-supernode` for a site (`fedccrl site join`): found on PATH (else beside this Python), run
as a child that dies with this process (fedccrl_core/foundation/procs.py `guarded`), in a session of its own so that
a terminal's Ctrl-C reaches it once, through this process; SIGINT, SIGTERM and SIGHUP are passed on to it, and its
exit code is returned (killed by signal N: 128 + N, as a shell reports it)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from fedccrl_core.foundation.errors import DataError
from fedccrl_core.foundation.procs import guarded

PROGRAM = "flower-supernode"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
BIN = Path(sys.executable).parent  # this environment's scripts: flower-supernode, and flwr-clientapp that it starts


def find_supernode() -> str:
    """The `flower-supernode` program's path; DataError before anything starts when there is none."""
    found = shutil.which(PROGRAM) or shutil.which(PROGRAM, path=str(BIN))
    if found is None:
        raise DataError(f"{PROGRAM} is neither on PATH nor in {BIN}: install Flower (pip install 'fedccrl[site]')")
    return found


def child_env() -> dict[str, str]:
    """This environment, with its scripts folder last on PATH: the SuperNode starts `flwr-clientapp` by name."""
    path = os.environ.get("PATH", "")
    parts = path.split(os.pathsep) if path else []
    return {**os.environ, "PATH": os.pathsep.join([*parts, str(BIN)] if str(BIN) not in parts else parts)}


def run_supernode(argv: list[str]) -> int:
    """Run `argv` (a flower-supernode command line) to its end, passing signals on; its exit code."""
    proc = subprocess.Popen(guarded(argv), env=child_env(), start_new_session=True)
    previous = {sig: signal.getsignal(sig) for sig in FORWARDED}

    def forward(signum, frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    try:
        for sig in FORWARDED:
            signal.signal(sig, forward)
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # this process is leaving first (an error here): the SuperNode goes too
            proc.terminate()
            proc.wait()
    return 128 - code if code < 0 else code
