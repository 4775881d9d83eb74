"""`fedccrl download`: get the dataset of params `dataset.*` into --out as <domain>/<class>/<image>.

Reads the `dataset` and `download` groups. Sources: `registry`, an http(s) URL, a local archive or a
folder (see fedccrl_core/data/sources.py). Writes --out atomically and the data report to --report.
"""
from __future__ import annotations

import signal
import sys
import threading

import click

from pipeline.cli import run_stage
from pipeline.params import ParamError, get, load_params


def exit_cleanly_on_sigterm() -> None:
    """SIGTERM (a cancelled `dvc repro`) -> SystemExit, so temp dirs are removed on the way out."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _run(out: str, report: str, params_path: str) -> None:
    from fedccrl_core.data.registry import get_dataset
    from fedccrl_core.data.sources import prepare_raw

    p = load_params(params_path)
    spec = get_dataset(get(p, "dataset.name", str))
    source = get(p, "dataset.source", str)
    sha256 = get(p, "dataset.sha256", (str, dict, type(None)), default=None)
    seed = get(p, "dataset.seed", int, default=0)
    timeout_s = get(p, "download.timeout_s", (int, float))
    deadline_s = get(p, "download.deadline_s", (int, float), default=None)  # absent: fedccrl_core.data.http's
    retries = get(p, "download.retries", int)
    max_bad = get(p, "download.max_bad_fraction", (int, float))
    if timeout_s <= 0:
        raise ParamError(f"params.yaml: key 'download.timeout_s' must be > 0, got {timeout_s!r}")
    if deadline_s is not None and deadline_s < timeout_s:
        raise ParamError(f"params.yaml: key 'download.deadline_s' (the whole download of one archive) must be a "
                         f"number of seconds >= download.timeout_s={timeout_s}, got {deadline_s!r}")
    if retries < 0:
        raise ParamError(f"params.yaml: key 'download.retries' must be >= 0, got {retries!r}")
    if not 0 <= max_bad <= 1:
        raise ParamError(f"params.yaml: key 'download.max_bad_fraction' must be in [0, 1], got {max_bad!r}")
    prepare_raw(spec, source, out, report, sha256=sha256, seed=seed, timeout_s=timeout_s, retries=retries,
                max_bad_fraction=float(max_bad), **({"deadline_s": float(deadline_s)} if deadline_s is not None else {}))


@click.command()
@click.option("--out", required=True, type=click.Path(file_okay=False), help="raw data folder to (re)create")
@click.option("--report", required=True, type=click.Path(dir_okay=False), help="data report JSON")
@click.option("--params", "params_path", default="params.yaml", show_default=True, type=click.Path(dir_okay=False))
def command(out: str, report: str, params_path: str) -> None:
    """Download / extract / generate the dataset and validate every image."""
    exit_cleanly_on_sigterm()
    run_stage(_run, out, report, params_path)
