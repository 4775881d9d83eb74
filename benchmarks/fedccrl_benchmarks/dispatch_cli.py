"""`fedccrl-bench dispatch`: operators dispatched, host time and device reads of one local step, FedCCRL against
FedAvg (benchmarks/fedccrl_benchmarks/dispatch.py). Progress on stderr, the table on stdout."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fedccrl_pipeline.stage_runtime import run_stage


def bench_dispatch(json_out: Path | None, **options) -> dict:
    from fedccrl_benchmarks.dispatch import DispatchConfig, bench

    result = bench(DispatchConfig(**options))
    print(result["table"], flush=True)
    if json_out is not None:
        from fedccrl_core.foundation.fsio import write_text

        write_text(json_out, json.dumps(result, indent=1))
    return result


@click.command("dispatch")
@click.option("--size", type=click.IntRange(8), default=32, show_default=True, help="image size (GPU: 224)")
@click.option("--batch-size", type=click.IntRange(2), default=32, show_default=True)
@click.option("--images-per-client", type=click.IntRange(2), default=64, show_default=True)
@click.option(
    "--backbone",
    type=click.Choice(["small_cnn", "mobilenet_v3_large"]),
    default="small_cnn",
    show_default=True,
    help="pretrained none",
)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--steps", type=click.IntRange(1), default=10, show_default=True, help="steps per measurement")
@click.option("--warmup", type=click.IntRange(0), default=3, show_default=True, help="untimed steps first")
@click.option(
    "--threads",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="torch threads (0: torch's default; 1 is steadier on a shared CPU)",
)
@click.option(
    "--code-path",
    type=click.Choice(["device", "cuda"]),
    default="device",
    show_default=True,
    help="cuda: run the CUDA fast path's code on this CPU, to count a GPU step's operators (CPU times)",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="also write the figures here")
def command(json_out, **options):
    """Operators dispatched, host ms and device reads per local step (torch.profiler): FedCCRL vs FedAvg."""
    run_stage(bench_dispatch, json_out, **options)
