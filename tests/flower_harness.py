"""The Flower tests' harness (tests/test_flower.py, test_flower_secure.py, test_fedccrl_variant.py): the federation
they share (the embedded default, K = 1 client per domain, held-out sketch: three source clients), the in-process
reference run, a loopback Grid (Flower's Grid contract in one process), the ServerApp on a simulated clock, and
the comparisons. The data itself is conftest.py's `data` fixture (build_data here)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from fixtures import held_out_run, write_params

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.federation.driver import build_seeded_model, train
from fedccrl_core.learning.clients import ClientData
from fedccrl_flower import messages as M

REPO = Path(__file__).resolve().parents[1]

BIN = Path(sys.executable).parent
HELD_OUT = "sketch"
SOURCES = ["art_c0", "cartoon_c0", "photo_c0"]
EVALUATORS = ["sketch_c0"]  # the held-out domain's site: it evaluates the target, never trains
SEED = 0
LOCAL = dict(
    rounds=2,
    local_epochs=1,
    batch_size=32,
    lr=1e-3,
    weight_decay=1e-4,
    lr_schedule="cosine",
    mean=[0.485, 0.456, 0.406],
    std=[0.229, 0.224, 0.225],
)


HPARAMS = {"ccst": {"adain_weights": "random", "K": 2}}  # seeded random AdaIN networks: no download


def make_spec(data: Path, work: Path, algorithm="fedccrl", rounds=2, privacy=None, **kw):
    from fedccrl_flower.spec import ServerSpec

    local = {**LOCAL, "rounds": rounds, **({"privacy": privacy} if privacy else {})}
    alg = build_algorithm(algorithm, LocalConfig(**local), HPARAMS.get(algorithm))
    return ServerSpec(
        algorithm=algorithm,
        local=local,
        hparams=alg.hp.model_dump(),
        backbone="small_cnn",
        num_classes=6,
        seed=SEED,
        held_out=kw.pop("held_out", HELD_OUT),
        sources=kw.pop("sources", SOURCES),
        evaluators=kw.pop("evaluators", EVALUATORS),
        work_dir=str(work),
        device="cpu",
        run_info={"test": algorithm, "rounds": rounds},
        **kw,
    )


def run_inprocess(data: Path, algorithm="fedccrl", rounds=2, client_state="persistent", privacy=None, sites=None):
    """pipeline/fedccrl_pipeline/train.py's construction of the in-process engine, on the same data: the central
    partition's `data/{shards,pools}`, or with `sites` ({client id: a site's folder}, `imagefolder_sites`) each
    client's and the held-out domain's site's own folder."""
    from fedccrl_core.data.pools import load_pool
    from fedccrl_core.data.shards import load_client, load_domain_test

    def folder(cid: str) -> Path:
        return sites[cid] if sites else data

    clients = []
    for cid in SOURCES:
        s = load_client(folder(cid) / "shards", cid)
        mu, sigma = load_pool(folder(cid) / "pools", cid)
        clients.append(
            ClientData.from_numpy(s.client_id, s.domain, s.train_x, s.train_y, s.val_x, s.val_y, "cpu", mu, sigma)
        )
    local = LocalConfig(
        **{**LOCAL, "rounds": rounds, "mean": tuple(LOCAL["mean"]), "std": tuple(LOCAL["std"]), "privacy": privacy}
    )
    alg = build_algorithm(algorithm, local, HPARAMS.get(algorithm))
    model = build_seeded_model(alg, "small_cnn", 6, "none", SEED)
    target = load_domain_test(folder(EVALUATORS[0]) / "shards", HELD_OUT, privacy is not None)
    run = held_out_run(alg, model, clients, target, rounds, seed=SEED, batch_size=256, client_state=client_state)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the SuperNodes below (client_threads=1): CPU sums depend on the thread count
    try:
        return train(run, log=lambda m: None)
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- a loopback Grid (no processes)
class LoopbackGrid:
    """Flower's Grid contract in one process (get_node_ids, push_messages, pull_messages: what the ServerApp's
    transport.exchange calls): each message and reply is deflated to Flower's wire objects and inflated back; every node has its own Context (node config, persistent state).
    `dead` nodes never answer; `tamper(node, reply)` may rewrite a reply (a malicious client);
    `delay(node, msg)` -> seconds a reply takes on the simulated clock `now` (a slow client);
    `leave` nodes leave the SuperLink once a message was sent to them: their messages are answered with
    the SuperLink's NODE_UNAVAILABLE error, as Flower's SuperLink does once a node's heartbeat expired."""

    def __init__(self, node_configs: dict[int, dict], run_config: dict | None = None):
        from flwr.app import Context, RecordDict
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
        self.contexts = {
            n: Context(run_id=1, node_id=n, node_config=dict(c), state=RecordDict(), run_config=dict(run_config or {}))
            for n, c in node_configs.items()
        }
        self.inbox: dict[str, object] = {}
        self.dead: set[int] = set()
        self.tamper = None
        self.delay = None
        self.leave: set[int] = set()
        self.now = [0.0]  # the simulated clock serve() runs the server on
        self.held: dict[str, tuple[float, object]] = {}  # message id -> (ready at, reply)
        self.sent: list = []

    @staticmethod
    def wire(msg):
        from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
        from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

        mid = msg.object_id
        out = inflate_object_from_contents(mid, {k: o.deflate() for k, o in get_all_nested_objects(msg).items()})
        out.metadata.__dict__["_message_id"] = mid
        return out

    def get_node_ids(self):
        gone = self.leave & {m.metadata.dst_node_id for m in self.sent}
        return sorted(set(self.contexts) - gone)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id
            self.inbox[m.object_id] = self.wire(m)
            self.sent.append(m)
            ids.append(m.object_id)
        return ids

    def pull_messages(self, message_ids):
        from flwr.app import Error, Message
        from flwr.common.constant import ErrorCode

        from fedccrl_flower.client_app import handle_evaluate, handle_query, handle_train
        from fedccrl_flower.site_eval_client import handle_site_evaluate, handle_site_query

        handlers = {M.QUERY: handle_query, M.TRAIN: handle_train, M.EVALUATE: handle_evaluate}
        handlers.update({M.SITE_EVAL_QUERY: handle_site_query, M.SITE_EVAL: handle_site_evaluate})

        out = []
        for mid in list(message_ids):
            if mid not in self.held:
                msg = self.inbox.get(mid)
                node = msg.metadata.dst_node_id
                if node in self.dead:
                    continue
                if node in self.leave:
                    del self.inbox[mid]
                    self.held[mid] = (
                        self.now[0],
                        self.wire(
                            Message(
                                Error(code=ErrorCode.NODE_UNAVAILABLE, reason="Error: Node Unavailable"), reply_to=msg
                            )
                        ),
                    )
                    continue
                del self.inbox[mid]
                handler = handlers[msg.metadata.message_type]
                try:
                    reply = handler(msg, self.contexts[node])
                except Exception as e:  # what Flower returns when a ClientApp raises
                    reply = Message(Error(code=2, reason=f"{e.__class__.__name__}: {e}"), reply_to=msg)
                if self.tamper is not None:
                    reply = self.tamper(node, reply)
                self.held[mid] = (self.now[0] + (self.delay(node, msg) if self.delay else 0.0), self.wire(reply))
            if self.held[mid][0] <= self.now[0]:
                out.append(self.held.pop(mid)[1])
        return out


