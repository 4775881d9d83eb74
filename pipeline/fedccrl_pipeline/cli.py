"""`fedccrl`: the pipeline stages as one click group. Each stage lives in its own module."""

from __future__ import annotations

from collections.abc import Callable

from fedccrl_core.foundation.threads import apply_thread_policy

apply_thread_policy()  # before anything imports torch: OpenMP reads it once (fedccrl_core/foundation/threads.py)

import click

from fedccrl_core import __version__


def _download() -> click.Command:
    from fedccrl_pipeline import download

    return download.command


def _partition() -> click.Command:
    from fedccrl_pipeline import partition

    return partition.command


def _pools() -> click.Command:
    from fedccrl_pipeline import pools

    return pools.command


def _train() -> click.Command:
    from fedccrl_pipeline import train

    return train.command


def _evaluate() -> click.Command:
    from fedccrl_pipeline import evaluate

    return evaluate.command


def _report() -> click.Command:
    from fedccrl_pipeline import report

    return report.command


def _figures() -> click.Command:
    from fedccrl_pipeline import figures

    return figures.command


def _export() -> click.Command:
    from fedccrl_pipeline import export

    return export.command


def _audit() -> click.Command:
    from fedccrl_pipeline import audit

    return audit.command


def _federate() -> click.Command:
    from fedccrl_pipeline import federate

    return federate.command


def _evaluate_sites() -> click.Command:
    from fedccrl_pipeline import evaluate_sites

    return evaluate_sites.command


def _site() -> click.Command:
    from fedccrl_pipeline import site

    return site.command


def _deploy() -> click.Command:
    from fedccrl_pipeline import deploy_project

    return deploy_project.command


def _federation() -> click.Command:
    from fedccrl_pipeline import federation

    return federation.command


# stage name -> the function that imports its module (explicitly, when the stage runs) and returns its command
STAGES: dict[str, Callable[[], click.Command]] = {
    "download": _download,
    "partition": _partition,
    "pools": _pools,
    "train": _train,
    "evaluate": _evaluate,
    "report": _report,
    "figures": _figures,
    "export": _export,
    "audit": _audit,
    "federate": _federate,  # the operator's run over a deployment (docs/flower.md): project/dvc.yaml's stage
    "evaluate-sites": _evaluate_sites,  # a trained model at each site, without training: project/dvc.yaml's stage
}
# commands that are not pipeline stages (no dvc.yaml stage runs them), as above
COMMANDS = {**STAGES, "site": _site, "federation": _federation, "deploy": _deploy}


class _LazyGroup(click.Group):
    """Imports a stage's module only when it runs (one stage imports no other stage). Every stage validates the
    whole params.yaml first, without torch (the `train.<algorithm>` groups are declared in
    fedccrl_core/algorithm_params/): download, partition, pools, report and `fedccrl --help` import no torch
    (tests/test_layers.py)."""

    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        return COMMANDS[name]() if name in COMMANDS else None


@click.group(cls=_LazyGroup)
@click.version_option(__version__, prog_name="fedccrl")
def main():
    """fedccrl pipeline stages (run by `dvc repro`; see dvc.yaml for their arguments)."""


def entry() -> None:
    """The `fedccrl` command (pyproject.toml): the click group, ended as any Python program ends."""
    main()


if __name__ == "__main__":
    entry()
