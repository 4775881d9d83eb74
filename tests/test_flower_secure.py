"""The documented secure Flower deployment (docs/flower.md, "Real deployment with TLS and SuperNode
authentication"), run as written on 127.0.0.1 with `localhost` for the host name:

  - the CA, the SuperLink's certificate, the SuperLink command and the sites' gate (`fedccrl federation gate`,
    the Fleet API alone) come from the page's first block, the key pair and `flwr supernode register` from the
    text after it, the SuperNode command from the site's block;
    the only rewrites are the host name, the port (a free one), the site's key name and node config,
    and a distinct runtime `--port` per SuperNode (several SuperNodes share this one host);
  - registered SuperNodes (one per source client) train one round of FedCCRL, and the result equals the
    in-process engine's (one torch thread on both sides, as in tests/test_flower.py);
  - a SuperNode whose key is not registered is refused (Flower exit code 305, activation failed), one
    without the CA fails the TLS handshake (305), the documented SuperNode with `--insecure` stops at once
    (303: an auth key needs TLS), and one `--insecure` without a key retries and never comes online;
  - a site, with the CA and the address it joins (the gate's), cannot list runs or register a key: the Control
    API is not there (404), while the operator uses it on 127.0.0.1;
  - `fedccrl federation status` over a federation file with the registered node ids: the online sites connected,
    a registered site that never came online not, exit code 1.

Full tier: about two minutes on 2 shared cores (RSA-4096 keys, a SuperLink, the gate, six SuperNodes, a round).
"""

from __future__ import annotations

import json
import re
import shlex
import ssl
import subprocess
import sys
import time

import pytest
from doc_blocks import BLOCKS, REPO
from flower_harness import SOURCES, assert_same_history, make_spec, node_config, run_inprocess, wait_until

PAGE = REPO / "docs" / "flower.md"

HOST = "superlink.example.org"  # the documented host name
PORT = "8000"  # the documented port the sites reach (the gate)
LINK_PORT = "9093"  # the documented port of the SuperLink itself, on 127.0.0.1

pytestmark = pytest.mark.full("a secure Flower deployment of real processes: a SuperLink, six SuperNodes, a round")


def recipe() -> tuple[str, str, str]:
    """The documented secure recipe: the SuperLink host's block (the SuperLink, then the sites' gate), the key
    registration (a code span of the text between the blocks: `ssh-keygen ... && flwr supernode register ...`),
    the site's block."""

    def pick(needle: str) -> str:
        (code,) = [b.code for b in BLOCKS if needle in b.code]
        return code

    (register,) = re.findall(r"`(ssh-keygen [^`]*&& flwr supernode register [^`]*)`", PAGE.read_text())
    return pick("flower-superlink --ssl-ca-certfile"), register, pick(f"flower-supernode --superlink {HOST}")


def localize(code: str, port: int, link_port: int) -> str:
    """The documented commands for this host: `localhost`, a free port for the gate and one for the SuperLink;
    fails when the recipe changed."""
    assert HOST in code or LINK_PORT in code, f"the documented recipe no longer names {HOST} or {LINK_PORT}:\n{code}"
    for old, new in (
        (f"{HOST}:{PORT}", f"localhost:{port}"),
        (f"0.0.0.0:{PORT}", f"0.0.0.0:{port}"),
        (f"127.0.0.1:{LINK_PORT}", f"127.0.0.1:{link_port}"),
        (f"--port {LINK_PORT}", f"--port {link_port}"),
        (HOST, "localhost"),
    ):
        code = code.replace(old, new)
    return code


def commands(code: str) -> list[str]:
    """One shell command per line, backslash continuations joined."""
    return [ln.strip() for ln in code.replace("\\\n", " ").splitlines() if ln.strip()]


def without(argv: list[str], flag: str) -> list[str]:
    """argv less `flag` and its value."""
    return argv[: argv.index(flag)] + argv[argv.index(flag) + 2 :]


def plain(argv: list[str]) -> list[str]:
    """`--insecure` in place of `--root-certificates certs/ca.crt`."""
    return [*without(argv, "--root-certificates"), "--insecure"]


