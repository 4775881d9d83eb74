"""The sites' door to a SuperLink (fedccrl_flower/fleet_gate.py, `fedccrl federation gate`) and the operator's view
of its sites (`fedccrl federation status`), on loopback: the SuperLink on 127.0.0.1 (the operator's side), the gate
on 127.0.0.2 (the sites' side), one SuperNode joined through the gate.

- a site with only what a site gets (the Fleet address) cannot list runs, list nodes or register a key there, and
  its SuperNode joins; the operator, on 127.0.0.1, can;
- `fedccrl federation status` names the site that is up as connected with its node id, the other as not, and
  exits 1; every site up: exit 0.

Full tier: a SuperLink, a gate and a SuperNode as processes, and some ten `flwr` CLI runs: 46 s measured on 2 shared cores at
a load average of 5, 82 s above 10."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from flower_harness import wait_until

pytestmark = pytest.mark.full("a SuperLink, the gate and a SuperNode as processes, some ten flwr CLI runs")

SITE_SIDE = "127.0.0.2"


def _status(fed, tmp_path, sites: dict[str, str]) -> subprocess.CompletedProcess:
    doc = {
        "dataset": "embedded",
        "domains": ["art", "photo"],
        "classes": ["dog"],
        "image_size": 32,
        "resize_policy": "resize",
        "sites": [{"id": cid, "domain": cid.split("_")[0], "node_id": node} for cid, node in sites.items()],
    }
    path = tmp_path / "federation.json"
    path.write_text(json.dumps(doc))
    args = ["-m", "fedccrl_pipeline.cli", "federation", "status", "--federation", str(path), "--superlink", fed.address]
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def _answers(url: str, proc) -> bool:
    import httpx

    assert proc.alive(), proc.tail()
    try:
        return httpx.get(url, timeout=1).status_code == 404
    except httpx.HTTPError:
        return False


def test_a_site_reaches_the_fleet_api_only_and_the_operator_sees_who_is_connected(tmp_path):
    from fedccrl_flower.federation import Federation
    from fedccrl_flower.processes import BIN, Proc, flower_env, free_port, stop_all, wait_http

    port, gate_port = free_port(), free_port()
    op = Federation(tmp_path / "operator", f"127.0.0.1:{port}")
    site = Federation(tmp_path / "site", f"{SITE_SIDE}:{gate_port}")
    env = flower_env(op.flwr_home)
    procs = []
    try:
        link = [str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(port)]
        procs.append(Proc("superlink", [*link, "--disable-runtime-dependency-installation"], env, tmp_path / "l.log"))
        wait_http(f"http://127.0.0.1:{port}/health", procs[0], 60)
        gate = [sys.executable, "-m", "fedccrl_pipeline.cli", "federation", "gate", "--superlink", op.address]
        procs.append(Proc("gate", [*gate, "--listen", site.address], env, tmp_path / "gate.log"))
        wait_until(lambda: _answers(f"http://{site.address}/", procs[1]), 60, "the gate")  # 404: it listens
        node = [str(BIN / "flower-supernode"), "--insecure", "--superlink", site.address, "--port", str(free_port())]
        procs.append(Proc("supernode", node, env, tmp_path / "node.log"))

        def online() -> list[str]:
            listed = json.loads(op.flwr("supernode", "ls", "fedccrl", "--format", "json").stdout)
            return [n["node-id"] for n in listed["nodes"] if n["status"] == "online"]

        (node_id,) = wait_until(online, 90, "the SuperNode online through the gate")
        assert json.loads(op.flwr("ls", "fedccrl", "--format", "json").stdout)["success"]

        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f", str(tmp_path / "k")], check=True
        )
        for args in (("ls",), ("supernode", "ls"), ("supernode", "register", str(tmp_path / "k.pub"))):
            got = json.loads(site.flwr(*args, "fedccrl", "--format", "json").stdout)
            assert not got["success"] and "404 Not Found" in got["error-message"], (args, got)
        assert len(online()) == 1  # the refused register made no node

        missing = _status(op, tmp_path, {"art_c0": node_id, "photo_c0": "7"})
        assert missing.returncode == 1, missing.stderr
        assert missing.stdout.splitlines() == [
            f"art_c0\tconnected\tnode {node_id}\tonline",
            "photo_c0\tNOT connected\tnode 7\tnot registered",
        ]
        assert "not connected: photo_c0" in missing.stderr
        whole = _status(op, tmp_path, {"art_c0": node_id})
        assert whole.returncode == 0 and whole.stdout.startswith("art_c0\tconnected"), whole.stderr
    finally:
        stop_all(procs)
