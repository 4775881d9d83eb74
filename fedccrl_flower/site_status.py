"""Which of a federation file's sites are connected, from what the SuperLink knows (`fedccrl federation status`).

`flwr supernode ls --format json` (Flower 1.42) lists each node by its node id with its status (online, offline,
registered, unregistered), but neither its public key nor its name. A SuperNode that authenticates
(`--auth-supernode-private-key`) activates under the node id that `flwr supernode register` gave its public key,
so the federation file names each site's node id (`sites[].node_id`, fedccrl_flower/sites.py) and a site is
connected when its node is online. A site without a node id cannot be told apart from another SuperNode (an
`--insecure` rehearsal registers no key): it is reported as unknown, never as connected."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass

from fedccrl_flower.federation import CONNECTION, Federation
from fedccrl_flower.processes import FlowerRunError
from fedccrl_flower.sites import FederationFile

ONLINE = "online"


@dataclass(frozen=True)
class SiteStatus:
    client_id: str
    node_id: str | None
    node_status: str  # Flower's status of the node, "not registered", or "no node_id in the federation file"

    @property
    def connected(self) -> bool:
        return self.node_status == ONLINE


def superlink_nodes(fed: Federation, timeout_s: float = 120.0) -> dict[str, str]:
    """{node id: status} of every node the SuperLink knows; FlowerRunError with Flower's message otherwise."""
    try:
        p = fed.flwr("supernode", "ls", CONNECTION, "--format", "json", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise FlowerRunError(f"flwr supernode ls at {fed.address}: no answer within {timeout_s:.0f}s") from None
    try:
        doc = json.loads(p.stdout[p.stdout.index("{") :])
    except ValueError:
        doc = {}
    if p.returncode != 0 or not doc.get("success"):
        reason = doc.get("error-message") or f"{p.stdout[-2000:]}{p.stderr[-2000:]}"
        raise FlowerRunError(f"flwr supernode ls at {fed.address} failed: {reason}")
    return {str(n["node-id"]): str(n["status"]) for n in doc.get("nodes", [])}


def site_statuses(fed_file: FederationFile, nodes: dict[str, str]) -> list[SiteStatus]:
    """Each site of the file, in its order, with its node's status."""
    out = []
    for site in fed_file.sites:
        if site.node_id is None:
            status = "no node_id in the federation file"
        else:
            status = nodes.get(site.node_id, "not registered")
        out.append(SiteStatus(site.id, site.node_id, status))
    return out