def loopback(data: Path, clients=(*SOURCES, *EVALUATORS), state_dir: Path | None = None) -> LoopbackGrid:
    cfgs = {}
    for i, cid in enumerate(clients):
        c = {M.NODE_CLIENT_ID: cid, M.NODE_SHARDS: str(data / "shards"), M.NODE_POOLS: str(data / "pools")}
        if state_dir is not None:
            c[M.NODE_STATE_DIR] = str(state_dir)
        cfgs[100 + i] = c
    return LoopbackGrid(cfgs)


def serve(grid, spec, log=None):
    """The ServerApp's loop on a simulated clock (timeouts pass instantly), one torch thread."""
    from fedccrl_flower.server_app import FlowerServer

    now = getattr(grid, "now", [0.0])

    def sleep(s):
        now[0] += s

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return FlowerServer(grid, spec, log=log or (lambda m: None), sleep=sleep, clock=lambda: now[0]).run()
    finally:
        torch.set_num_threads(threads)


class LoopbackFederation:
    """fedccrl_flower/run.py's LocalFederation over the loopback Grid: the SuperNodes run_flower adds are the loopback's
    nodes, with the node configs it gives them (client-state folder included); a submitted run is the ServerApp run
    here, on the simulated clock, reporting to <work_dir>/run-1/ as Flower's run 1."""

    def __init__(self, workdir: Path, simulation: bool = False, log=None):
        self.configs: dict[int, dict] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_supernode(self, name: str, node_config: dict, threads: int = 0, wait: bool = True) -> None:
        self.configs[100 + len(self.configs)] = dict(node_config)

    def wait_supernodes(self) -> None:
        pass

    def submit(self, spec, run_config=None, federation_config: str = "") -> int:
        from fedccrl_flower.server_app import FlowerServer
        from fedccrl_flower.spec import report_dir

        grid = LoopbackGrid(self.configs)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            FlowerServer(
                grid,
                spec,
                report_dir=report_dir(spec.work_dir, 1),
                run_id=1,
                log=lambda m: None,
                sleep=lambda s: grid.now.__setitem__(0, grid.now[0] + s),
                clock=lambda: grid.now[0],
            ).run()
        finally:
            torch.set_num_threads(threads)
        return 1

    def check_alive(self) -> None:
        pass

    def status(self, run_id: int) -> dict:
        return {"status": "finished:completed"}