@pytest.mark.timeout(900)  # 245 s measured on 2 loaded cores (load average about 20): the gate and ten flwr CLI runs
def test_the_documented_recipe_registers_supernodes_and_refuses_the_others(data, tmp_path):
    from fedccrl_flower.federation import Federation
    from fedccrl_flower.follow import wait_for_result
    from fedccrl_flower.processes import BIN, Proc, flower_env, free_port

    link_code, register_code, site_code = recipe()
    port, link_port = free_port(), free_port()
    ws = tmp_path / "ws"
    ws.mkdir()
    link = [ln for ln in commands(localize(link_code, port, link_port)) if not ln.startswith("#")]
    assert link[-2].startswith("flower-superlink ") and link[-2].endswith(" &"), link[-2]
    assert link[-1].startswith("fedccrl federation gate "), link[-1]
    setup = subprocess.run(
        ["bash", "-eo", "pipefail", "-c", "\n".join(link[:-2])], cwd=ws, capture_output=True, text=True, timeout=300
    )
    assert setup.returncode == 0, setup.stderr[-3000:]
    fed = Federation(ws, f"127.0.0.1:{link_port}", root_certificates=str(ws / "certs" / "ca.crt"))  # the operator
    env = flower_env(fed.flwr_home)
    procs: list[Proc] = []

    def start(name: str, cmd: str, extra_env: dict | None = None) -> Proc:
        argv = shlex.split(cmd)
        argv[0] = str(BIN / argv[0])
        procs.append(Proc(name, argv, {**env, **(extra_env or {})}, ws / "logs" / f"{name}.log", cwd=ws))
        return procs[-1]

    def register(site: str) -> str:
        p = subprocess.run(
            ["bash", "-eo", "pipefail", "-c", register_code.replace("site_art", site)],
            cwd=ws,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        return re.search(r"SuperNode (\d+) registered", p.stdout)[1]

    def supernode(name: str, site: str, cid: str, change=lambda argv: argv) -> Proc:
        argv = shlex.split(commands(localize(site_code, port, link_port))[0].replace("site_art", site))
        i = argv.index("--node-config")
        argv[i + 1] = " ".join(f'{k}="{v}"' for k, v in node_config(data, cid, tmp_path / "state" / name).items())
        argv = [*change(argv), "--port", str(free_port())]  # a runtime API port per SuperNode on this one host
        return start(name, shlex.join(argv), {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})

    try:
        superlink = start("superlink", link[-2].removesuffix(" &"))
        import httpx

        def healthy():
            assert superlink.alive(), superlink.tail()
            try:
                return httpx.get(
                    f"https://127.0.0.1:{link_port}/health",
                    timeout=1,
                    verify=ssl.create_default_context(cafile=ws / "certs" / "ca.crt"),
                ).is_success
            except httpx.HTTPError:
                return False

        wait_until(healthy, 120, "the SuperLink over TLS")
        start("gate", link[-1])
        ca = ssl.create_default_context(cafile=ws / "certs" / "ca.crt")

        def gate_listens():
            assert procs[-1].alive(), procs[-1].tail()
            try:
                return httpx.get(f"https://localhost:{port}/", timeout=1, verify=ca).status_code == 404
            except httpx.HTTPError:
                return False

        wait_until(gate_listens, 120, "the gate over TLS")
        nodes = {cid: register(f"site_{cid}") for cid in SOURCES}
        nodes["no_ca"], nodes["insecure_key"] = register("site_no_ca"), register("site_insecure_key")
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f", "keys/site_rogue"],
            cwd=ws,
            check=True,
            timeout=60,
        )  # made as the recipe makes a key, never registered
        for cid in SOURCES:
            supernode(cid, f"site_{cid}", cid)
        rogue = supernode("rogue", "site_rogue", SOURCES[0])
        no_ca = supernode("no_ca", "site_no_ca", SOURCES[0], lambda a: without(a, "--root-certificates"))
        insecure_key = supernode("insecure_key", "site_insecure_key", SOURCES[0], plain)
        insecure = supernode(
            "insecure", "site_insecure_key", SOURCES[0], lambda a: plain(without(a, "--auth-supernode-private-key"))
        )

        work = tmp_path / "work"
        spec = make_spec(data, work, "fedccrl", rounds=1, num_clients=3, min_clients=3, evaluators=[])
        res = wait_for_result(fed, fed.submit(spec), work, timeout=900)
        ref = run_inprocess(data, "fedccrl", rounds=1)
        assert [r.to_dict()["clients"] for r in res.history] == [3] and res.history[0].to_dict()["refused"] == 0
        assert all(f"train_acc/{cid}" in res.history[0].to_dict() for cid in SOURCES)
        assert_same_history(res.history, ref.history, tol=0.0, skip=("target_acc",))  # no site holds sketch here

        # Flower's exit codes (https://flower.ai/docs/framework/ref-exit-codes/): 305 no connection to the
        # SuperLink (activation refused, TLS handshake failed), 303 an auth key without TLS
        for proc, code, needle in (
            (rogue, 305, "Failed to activate SuperNode"),
            (no_ca, 305, "CERTIFICATE_VERIFY_FAILED"),
            (insecure_key, 303, "SuperNode authentication requires a secure TLS connection"),
        ):
            wait_until(lambda proc=proc: not proc.alive(), 120, f"{proc.name} to exit")
            log = proc.log_path.read_text()
            assert proc.popen.returncode != 0 and f"Exit Code: {code}" in log and needle in log, proc.tail()
        # without a key, plain HTTP to the TLS port: it retries, never joins
        assert insecure.alive() and "Connection attempt failed" in insecure.log_path.read_text()
        listed = fed.flwr("supernode", "list", "fedccrl", "--format", "json")
        status = {n["node-id"]: n["status"] for n in json.loads(listed.stdout[listed.stdout.index("{") :])["nodes"]}
        assert {cid: status[nodes[cid]] for cid in nodes} == {
            **dict.fromkeys(SOURCES, "online"),
            "no_ca": "registered",
            "insecure_key": "registered",
        }
        assert len(status) == len(nodes)  # neither the rogue key nor the keyless SuperNode became a node

        # a site, with the CA and the address it joins: no Control API there
        site = Federation(tmp_path / "site", f"localhost:{port}", root_certificates=str(ws / "certs" / "ca.crt"))
        for args in (("ls",), ("supernode", "register", str(ws / "keys" / "site_rogue.pub"))):
            got = site.flwr(*args, "fedccrl", "--format", "json")
            doc = json.loads(got.stdout[got.stdout.index("{") :])
            assert not doc["success"] and "404 Not Found" in doc["error-message"], (args, doc)
        assert len(json.loads(fed.flwr("supernode", "list", "fedccrl", "--format", "json").stdout)["nodes"]) == 5

        # the operator's view: the sites by client id, the one that never came online named
        sites = [{"id": cid, "domain": cid.split("_")[0], "node_id": nodes[cid]} for cid in SOURCES]
        sites.append({"id": "sketch_c0", "domain": "sketch", "node_id": nodes["no_ca"]})
        doc = {"dataset": "embedded", "domains": ["photo", "art", "cartoon", "sketch"], "classes": ["dog"]}
        (ws / "federation.json").write_text(json.dumps({**doc, "image_size": 32, "resize_policy": "r", "sites": sites}))
        cli = ["-m", "fedccrl_pipeline.cli", "federation", "status", "--federation", "federation.json"]
        cli += ["--superlink", fed.address, "--root-certificates", "certs/ca.crt"]
        got = subprocess.run([sys.executable, *cli], cwd=ws, capture_output=True, text=True, timeout=120)
        assert got.returncode == 1, got.stderr
        assert got.stdout.splitlines() == [
            *[f"{cid}\tconnected\tnode {nodes[cid]}\tonline" for cid in SOURCES],
            f"sketch_c0\tNOT connected\tnode {nodes['no_ca']}\tregistered",
        ]
        assert "not connected: sketch_c0" in got.stderr
    finally:
        for proc in reversed(procs):
            proc.stop()
        time.sleep(0.5)
