"""`fedccrl`: the pipeline stages as one click group. Each stage lives in its own module."""

from __future__ import annotations

import importlib

from fedccrl_core.foundation.threads import apply_thread_policy

apply_thread_policy()  # before anything imports torch: OpenMP reads it once (fedccrl_core/foundation/threads.py)

import click

from fedccrl_core import __version__

# stage name -> module under pipeline/ exposing a click command named `command`
STAGES = {
    "download": "fedccrl_pipeline.download",
    "partition": "fedccrl_pipeline.partition",
    "pools": "fedccrl_pipeline.pools",
    "train": "fedccrl_pipeline.train",
    "evaluate": "fedccrl_pipeline.evaluate",
    "report": "fedccrl_pipeline.report",
    "figures": "fedccrl_pipeline.figures",
    "export": "fedccrl_pipeline.export",
    "audit": "fedccrl_pipeline.audit",
    "federate": "fedccrl_pipeline.federate",  # the operator's run over a deployment (docs/flower.md), not a dvc.yaml stage
}
# commands that are not pipeline stages (no dvc.yaml stage runs them): name -> module, as above
COMMANDS = {**STAGES, "site": "fedccrl_pipeline.site"}


class _LazyGroup(click.Group):
    """Imports a stage's module only when it runs (one stage imports no other stage). Every stage validates the
    whole params.yaml first, without torch (the `train.<algorithm>` groups are declared in
    fedccrl_core/algorithm_params/): download, partition, pools, report and `fedccrl --help` import no torch
    (tests/test_layers.py)."""

    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        try:
            return importlib.import_module(COMMANDS[name]).command
        except ModuleNotFoundError as e:
            if e.name == COMMANDS[name]:
                return None
            raise


@click.group(cls=_LazyGroup)
@click.version_option(__version__, prog_name="fedccrl")
def main():
    """fedccrl pipeline stages (run by `dvc repro`; see dvc.yaml for their arguments)."""


def entry() -> None:
    """The `fedccrl` command (pyproject.toml): the click group, ended as any Python program ends."""
    main()


if __name__ == "__main__":
    entry()
