"""Progress on stderr, through tqdm: `<label>: <done>/<total>` (files, images) or bytes (a download), never on
stdout (a stage's stdout is its result). In a terminal tqdm redraws one line; when stderr is a log (DVC, CI) it
writes an update at most every 5 s and the final count when the work is done, as the hand-printed lines did.
`enabled=False` (progress=False) prints nothing.

Floor 0 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import sys


def progress(total: int | None, label: str, enabled: bool = True, nbytes: bool = False):
    """A tqdm counter to `.update(n)` and close (a context manager). `nbytes`: count bytes, in kB/MB/GB."""
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    unit = "B" if nbytes else ""
    fmt = (
        "{desc}: {n_fmt}"
        + unit
        + ("/{total_fmt}" + unit if total else "")
        + (" ({percentage:.0f}%)" if nbytes and total else "")
    )
    return tqdm(
        total=total,
        desc=label,
        file=sys.stderr,
        disable=not enabled,
        bar_format=fmt,
        mininterval=0.5 if tty else 5.0,
        unit="B" if nbytes else "it",
        unit_scale=nbytes,
        unit_divisor=1000,
        dynamic_ncols=tty,
    )
