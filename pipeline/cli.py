"""`fedccrl`: the pipeline stages as one click group. Each stage lives in its own module."""
from __future__ import annotations

import importlib
import sys

from fedccrl_core.threads import apply_thread_policy

apply_thread_policy()  # before anything imports torch: OpenMP reads it once (fedccrl_core/threads.py)

import click  # noqa: E402

from fedccrl_core import __version__  # noqa: E402

# stage name -> module under pipeline/ exposing a click command named `command`
STAGES = {
    "download": "pipeline.download",
    "partition": "pipeline.partition",
    "pools": "pipeline.pools",
    "train": "pipeline.train",
    "evaluate": "pipeline.evaluate",
    "report": "pipeline.report",
    "figures": "pipeline.figures",
    "export": "pipeline.export",
    "audit": "pipeline.audit",
    "bench-accuracy": "benchmarks.accuracy",
    "bench": "benchmarks.speed_cli",
    "bench-scale": "benchmarks.scale_cli",
    "bench-threads": "benchmarks.threads",
    "bench-repro": "benchmarks.repro",
}


class _LazyGroup(click.Group):
    """Imports a stage's module only when it runs (one stage imports no other stage). Every stage validates the
    whole params.yaml first, without torch (the `train.<algorithm>` groups are declared in
    fedccrl_core/algorithm_params/): download, partition, pools, report and `fedccrl --help` import no torch
    (tests/test_layers.py)."""

    def list_commands(self, ctx):
        return list(STAGES)

    def get_command(self, ctx, name):
        if name not in STAGES:
            return None
        try:
            return importlib.import_module(STAGES[name]).command
        except ModuleNotFoundError as e:
            if e.name == STAGES[name]:
                return None
            raise


@click.group(cls=_LazyGroup)
@click.version_option(__version__, prog_name="fedccrl")
def main():
    """fedccrl pipeline stages (run by `dvc repro`; see dvc.yaml for their arguments)."""


def entry() -> None:
    """The `fedccrl` command (pyproject.toml): the click group, ended as any Python program ends."""
    main()


def folders_apart(reads: dict, writes: dict) -> None:
    """Refuse an output folder of a command (`writes`) that is another of its folders, or lies inside or around
    one: it is replaced whole, and would take the other with it. Two folders it only `reads` may overlap. Keys:
    the options' names (`_` for `-`); a None (an option not given) is skipped. Before any work."""
    from pathlib import Path

    from fedccrl_core.errors import DataError

    named = [(f"--{k.replace('_', '-')} {v}", Path(v).resolve(), k in writes)
             for k, v in {**reads, **writes}.items() if v is not None]
    for i, (a_name, a, a_out) in enumerate(named):
        for b_name, b, b_out in named[i + 1:]:
            if (a_out or b_out) and (a.is_relative_to(b) or b.is_relative_to(a)):
                raise DataError(f"{a_name} and {b_name}: the same folder, or one inside the other (a command's "
                                "output folder is replaced whole)")


def run_stage(fn, *args, **kwargs):
    """Run a stage body; turn the project's known errors into clear lines (`error: ...`, one per problem) and
    exit code 2."""
    from pipeline.params import ParamError

    known = (ParamError, FileNotFoundError, ValueError)
    try:
        from fedccrl_core.errors import FedCCRLError
        known = known + (FedCCRLError,)
    except ImportError:
        pass
    from fedccrl_core.procs import die_with_parent, sigterm_as_exit

    die_with_parent()   # SIGTERM when `dvc repro` (or whoever started the stage) dies: no orphan trainer
    sigterm_as_exit()   # SIGTERM -> SystemExit: finally blocks clean up, MLflow runs end KILLED
    try:
        return fn(*args, **kwargs)
    except known as e:
        for line in str(e).splitlines() or [""]:  # a ParamError: one line per problem
            click.echo(f"error: {line}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    entry()
