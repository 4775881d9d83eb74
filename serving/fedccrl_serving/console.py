"""What `fedccrl-serve` says on stderr: notices (progress, fallbacks, skipped inputs) and the one-line fatal error.

stdout carries only results; everything here goes to stderr, prefixed `fedccrl-serve:`."""

from __future__ import annotations

import click

from fedccrl_core.foundation.errors import FedCCRLError


class Fatal(FedCCRLError):
    """Stops the command with one line on stderr and exit code 2."""


def note(msg: str) -> None:
    click.echo(f"fedccrl-serve: {msg}", err=True)
