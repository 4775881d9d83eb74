"""`fedccrl-bench scale`: seconds per round, peak RSS (child process), checkpoint bytes and bytes sent,
for the same total data split over 6, 30, 120 and 300 clients (benchmarks/fedccrl_benchmarks/scale.py)."""

from __future__ import annotations

import click

from fedccrl_pipeline.stage_runtime import run_stage


def _ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"must be comma-separated integers, got {text!r}", param_hint="--clients") from None
    if not vals or min(vals) < 1:
        raise click.BadParameter(f"must be integers >= 1, got {text!r}", param_hint="--clients")
    return sorted(set(vals))


def run(algorithms, clients, total, size, rounds, batch_size, threads, client_state):
    from fedccrl_benchmarks.scale import bench_scale, table

    res = bench_scale(algorithms, clients, total, size, rounds, batch_size, threads, client_state)
    print(
        f"same total data ({total} images, {size}px, small CNN) over {clients} clients, every client "
        f"trains each round, {rounds} rounds, {threads} thread(s), client_state={client_state}; "
        "phases are wall seconds per round (train includes the streamed Eq. 2 and appending the trained clients' "
        "states); CPU s = the child's user + system time; x6 = ratio to the fewest clients"
    )
    print(table(res))
    return res


@click.command("scale")
@click.option("--algorithms", default="fedavg,fedccrl", show_default=True)
@click.option("--clients", default="6,30,120,300", show_default=True, help="client counts, comma-separated")
@click.option("--total", type=click.IntRange(6), default=3840, show_default=True, help="images in all")
@click.option("--size", type=click.IntRange(8), default=32, show_default=True)
@click.option("--rounds", type=click.IntRange(1), default=2, show_default=True)
@click.option("--batch-size", type=click.IntRange(2), default=32, show_default=True)
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True)
@click.option("--client-state", type=click.Choice(["persistent", "stateless"]), default="persistent", show_default=True)
def command(algorithms, clients, total, size, rounds, batch_size, threads, client_state):
    """Round cost against the client count, the total data fixed (FedDG-Bench sweeps the client count)."""
    from fedccrl_core.algorithms import ALGORITHMS

    algs = [a.strip() for a in algorithms.split(",") if a.strip()]
    bad = [a for a in algs if a not in ALGORITHMS]
    if bad or not algs:
        raise click.BadParameter(
            f"unknown algorithm(s) {bad}; choose from {', '.join(ALGORITHMS)}", param_hint="--algorithms"
        )
    run_stage(run, algs, _ints(clients), total, size, rounds, batch_size, threads, client_state)
