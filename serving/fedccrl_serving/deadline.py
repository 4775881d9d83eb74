"""`fedccrl-serve --deadline`: the whole run, model loading included, stopped in the main thread once its seconds of
wall-clock time have passed (SIGALRM)."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path

from fedccrl_serving.console import Fatal


class DeadlinePassed(BaseException):
    """--deadline: raised by SIGALRM wherever the main thread is; a BaseException (as KeyboardInterrupt),
    so no `except Exception` on the way (one unreadable image is an error record) can swallow it."""


@contextlib.contextmanager
def run_deadline(seconds: float | None, output: Path | None):
    """Raise Fatal in the main thread when `seconds` of wall-clock time have passed (SIGALRM)."""
    if not seconds:
        yield
        return
    if threading.current_thread() is not threading.main_thread():
        raise Fatal("--deadline works only in the main thread")

    def expire(signum, frame):
        raise DeadlinePassed(
            f"--deadline {seconds:g} s passed before the run finished" + (f"; {output} not written" if output else "")
        )

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
