"""`fedccrl federation`: the operator's view of a running deployment (docs/flower.md).

- `gate`: the sites' door to the SuperLink, the Fleet API alone (fedccrl_flower/fleet_gate.py), so a site's machine
  cannot use the Control API (register keys, list runs, read logs, run or stop) that `flower-superlink` serves on
  the same address.
- `status`: the federation file's sites by client id, connected or not, with their node ids
  (fedccrl_flower/site_status.py); exit code 1 when a site is not connected."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import click

from fedccrl_flower.settings import superlink_address


def _address(ctx, param, value: str) -> str:
    try:
        return superlink_address(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.group()
def command() -> None:
    """The operator's commands of a deployment: the sites' gate, the sites' status."""


@command.command()
@click.option("--listen", required=True, callback=_address, help="host:port on the sites' interface (Fleet API)")
@click.option("--superlink", required=True, callback=_address, help="flower-superlink's host:port (operator's side)")
@click.option("--root-certificates", type=click.Path(dir_okay=False, exists=True), help="SuperLink's CA")
@click.option("--ssl-certfile", type=click.Path(dir_okay=False, exists=True), help="gate's certificate")
@click.option("--ssl-keyfile", type=click.Path(dir_okay=False, exists=True), help="gate's private key")
def gate(listen: str, superlink: str, root_certificates, ssl_certfile, ssl_keyfile) -> None:
    """Forward the sites' Fleet API requests to the SuperLink, and nothing else, until stopped."""
    from fedccrl_flower.fleet_gate import GateConfig, serve_gate

    if bool(ssl_certfile) != bool(ssl_keyfile):
        raise click.UsageError("--ssl-certfile and --ssl-keyfile go together (the gate's TLS towards the sites)")
    print(f"federation gate: Fleet API on {listen} -> SuperLink {superlink}", file=sys.stderr, flush=True)
    serve_gate(GateConfig(listen, superlink, root_certificates or "", ssl_certfile or "", ssl_keyfile or ""))


@command.command()
@click.option("--federation", "federation_path", required=True, type=click.Path(dir_okay=False))
@click.option("--superlink", required=True, callback=_address, help="the SuperLink's Control API, host:port")
@click.option("--root-certificates", type=click.Path(dir_okay=False, exists=True), help="SuperLink's CA")
def status(federation_path: str, superlink: str, root_certificates) -> None:
    """Each site of the federation file by client id: connected or not, and its node id. Exit code 1 when one is
    not connected, 2 on an error."""
    from fedccrl_flower.federation import Federation
    from fedccrl_flower.site_status import site_statuses, superlink_nodes
    from fedccrl_flower.sites import read_federation
    from fedccrl_pipeline.stage_runtime import run_stage

    def run() -> int:
        fed_file = read_federation(federation_path)
        with tempfile.TemporaryDirectory(prefix="fedccrl-status-") as tmp:
            nodes = superlink_nodes(Federation(Path(tmp), superlink, root_certificates or "", log=lambda m: None))
        rows = site_statuses(fed_file, nodes)
        for r in rows:
            state = "connected" if r.connected else "NOT connected"
            click.echo(f"{r.client_id}\t{state}\tnode {r.node_id or '-'}\t{r.node_status}")
        missing = [r.client_id for r in rows if not r.connected]
        if missing:
            click.echo(f"federation status: not connected: {', '.join(missing)}", err=True)
        return 1 if missing else 0

    sys.exit(run_stage(run))  # a bad file or an unreachable SuperLink: `error: ...`, exit code 2
