"""`fedccrl`: the pipeline stages as one click group. Each stage lives in its own module."""
from __future__ import annotations

import importlib
import os
import sys
import time

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
    "publish": "pipeline.publish",
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
    """The `fedccrl` command (pyproject.toml): the click group, then `exit_now` with its exit code. An uncaught
    exception propagates as usual (its traceback, exit code 1)."""
    try:
        main()  # click's standalone mode: always ends in SystemExit
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    exit_now(code)


def exit_now(code: int) -> None:
    """End the process as Python's own exit does, but without freeing every module: wait for the threads that
    are not daemons, flush stdout and stderr, run the atexit handlers (MLflow ending its runs, logging's flush,
    the finalizers of temporary folders), then os._exit. A process that imported torch and MLflow otherwise
    spends about half a second tearing its modules down after its work is done (docs/benchmarks.md).
    atexit._run_exitfuncs is CPython's own exit step, the one that has no public name. Under a profiler or a
    tracer (`python -m cProfile`, a debugger), which writes its results as the interpreter ends, the usual exit."""
    import atexit
    import threading

    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)

    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(code)


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
    t0, startup = time.perf_counter(), _seconds_since_process_start()
    try:
        return fn(*args, **kwargs)
    except known as e:
        for line in str(e).splitlines() or [""]:  # a ParamError: one line per problem
            click.echo(f"error: {line}", err=True)
        sys.exit(2)
    finally:
        _record_stage_time(fn, startup, time.perf_counter() - t0)


def _seconds_since_process_start() -> float | None:
    """Wall seconds from this process's start (exec, interpreter start-up, imports) to now. Linux only."""
    try:
        start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _record_stage_time(fn, startup: float | None, body: float) -> None:
    """With FEDCCRL_STAGE_TIMES=<file> (set by `fedccrl bench-repro`), append one JSON line per stage
    process: wall seconds of start-up + imports and of the stage body, CPU seconds (this process and its
    workers), and the seconds spent talking to MLflow (pipeline/mlflow_clock.py)."""
    path = os.environ.get("FEDCCRL_STAGE_TIMES")
    if not path:
        return
    import json
    import resource

    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    clock = sys.modules.get("pipeline.mlflow_clock")
    with open(path, "a") as f:
        f.write(json.dumps({"stage": fn.__module__.rsplit(".", 1)[-1], "argv": sys.argv[1:],
                            "startup_s": startup, "body_s": body, "cpu_s": cpu,
                            "mlflow_s": clock.SECONDS if clock else 0.0}) + "\n")


if __name__ == "__main__":
    entry()
