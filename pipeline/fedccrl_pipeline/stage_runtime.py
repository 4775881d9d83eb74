"""The runtime every stage command runs in: its output folders checked apart before any work, its death with the
process that started it, SIGTERM as a clean exit, and the project's known errors as `error:` lines with exit code 2."""

from __future__ import annotations

import sys
from pathlib import Path

import click


def folders_apart(reads: dict, writes: dict) -> None:
    """Refuse an output folder of a command (`writes`) that is another of its folders, or lies inside or around
    one: it is replaced whole, and would take the other with it. Two folders it only `reads` may overlap. Keys:
    the options' names (`_` for `-`); a None (an option not given) is skipped. Before any work."""
    from fedccrl_core.foundation.errors import DataError

    named = [
        (f"--{k.replace('_', '-')} {v}", Path(v).resolve(), k in writes)
        for k, v in {**reads, **writes}.items()
        if v is not None
    ]
    for i, (a_name, a, a_out) in enumerate(named):
        for b_name, b, b_out in named[i + 1 :]:
            if (a_out or b_out) and (a.is_relative_to(b) or b.is_relative_to(a)):
                raise DataError(
                    f"{a_name} and {b_name}: the same folder, or one inside the other (a command's "
                    "output folder is replaced whole)"
                )


def run_stage(fn, *args, **kwargs):
    """Run a stage body; turn the project's known errors into clear lines (`error: ...`, one per problem) and
    exit code 2."""
    from fedccrl_core.foundation.errors import FedCCRLError, ParamError
    from fedccrl_core.foundation.procs import die_with_parent, sigterm_as_exit

    die_with_parent()  # SIGTERM when `dvc repro` (or whoever started the stage) dies: no orphan trainer
    sigterm_as_exit()  # SIGTERM -> SystemExit: finally blocks clean up, MLflow runs end KILLED
    try:
        return fn(*args, **kwargs)
    except (ParamError, FileNotFoundError, ValueError, FedCCRLError) as e:
        for line in str(e).splitlines() or [""]:  # a ParamError: one line per problem
            click.echo(f"error: {line}", err=True)
        sys.exit(2)
