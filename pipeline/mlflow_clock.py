"""The wall seconds this process spends in MLflow calls (imports included): `fedccrl bench-repro` reads SECONDS
from each stage's record (pipeline/cli.py, FEDCCRL_STAGE_TIMES)."""
from __future__ import annotations

import functools
import time

SECONDS = 0.0
_depth = 0


def timed(fn):
    """Count fn's wall time into SECONDS (outermost call only)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global SECONDS, _depth
        _depth += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _depth -= 1
            if _depth == 0:
                SECONDS += time.perf_counter() - t0
    return wrapper
