"""`fedccrl-bench speed`: images/s, seconds per round, a projected PACS sweep, augmentation share and peak
memory of the fast engine path against a plain baseline, with the ratio fast/plain of each, in one
process on one device (benchmarks/). Progress on stderr, the table on stdout."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fedccrl_pipeline.stage_runtime import run_stage


def _concurrent(value: str):
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise click.BadParameter("must be auto or an integer >= 1")
    return n


def bench_speed(json_out: Path | None, **options) -> dict:
    from fedccrl_benchmarks.speed import bench
    from fedccrl_benchmarks.speed_config import BenchConfig

    result = bench(BenchConfig(**options))
    print(result["table"], flush=True)
    if json_out is not None:
        from fedccrl_core.foundation.fsio import write_text

        write_text(json_out, json.dumps(result, indent=1))
    return result


@click.command("speed")
@click.option("--size", type=click.IntRange(8), default=32, show_default=True, help="image size (GPU: 224)")
@click.option("--images-per-client", type=click.IntRange(2), default=64, show_default=True)
@click.option("--clients", type=click.IntRange(2), default=3, show_default=True)
@click.option("--steps", type=click.IntRange(1), default=10, show_default=True, help="timed local steps")
@click.option("--warmup", type=click.IntRange(0), default=2, show_default=True, help="untimed local steps first")
@click.option("--batch-size", type=click.IntRange(2), default=32, show_default=True)
@click.option("--epochs", type=click.IntRange(1), default=1, show_default=True, help="local epochs of each timed round")
@click.option(
    "--rounds",
    type=click.IntRange(2),
    default=3,
    show_default=True,
    help="timed rounds: the first against the median of the later ones",
)
@click.option(
    "--backbone",
    type=click.Choice(["small_cnn", "mobilenet_v3_large"]),
    default="small_cnn",
    show_default=True,
    help="pretrained none",
)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option(
    "--workers", type=click.IntRange(0), default=0, show_default=True, help="DataLoader workers of the plain path"
)
@click.option(
    "--concurrent-clients",
    default="auto",
    show_default=True,
    help="fast path: clients at once (auto: CPU 1, CUDA up to 4)",
)
@click.option("--eval-batch-size", type=click.IntRange(1), default=256, show_default=True)
@click.option(
    "--repeats",
    type=click.IntRange(1),
    default=3,
    show_default=True,
    help="fast/plain alternations; the fastest repeat of each timing is reported",
)
@click.option(
    "--threads",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="torch threads (0: torch's default; 1 is steadier on a shared CPU)",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="also write the figures here")
def command(json_out, concurrent_clients, **options):
    """Fast engine path vs a plain baseline: FedCCRL images/s, s/round, PACS sweep projection (ratios)."""
    try:
        cc = _concurrent(concurrent_clients)
    except click.BadParameter as e:
        raise click.BadParameter(str(e), param_hint="--concurrent-clients") from e
    run_stage(bench_speed, json_out, concurrent_clients=cc, **options)