def assert_same_history(a: list, b: list, tol=0.0, skip=()):
    """Two runs' round records (RoundRecord) agree. `skip`: fields not compared (a deployment without the held-out
    domain's site has no target accuracy)."""
    assert [r.round for r in a] == [r.round for r in b]
    for ra, rb in zip(a, b):
        for k in ("val_acc", "target_acc", "loss", "train_acc", "l_cls", "l_ra", "l_js"):
            if k in skip:
                continue
            va, vb = ra.metric(k), rb.metric(k)
            if va is not None or vb is not None:
                assert va is not None and vb is not None and abs(va - vb) <= tol, (ra.round, k, va, vb)


def build_data(ws: Path, partition: dict | None = None) -> Path:
    """The embedded default partitioned by `partition` (dotted keys; default one client per domain), through the
    stage commands: <ws>/data/{raw,shards,pools}."""
    write_params(ws, partition or {"partition.clients_per_domain": 1})
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    for args in (
        ["download", "--out", "data/raw", "--report", "data/download.json"],
        ["partition", "--raw", "data/raw", "--out", "data/shards"],
        ["pools", "--shards", "data/shards", "--out", "data/pools"],
    ):
        p = subprocess.run([str(BIN / "fedccrl"), *args], cwd=ws, env=env, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-3000:]
    return ws / "data"


def imagefolder_sites(data: Path, ws: Path) -> tuple[dict[str, Path], Path]:
    """The consortium of tests/test_site_eval.py: four `imagefolder` sites, each with one domain of the embedded images
    (`data/raw/<domain>`) copied into its own folder as if it had always been there, and an operator. The operator's
    params.yaml names dataset.name imagefolder and no dataset.source; it publishes the class file from its own test
    folder of the held-out domain (`fedccrl site classes --images`) and the federation file (`fedccrl site
    federation`); each site runs `fedccrl site prepare` on its folder, whose manifest knows only its own domain.
    -> ({client id: the site's prepared folder (shards/, pools/)}, the federation file)."""
    import shutil

    from click.testing import CliRunner

    from fedccrl_pipeline.cli import main

    def fedccrl(*args) -> None:
        res = CliRunner().invoke(main, [str(a) for a in args])
        assert res.exit_code == 0, res.output[-3000:]
        return res.stdout

    operator = ws / "operator"
    params = write_params(operator, {"dataset.name": "imagefolder", "preprocess.image_size": 32})
    shutil.copytree(data / "raw" / HELD_OUT, operator / "test-images")
    (operator / "classes.txt").write_text(
        fedccrl("site", "classes", "--params", params, "--images", operator / "test-images")
    )
    site_args = [a for cid in (*SOURCES, *EVALUATORS) for a in ("--site", f"{cid}={cid.rsplit('_c', 1)[0]}")]
    federation = operator / "federation.json"
    fedccrl(
        "site", "federation", "--params", params, "--classes", operator / "classes.txt", *site_args, "--out", federation
    )
    sites = {}
    for cid in (*SOURCES, *EVALUATORS):
        domain, site = cid.rsplit("_c", 1)[0], ws / f"site-{cid}"
        shutil.copytree(data / "raw" / domain, site / "images")
        shutil.copy2(operator / "classes.txt", site / "classes.txt")  # what the operator published
        args = ["--images", site / "images", "--domain", domain, "--client-id", cid, "--classes", site / "classes.txt"]
        fedccrl("site", "prepare", *args, "--params", params, "--out", site / "prepared")
        sites[cid] = site / "prepared"
    return sites, federation


def node_config(data: Path, cid: str, state_dir: Path) -> dict:
    return {
        M.NODE_CLIENT_ID: cid,
        M.NODE_SHARDS: str(data / "shards"),
        M.NODE_POOLS: str(data / "pools"),
        M.NODE_STATE_DIR: str(state_dir),
    }


def wait_until(pred, timeout: float, what: str, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = pred()
        if out:
            return out
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
