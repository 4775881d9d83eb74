"""`fedccrl download`: get the dataset of params `dataset.*` into --out as <domain>/<class>/<image>.

Reads the `dataset` and `download` groups. Sources: `registry`, an http(s) URL, a local archive or a
folder (see fedccrl_core/data/sources.py). Writes --out atomically and the data report to --report.
"""

from __future__ import annotations

import click

from fedccrl_pipeline.params import load_config
from fedccrl_pipeline.stage_runtime import run_stage


def _run(out: str, report: str, params_path: str) -> None:
    cfg = load_config(params_path)  # the whole file, before anything is fetched
    from fedccrl_core.data.registry import get_dataset
    from fedccrl_core.data.sources import prepare_raw

    ds, dl = cfg.dataset, cfg.download
    prepare_raw(
        get_dataset(ds.name),
        ds.source,
        out,
        report,
        sha256=ds.sha256,
        seed=ds.seed,
        timeout_s=dl.timeout_s,
        retries=dl.retries,
        max_bad_fraction=dl.max_bad_fraction,
        deadline_s=dl.deadline_s,
    )


@click.command()
@click.option("--out", required=True, type=click.Path(file_okay=False), help="raw data folder to (re)create")
@click.option("--report", required=True, type=click.Path(dir_okay=False), help="data report JSON")
@click.option("--params", "params_path", default="params.yaml", show_default=True, type=click.Path(dir_okay=False))
def command(out: str, report: str, params_path: str) -> None:
    """Download / extract / generate the dataset and validate every image."""
    run_stage(_run, out, report, params_path)
