"""`fedccrl-bench`: the benchmark commands as one click group, apart from the pipeline's `fedccrl` (benchmarks sit
on top of the pipeline and the library: nothing else imports them)."""

from __future__ import annotations

from fedccrl_core.foundation.threads import apply_thread_policy

apply_thread_policy()  # before anything imports torch: OpenMP reads it once (fedccrl_core/foundation/threads.py)

import click

from fedccrl_benchmarks import (
    accuracy,
    deploy_round,
    dispatch_cli,
    install_size,
    int8,
    repro,
    scale_cli,
    speed_cli,
    threads,
)
from fedccrl_core import __version__


@click.group()
@click.version_option(__version__, prog_name="fedccrl-bench")
def main():
    """fedccrl benchmarks: each prints ratios against a baseline run in the same run."""


for _command in (
    speed_cli.command,
    dispatch_cli.command,
    accuracy.command,
    scale_cli.command,
    threads.command,
    repro.command,
    int8.command,
    install_size.command,
    deploy_round.command,
):
    main.add_command(_command)


if __name__ == "__main__":
    main()
