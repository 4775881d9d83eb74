"""The Flower engine (fedccrl_flower): message (de)serialization and validation, the ServerApp's round
loop over a loopback Grid (every message makes Flower's wire round trip) for every registered
algorithm against the in-process engine, faults (dead client, min_clients, malformed updates,
ServerApp resume), and real processes: a SuperLink and three SuperNodes on 127.0.0.1
(`--insecure`; the SuperNodes run from the installed wheel, outside the checkout: `deployment`), one
SuperNode of the wheel alone completing a round, and `flwr run` on a simulation SuperLink (Ray, offline).

The fast tier (`make test`) runs the message checks and the loopback; the full tier (`make test-all`) adds
the real processes: the deployment end to end (~95 s on 2 shared CPU cores: Flower 1.42 starts a fresh
ClientApp process, i.e. a torch import, per message), the process-level fault test (kill -9 a SuperNode
mid-round, restart it, `flwr stop` + rerun; ~2-2.5 min, mostly timeouts), the process-level malformed update
(~65 s), `flwr run` on a simulation SuperLink, `fedccrl train` with `train.engine: flower` (~75 s), and CCST /
FedADG on the loopback.

Data: the embedded default (synthetic, 32 px) with K=1 client per domain, held-out sketch -> three
source clients (photo_c0, art_c0, cartoon_c0), 216 training samples each. The Flower processes run
one torch thread per client (client_threads=1 / Ray's one CPU per ClientApp), so the in-process
reference does too: CPU float sums depend on the thread count, and with equal counts the two
engines agree bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import held_out_run
from flower_harness import (
    HELD_OUT,
    HPARAMS,
    LOCAL,
    REPO,
    SEED,
    SOURCES,
    LoopbackGrid,
    assert_same_history,
    build_data,
    loopback,
    make_spec,
    node_config,
    run_inprocess,
    serve,
    wait_until,
)

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import ALGORITHMS, build_algorithm
from fedccrl_core.data.shards import load_domain_test
from fedccrl_core.federation.driver import build_seeded_model, train
from fedccrl_core.foundation import contract
from fedccrl_flower import messages as M


@pytest.fixture(scope="module")
def inprocess_fedccrl(data):
    t0 = time.perf_counter()
    res = run_inprocess(data, "fedccrl", 2)
    print(f"in-process FedCCRL, 2 rounds x 3 clients: {time.perf_counter() - t0:.1f}s")
    return res


# ================================================================ unit: messages
def test_array_record_round_trip_and_decoding_checks():
    from flwr.app import Array, ArrayRecord

    sd = {"w": torch.randn(3, 2), "bn.num_batches_tracked": torch.tensor(7), "b": torch.zeros(0)}
    back = M.record_to_arrays(M.arrays_to_record(sd), "x")
    assert set(back) == set(sd) and all(np.array_equal(back[k], sd[k].numpy()) for k in sd)
    assert back["bn.num_batches_tracked"].dtype == np.int64 and back["w"].flags.writeable
    good = Array(np.zeros((2, 3), np.float32))
    lying = Array(dtype="float32", shape=(3, 2), stype=good.stype, data=good.data)  # declares another shape
    with pytest.raises(M.MalformedUpdate, match="declares float32\\[3, 2\\] but holds float32\\[2, 3\\]"):
        M.record_to_arrays(ArrayRecord({"w": lying}), "weights of c")
    garbage = Array(dtype="float32", shape=(2,), stype=good.stype, data=b"\x93NUMPY not really")
    with pytest.raises(M.MalformedUpdate, match="cannot be decoded"):
        M.record_to_arrays(ArrayRecord({"w": garbage}), "weights of c")
    text = Array(np.array(["a", "b"]))
    with pytest.raises(M.MalformedUpdate, match="non-numeric"):
        M.record_to_arrays(ArrayRecord({"w": text}), "weights of c")


def test_validate_weights_refuses_mismatches():
    ref = {"conv.weight": torch.zeros(4, 3), "bn.num_batches_tracked": torch.tensor(0)}
    ok = {"conv.weight": np.ones((4, 3), np.float32), "bn.num_batches_tracked": np.array(3)}
    out = M.validate_weights(ok, ref, "weights of a")
    assert torch.equal(out["conv.weight"], torch.ones(4, 3)) and out["bn.num_batches_tracked"].item() == 3
    cases = {
        "keys differ": {"conv.weight": ok["conv.weight"]},
        "unexpected \\['x'\\]": {**ok, "x": np.zeros(1, np.float32)},
        "shape \\[3, 4\\], expected \\[4, 3\\]": {**ok, "conv.weight": np.zeros((3, 4), np.float32)},
        "dtype float64, expected float32": {**ok, "conv.weight": np.zeros((4, 3), np.float64)},
        "NaN or infinite": {**ok, "conv.weight": np.full((4, 3), np.nan, np.float32)},
    }
    for pattern, bad in cases.items():
        with pytest.raises(M.MalformedUpdate, match=pattern):
            M.validate_weights(bad, ref, "weights of a")


def test_upload_checks_and_consensus_signature():
    up = {"mu": np.zeros((22, 3), np.float32), "sigma": np.ones((22, 3), np.float32)}
    M.validate_upload(up, "u")
    with pytest.raises(M.MalformedUpdate, match="NaN"):
        M.validate_upload({**up, "mu": np.full((22, 3), np.inf, np.float32)}, "u")
    sig = M.upload_signature(up)
    assert M.upload_signature({k: v[:3] for k, v in up.items()}) == sig  # row counts may differ (ceil(r n_i))
    odd = M.upload_signature({"mu": np.zeros((5, 4), np.float32), "sigma": np.zeros((5, 4), np.float32)})
    unpaired = M.upload_signature({**up, "sigma": np.ones((21, 3), np.float32)})  # rows no longer paired
    assert len({sig, odd, unpaired}) == 3
    assert M.consensus_signature({"a": sig, "b": odd, "c": sig, "d": unpaired, "e": None}) == sig
    assert M.consensus_signature({"a": odd, "b": sig}) == odd  # a tie: the first client id's
    assert M.consensus_signature({"a": None}) is None
    generic = {"mean": np.zeros(8, np.float32), "n": np.array(3)}  # a vector and a scalar are fine
    M.validate_upload(generic, "u")
    assert M.upload_signature(generic) == M.upload_signature({"mean": np.ones(8, np.float32), "n": np.array(5)})


def test_pack_tree_round_trips_client_state():
    """ClientState (Adam + cosine schedule + extra incl. bf16 and int-keyed dicts) through
    ArrayRecord + ConfigRecord, and training continues identically from the restored state."""
    from fedccrl_core.learning.clients import ClientState
    from fedccrl_flower import state_tree

    def make():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        opt = torch.optim.Adam(net.parameters(), lr=1e-3, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)
        return net, opt, sched

    net, opt, sched = make()
    x = torch.randn(8, 4)
    for _ in range(2):
        net(x).square().mean().backward()
        opt.step()
        sched.step()
    state = ClientState(
        opt.state_dict(),
        sched.state_dict(),
        {"bn": {1: torch.ones(2, dtype=torch.bfloat16)}, "t": (1, 2.5, None, "s"), "np": np.arange(3)},
    )
    arrays, tree = state_tree.pack_tree(state.to_dict())
    back = ClientState.from_dict(state_tree.unpack_tree(arrays, tree))
    assert back.extra["bn"][1].dtype == torch.bfloat16 and back.extra["t"] == (1, 2.5, None, "s")
    assert np.array_equal(back.extra["np"], np.arange(3))
    net2, opt2, sched2 = make()
    net2.load_state_dict(net.state_dict())
    opt2.load_state_dict(back.optimizer)
    sched2.load_state_dict(back.scheduler)
    for n, o, sc in ((net, opt, sched), (net2, opt2, sched2)):
        o.zero_grad()
        n(x).square().mean().backward()
        o.step()
        sc.step()
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), net2.parameters()))
    assert sched.get_last_lr() == sched2.get_last_lr()


def test_a_site_refuses_a_release_above_the_charged_ratio_before_any_row():
    """The site-side check (site_data.py release_refusal): its k_i = ceil(r n_i) of n_i (Eq. 8) against the QUERY
    config's charged (n, k) (messages.py F_CHARGED, read or refused naming the field)."""
    from flwr.app import ConfigRecord

    from fedccrl_core.privacy.charged import ChargedRelease
    from fedccrl_flower.site_data import release_refusal

    priv = {"enabled": True, "stats_noise_multiplier": 2.0, "weights_noise_multiplier": 4.0, "max_epsilon": 5.0}
    alg = build_algorithm("fedccrl", LocalConfig(rounds=2, privacy=priv))
    charged = ChargedRelease(216, 22)
    assert [release_refusal(alg, n, charged) for n in (216, 220, 1000)] == ["", "", ""]  # k = 22, 22, 100
    assert release_refusal(alg, 11, charged) == charged.refusal(11, 2)  # k = ceil(0.1 * 11) = 2: refused
    assert release_refusal(alg, 215, charged) == charged.refusal(215, 22) != ""
    assert release_refusal(alg, 11, None) == ""  # nothing charged (no max_epsilon): nothing to refuse
    with pytest.raises(ValueError, match="fedavg, which uploads no statistics rows"):
        release_refusal(build_algorithm("fedavg", LocalConfig(rounds=2)), 11, charged)
    assert M.read_charged(ConfigRecord({M.F_CHARGED: M.charged_field(charged)})) == charged
    assert M.read_charged(ConfigRecord({})) is None
    for bad in ([216], [216, 0], [22, 216], [216.0, 22.0], "216,22"):
        with pytest.raises(ValueError, match=f"QUERY config '{M.F_CHARGED}'"):
            M.read_charged(ConfigRecord({M.F_CHARGED: bad}))


def test_message_keys_are_defined_once():
    """Client and server share messages.py's keys; neither spells a record key as a bare string."""
    for f in ("client_app.py", "server_app.py", "query_phase.py", "train_phase.py", "evaluate_phase.py"):
        src = (REPO / "fedccrl_flower" / f).read_text()
        assert '"fedccrl.' not in src, f
    keys = [M.CONFIG, M.INFO, M.UPLOAD, M.PAYLOAD, M.WEIGHTS, M.METRICS, M.EVAL, M.STATE_ARRAYS, M.STATE_TREE]
    assert len(set(keys)) == len(keys)


def test_flower_settings_validation():
    from fedccrl_core.foundation.hparams import validate
    from fedccrl_flower.settings import FlowerSettings

    def from_mapping(d):  # as params.yaml's train.flower is validated (pipeline/fedccrl_pipeline/params.py)
        return validate(FlowerSettings, d, prefix="train.flower")

    assert from_mapping({"mode": "simulation", "min_clients": 3}).min_clients == 3
    with pytest.raises(ValueError, match="'train.flower.min_client': unknown key"):
        from_mapping({"min_client": 2})
    with pytest.raises(ValueError, match="'train.flower.mode': got 'grpc'; must be one of deployment, simulation"):
        from_mapping({"mode": "grpc"})
    with pytest.raises(ValueError, match="'train.flower.min_clients': got 0; must be an integer >= 1"):
        from_mapping({"min_clients": 0})
    with pytest.raises(ValueError, match="'train.flower.client_cpus': got 0.5; must be an integer"):  # Flower's uint32
        from_mapping({"client_cpus": 0.5})


def test_client_state_slots_survive_a_retrained_round(tmp_path):
    """Round t starts from the newest state made before t, from Context.state or the disk mirror:
    a round retrained after a ServerApp resume starts from the same state as the first time."""
    from flwr.app import Context, RecordDict

    from fedccrl_core.learning.clients import ClientState
    from fedccrl_flower.client_state import load_client_state, save_client_state

    key = "k1"  # the run's state key (ClientSpec.state_key)
    ctx = Context(run_id=1, node_id=1, node_config={M.NODE_STATE_DIR: str(tmp_path)}, state=RecordDict(), run_config={})
    st, base = load_client_state(ctx, key, "a", 1)
    assert st.optimizer is None and base is None
    for rnd in (1, 2):
        st, base = load_client_state(ctx, key, "a", rnd)
        save_client_state(
            ctx,
            key,
            "a",
            rnd,
            ClientState({"r": torch.tensor(float(rnd))}, None, {"bank": {"mu": np.full(2, rnd, np.float32)}}),
            base,
        )
    assert load_client_state(ctx, key, "a", 3)[0].optimizer["r"].item() == 2.0
    st, base = load_client_state(ctx, key, "a", 2)  # round 2 again (a resumed ServerApp): from round 1
    assert st.optimizer["r"].item() == 1.0
    st.optimizer["r"].add_(100.0)  # optimizers update loaded tensors in place: the saved slot must not change
    save_client_state(ctx, key, "a", 2, st, base)
    assert load_client_state(ctx, key, "a", 2)[0].optimizer["r"].item() == 1.0
    fresh = Context(
        run_id=2, node_id=7, node_config={M.NODE_STATE_DIR: str(tmp_path)}, state=RecordDict(), run_config={}
    )  # a restarted SuperNode / a new run: the disk mirror
    assert load_client_state(fresh, key, "a", 3)[0].optimizer["r"].item() == 101.0  # the retrained round 2
    assert np.array_equal(load_client_state(fresh, key, "a", 2)[0].extra["bank"]["mu"], [1.0, 1.0])
    assert sorted(p.suffix for p in tmp_path.rglob("*.*")) == [".npz"]  # one file per client, no pickle
    assert load_client_state(fresh, "other", "a", 3)[0].optimizer is None


def test_launcher_rejects_impossible_min_clients_before_starting_processes(data, tmp_path):
    from fedccrl_flower.run import run_flower
    from fedccrl_flower.settings import FlowerSettings

    with pytest.raises(ValueError, match="min_clients is 4 but held-out sketch leaves 3 source clients"):
        run_flower(FlowerSettings(min_clients=4), make_spec(data, tmp_path), data / "shards", data / "pools")
    assert not (tmp_path / "federation").exists()


def test_stopping_a_process_leaves_none_of_its_group_or_descendants(tmp_path):
    """processes.Proc: stop() ends the child, its process group and a descendant that left the group for a
    session of its own (as Flower's SuperExec does), waiting for them with psutil.wait_procs."""
    import psutil

    from fedccrl_flower.processes import Proc

    script = "setsid sleep 300 & echo $! > detached; sleep 300 & sleep 300"
    proc = Proc("tree", ["bash", "-c", script], dict(os.environ), tmp_path / "tree.log", cwd=tmp_path)
    wait_until(
        lambda: (tmp_path / "detached").read_text().strip() if (tmp_path / "detached").is_file() else "",
        30,
        "the detached child",
    )
    wait_until(lambda: len(psutil.Process(proc.pid).children(recursive=True)) >= 2, 30, "the children")
    tree = [
        psutil.Process(proc.pid),
        *psutil.Process(proc.pid).children(recursive=True),
        psutil.Process(int((tmp_path / "detached").read_text())),
    ]
    t0 = time.monotonic()
    proc.stop(grace=5.0)
    assert time.monotonic() - t0 < 5.0  # SIGTERM ends them all: no wait for the grace to pass
    assert not proc.alive() and proc.popen.returncode is not None
    _gone, alive = psutil.wait_procs(tree, timeout=10)  # descendants are reaped by init
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


def test_a_process_and_what_it_detached_die_with_the_launcher_that_started_it(tmp_path):
    """processes.Proc: kill -9 of the launcher ends its child and a grandchild that the child detached into a session
    of its own and left behind (as Flower's SuperLink and SuperNode do with `flower-superexec`): the guard
    (fedccrl_core/foundation/child_guard.py) gets SIGTERM from the kernel (PR_SET_PDEATHSIG), is the grandchild's
    subreaper, and ends every descendant (scripts/chaos.py's row "kill -9 Flower launcher")."""
    import sys

    import psutil

    # a subshell detaches a sleep into a session of its own and exits: the sleep's parent is gone
    script = f"(setsid sleep 300 & echo $! > {tmp_path}/detached); exec sleep 300"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time; from pathlib import Path; from fedccrl_flower.processes import Proc; "
            "p = Proc('tree', ['bash', '-c', sys.argv[2]], dict(os.environ), Path(sys.argv[1])); "
            "print(p.pid, flush=True); time.sleep(300)",
            str(tmp_path / "tree.log"),
            script,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    proc = psutil.Process(int(launcher.stdout.readline()))  # the guard
    detached = psutil.Process(int(wait_until(lambda: _read(tmp_path / "detached"), 30, "the detached child")))
    execed = lambda: [p for p in [proc, *proc.children()] if p.cmdline()[:1] == ["sleep"]]  # noqa: E731
    child = wait_until(execed, 30, "the exec of sleep")[0]
    assert os.getsid(detached.pid) == detached.pid and os.getsid(proc.pid) == proc.pid  # sessions of their own
    launcher.kill()
    launcher.wait()
    _gone, alive = psutil.wait_procs([proc, child, detached], timeout=30)
    for p in alive:
        p.kill()
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


def _read(path: Path) -> str:
    return path.read_text().strip() if path.is_file() else ""


def test_a_guarded_child_whose_parent_is_not_the_expected_one_runs_nothing(tmp_path):
    """child_guard with a parent pid that is not its parent's (the parent died before the guard ran): SIGTERM to
    itself before the command runs; with its own parent's pid, the command runs."""
    import sys

    from fedccrl_core.foundation.procs import guarded

    marker = tmp_path / "ran"
    args = guarded(["touch", str(marker)])
    assert args[4] == str(os.getpid())
    stale = subprocess.run([*args[:4], str(os.getppid()), *args[5:]], timeout=60)
    assert stale.returncode == -signal.SIGTERM and not marker.exists()
    assert subprocess.run(args, timeout=60).returncode == 0 and marker.is_file()
    assert args[:4] == [sys.executable, "-P", "-m", "fedccrl_core.foundation.child_guard"]


def test_a_flwr_command_past_its_timeout_leaves_no_process(tmp_path, monkeypatch):
    """Federation.flwr past its timeout: TimeoutExpired, and neither the `flwr` process nor what it started is left
    running (subprocess.run's SIGKILL would have ended the guard alone)."""
    import psutil

    from fedccrl_flower import federation

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pids = tmp_path / "pids"
    fake = bin_dir / "flwr"  # a `flwr` that hangs, with a child of its own
    fake.write_text(f"#!/bin/sh\nsleep 300 &\necho $$ $! > {pids}\nwait\n")
    fake.chmod(0o755)
    monkeypatch.setattr(federation, "BIN", bin_dir)
    fed = federation.Federation(tmp_path / "work", "127.0.0.1:1")
    with pytest.raises(subprocess.TimeoutExpired):
        fed.flwr("ls", timeout=2)
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2
    _, alive = psutil.wait_procs([psutil.Process(p) for p in started if psutil.pid_exists(p)], timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


def test_train_with_flower_takes_the_job_and_validated_settings(data, tmp_path, monkeypatch):
    """train_with_flower(job, settings): the ServerSpec comes from the typed TrainJob and the caller's FlowerSettings,
    which is not validated again."""
    from fedccrl_core.federation.plan import RunSettings, TrainJob
    from fedccrl_flower import run
    from fedccrl_flower.settings import FlowerSettings

    got = {}
    monkeypatch.setattr(
        run,
        "run_flower",
        lambda settings, spec, shards, pools, on_round=None, log=None: got.update(
            settings=settings, spec=spec, shards=shards, pools=pools
        ),
    )
    monkeypatch.setattr(
        FlowerSettings, "model_validate", classmethod(lambda cls, *a, **k: pytest.fail("validated again"))
    )
    local = LocalConfig(**{**LOCAL, "mean": tuple(LOCAL["mean"]), "std": tuple(LOCAL["std"])})
    settings = RunSettings(
        dataset="embedded",
        backbone="small_cnn",
        pretrained="none",
        local=local,
        engine="flower",
        device="cpu",
        client_fraction=1.0,
        concurrent_clients=1,
        client_state="persistent",
        eval_batch_size=64,
    )
    hp = build_algorithm("fedavg", local).hp
    job = TrainJob(
        index=3,
        target=HELD_OUT,
        sources=SOURCES,
        algorithm="fedavg",
        seed=SEED,
        hparams=hp,
        settings=settings,
        run_key="k",
        ckpt=tmp_path / "ck" / "run.pt",
        out=tmp_path / "out",
        domains=[],
        classes=list("abcdef"),
        image_size=32,
        resize="none",
    )
    flower = FlowerSettings(min_clients=3, query_timeout_s=7.0)
    run.train_with_flower(job, flower, shards=data / "shards", pools=data / "pools")
    spec = got["spec"]
    assert got["settings"] is flower and spec.min_clients == 3 and spec.query_timeout_s == 7.0
    assert (spec.algorithm, spec.held_out, spec.num_classes, spec.seed, spec.eval_batch_size) == (
        "fedavg",
        HELD_OUT,
        6,
        SEED,
        64,
    )
    assert spec.hparams == hp and spec.run_info == {"run_key": "k"} and spec.work_dir.endswith("run.flower")
    assert (sorted(spec.sources), spec.evaluators) == (SOURCES, ["sketch_c0"])  # the sites, from the central manifest


# ================================================================ loopback Grid: the round loop and its faults
def _capture_replies(grid):
    """Record every TRAIN reply's weights as the client sent them."""
    sent = {}

    def tamper(node, reply):
        if reply.has_content() and M.WEIGHTS in reply.content:
            cid = str(reply.content[M.INFO][M.F_CLIENT_ID])
            sent[cid] = M.record_to_arrays(reply.content[M.WEIGHTS], cid)
        return reply

    grid.tamper = tamper
    return sent


def test_loopback_malformed_updates_are_refused_never_aggregated(data, tmp_path):
    from flwr.app import Array, ArrayRecord

    grid = loopback(data)
    honest = _capture_replies(grid)
    capture = grid.tamper

    def tamper(node, reply):
        reply = capture(node, reply)
        if reply.has_content() and M.WEIGHTS in reply.content:
            cid = str(reply.content[M.INFO][M.F_CLIENT_ID])
            w = reply.content[M.WEIGHTS]
            first = next(iter(w))
            a = w[first].numpy()
            if cid == "art_c0":  # mis-shaped
                w[first] = Array(np.zeros((*a.shape[::-1], 1), a.dtype))
            elif cid == "cartoon_c0":  # NaN
                w[first] = Array(np.full(a.shape, np.nan, a.dtype))
            reply.content[M.WEIGHTS] = ArrayRecord(dict(w.items()))
        return reply

    grid.tamper = tamper
    logs = []
    res = serve(grid, make_spec(data, tmp_path, "fedavg", rounds=1, min_clients=1), log=logs.append)
    rec = res.history[0]
    assert rec.metric("clients") == 1 and rec.metric("refused") == 2
    assert {k.split("/")[1] for k in rec.to_dict() if k.startswith("train_acc/")} == {"photo_c0"}
    reasons = {r["client"]: r["reason"] for r in res.extra["refused"]}
    assert "shape" in reasons["art_c0"] and "NaN" in reasons["cartoon_c0"]
    assert any("REFUSED reply of art_c0" in line for line in logs)
    for k, v in res.final_weights.items():  # Eq. 2 over the one valid reply = that reply
        assert np.array_equal(v.cpu().numpy(), honest["photo_c0"][k]), k


def test_loopback_dead_client_and_min_clients(data, tmp_path):
    """A client that never answers is dropped (the round completes when min_clients allows);
    otherwise the run fails with a message naming the problem."""
    from fedccrl_flower.transport import RoundFailure

    grid = loopback(data)
    grid.dead = {102}  # photo_c0
    res = serve(grid, make_spec(data, tmp_path / "a", "fedavg", rounds=1, min_clients=2, query_timeout_s=5))
    rec = res.history[0]
    assert rec.metric("clients") == 2 and "train_acc/photo_c0" not in rec.to_dict()
    # a query that timed out used to be recorded as dropped=0; now the node, phase and reason are kept
    assert rec.metric("dropped") == 1 and rec.to_dict()["dropped_clients"] == [
        {"client": None, "node": 102, "phase": "query", "reason": "timeout", "detail": "no query reply within 5.0s"}
    ]
    grid = loopback(data)
    grid.dead = {102}
    with pytest.raises(
        RoundFailure,
        match="round 1: only 2 client\\(s\\) answered \\(art_c0, cartoon_c0\\), "
        "fewer than train.flower.min_clients = 3; dropped: node 102: timeout",
    ):
        serve(grid, make_spec(data, tmp_path / "b", "fedavg", rounds=1, min_clients=3, query_timeout_s=5))
    assert json.loads((tmp_path / "b" / "status.json").read_text())["status"] == "failed"


def test_loopback_dropped_clients_say_why_and_reach_mlflow(data, tmp_path):
    """Round 1: photo_c0's ClientApp raises in training (error), cartoon_c0's node leaves the SuperLink
    during training (disconnected); the round aggregates art_c0 alone (min_clients=1). Every dropped
    client is in the record with its node, phase and reason, and ChildRun.log_round puts them in MLflow."""
    from flwr.app import Error, Message

    from fedccrl_pipeline.tracking import ChildRun, parent_run_id

    grid = loopback(data)

    def tamper(node, reply):
        if node == 102 and reply.has_content() and M.WEIGHTS in reply.content:
            asked = next(m for m in grid.sent if m.object_id == reply.metadata.reply_to_message_id)
            return Message(Error(code=2, reason="RuntimeError: CUDA out of memory"), reply_to=asked)
        return reply

    grid.tamper = tamper
    original_push = grid.push_messages

    def push(messages):  # cartoon_c0 (node 101) leaves as soon as it is sent its TRAIN message
        if messages and messages[0].metadata.message_type == M.TRAIN:
            grid.leave = {101}
        return original_push(messages)

    grid.push_messages = push
    res = serve(grid, make_spec(data, tmp_path, "fedavg", rounds=1, min_clients=1))
    rec = res.history[0]
    why = {d["client"]: (d["node"], d["phase"], d["reason"]) for d in rec.to_dict()["dropped_clients"]}
    assert why == {"photo_c0": (102, "train", "error"), "cartoon_c0": (101, "train", "disconnected")}
    assert (
        rec.metric("dropped") == 2
        and rec.metric("clients") == 1
        and "CUDA out of memory" in str(rec.to_dict()["dropped_clients"])
    )
    run = ChildRun("flower-test", parent_run_id("flower-test", "k", {}), "drops", {}, {})
    run.log_round(rec)
    got = run.client.get_run(run.run_id).data
    assert got.metrics["dropped"] == 2 and got.metrics["dropped/photo_c0"] == 1 and "dropped/art_c0" not in got.metrics
    assert json.loads(got.tags["fedccrl.dropped.round_1"]) == rec.to_dict()["dropped_clients"]


def test_loopback_reply_timeout_scales_with_the_slowest_client(data, tmp_path):
    """The wait is the spec's fixed timeout until a phase's reply time is measured, then
    max(timeout_floor_s, timeout_factor x the slowest reply so far): round 1's clients take 4 s to
    train (art_c0 8 s), so round 2 waits 3 x 8 = 24 s, and photo_c0, which sleeps 30 s in round 2, is
    dropped as a timeout; under a fixed 600 s it would have been waited for."""
    from fedccrl_flower.transport import PULL_S, PhaseTimer

    grid = loopback(data)

    def delay(node, msg):
        if msg.metadata.message_type != M.TRAIN:
            return 0.5
        rnd = int(msg.content[M.CONFIG][M.F_ROUND])
        return {1: {100: 8.0}, 2: {102: 30.0}}.get(rnd, {}).get(node, 4.0)

    grid.delay = delay
    spec = make_spec(data, tmp_path, "fedavg", rounds=2, min_clients=2, timeout_factor=3.0, timeout_floor_s=2.0)
    res = serve(grid, spec)
    r1, r2 = res.history
    assert (r1.to_dict()["train_timeout_s"], r1.to_dict()["query_timeout_s"]) == (
        spec.train_timeout_s,
        spec.query_timeout_s,
    )
    assert r1.to_dict()["dropped"] == 0 and r1.to_dict()["clients"] == 3
    assert r2.to_dict()["train_timeout_s"] == pytest.approx(3.0 * 8.0, abs=PULL_S * 3)  # polled: within a few pulls
    assert r2.to_dict()["query_timeout_s"] == pytest.approx(max(2.0, 3.0 * 0.5), abs=PULL_S * 3)
    assert r2.to_dict()["clients"] == 2 and [(d["client"], d["reason"]) for d in r2.to_dict()["dropped_clients"]] == [
        ("photo_c0", "timeout")
    ]
    timer = PhaseTimer(spec, log=lambda m: None)  # the rule itself: the floor wins over a fast phase
    timer.slowest = {"query": 0.1}
    assert timer.reply_timeout("query") == 2.0 and timer.reply_timeout("train") == spec.train_timeout_s


def test_loopback_resume_after_serverapp_crash(data, tmp_path):
    """A ServerApp that dies in round 2 (after the clients trained) is rerun as a new Flower run:
    it resumes after round 1 and, with the clients' state mirrored on disk, ends bit-identical
    to an uninterrupted run."""
    whole = serve(loopback(data, state_dir=tmp_path / "s1"), make_spec(data, tmp_path / "w1", "fedavg"))

    class Crash(Exception):
        pass

    grid = loopback(data, state_dir=tmp_path / "s2")
    trained = []

    def crash(node, reply):
        if reply.has_content() and M.WEIGHTS in reply.content:
            trained.append(node)
            if len(trained) == 6:  # round 2: all three clients trained, the server dies before aggregating
                raise Crash()
        return reply

    grid.tamper = crash
    with pytest.raises(Crash):
        serve(grid, make_spec(data, tmp_path / "w2", "fedavg"))
    resumed = serve(loopback(data, state_dir=tmp_path / "s2"), make_spec(data, tmp_path / "w2", "fedavg"))
    assert resumed.resumed_from == 1 and [r.metric("round") for r in resumed.history] == [1, 2]
    assert_same_history(resumed.history, whole.history)
    for k, v in whole.final_weights.items():
        assert torch.equal(resumed.final_weights[k], v), k


SLOW_ON_CPU = {"ccst", "fedadg"}  # AdaIN style transfer / an adversarial generator: 20-45 s here


SLOW_REASON = "style transfer or an adversarial generator: 20-45 s per engine on the CPU"


@pytest.mark.parametrize(
    "algorithm",
    [pytest.param(a, marks=pytest.mark.full(SLOW_REASON)) if a in SLOW_ON_CPU else a for a in sorted(ALGORITHMS)],
)
def test_loopback_every_algorithm_matches_inprocess_engine(algorithm, data, inprocess_fedccrl, tmp_path):
    """One implementation, two engines: every registered algorithm, 2 rounds over the Message API
    (state in Context.state, payloads and server state as they are), equals the in-process engine."""
    ref = inprocess_fedccrl if algorithm == "fedccrl" else run_inprocess(data, algorithm, 2)
    res = serve(loopback(data), make_spec(data, tmp_path, algorithm))
    assert_same_history(res.history, ref.history)
    for k, v in ref.final_weights.items():
        assert torch.equal(res.final_weights[k].cpu(), v.cpu()), k
    assert all(r.metric("clients") == 3 and r.metric("refused") == 0 for r in res.history)


def test_loopback_stateless_clients_match_inprocess_engine(data, tmp_path):
    """train.client_state: stateless on both engines: a fresh optimizer every round, the same numbers."""
    ref = run_inprocess(data, "fedavg", 2, client_state="stateless")
    persistent = run_inprocess(data, "fedavg", 2)
    res = serve(
        loopback(data, state_dir=tmp_path / "state"),
        make_spec(data, tmp_path / "w", "fedavg", client_state="stateless"),
    )
    assert_same_history(res.history, ref.history)
    for k, v in ref.final_weights.items():
        assert torch.equal(res.final_weights[k].cpu(), v.cpu()), k
    assert ref.history[1].metric("loss") != persistent.history[1].metric("loss")  # round 2 really started afresh
    assert not list((tmp_path / "state").rglob("*.npz"))  # nothing kept on the clients


@pytest.mark.full("two 2-round FedCCRL runs with DP, in-process and over the loopback Grid: ~40 s on the CPU")
def test_loopback_differential_privacy_matches_inprocess_engine(data, tmp_path, not_private):
    """train.privacy on both channels: the noised statistics (drawn on the clients) and DP-FedAvg's noise (on the
    server) are the same numbers over the Message API as in-process, epsilon included. The noise is seeded by the
    test-only noise_seed (not private): from the OS, as in a real run, no two runs would match."""
    priv = {
        "enabled": True,
        "stats_noise_multiplier": 0.5,
        "weights_clip": 0.5,
        "weights_noise_multiplier": 0.8,
        "noise_seed": 11,
    }
    ref = run_inprocess(data, "fedccrl", 2, privacy=priv)
    res = serve(loopback(data), make_spec(data, tmp_path, "fedccrl", privacy=priv))
    assert_same_history(res.history, ref.history)
    assert [r.metric(contract.DP_EPSILON) for r in res.history] == [r.metric(contract.DP_EPSILON) for r in ref.history]
    for k, v in ref.final_weights.items():
        assert torch.equal(res.final_weights[k].cpu(), v.cpu()), k
    # the held-out domain counted over its val rows only, no run of the study's training images (shards.held_out_parts)
    n_val = len(load_domain_test(data / "shards", HELD_OUT, private=True)[1])
    assert n_val < len(load_domain_test(data / "shards", HELD_OUT)[1])
    assert all(r.target_n == n_val for r in res.history)


# ================================================================ real processes: SuperLink + 3 SuperNodes on 127.0.0.1
def _signal_all(nodes, sig: int) -> None:
    """`sig` to each node's process and every descendant (Flower starts some in their own sessions)."""
    import psutil

    for node in nodes:
        try:
            procs = [psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass


def _records(work: Path, run_id: int) -> list[dict]:
    path = work / f"run-{run_id}" / "rounds.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def add_wheel_supernode(fed, data: Path, cid: str, root: Path, full_venv: Path, wait: bool = True):
    """A SuperNode of the installed wheel's venv (tests/wheel_envs.py), in <root>/site-<cid>: no checkout there."""
    site = root / f"site-{cid}"
    site.mkdir(exist_ok=True)
    return fed.add_supernode(
        cid, node_config(data, cid, root / "client-state"), threads=1, wait=wait, bin_dir=full_venv / "bin", cwd=site
    )


@pytest.fixture(scope="module")
def deployment(data, full_venv, tmp_path_factory):
    """One SuperLink + 3 SuperNodes (one torch thread each), shared by the deployment tests. The SuperNodes
    run from the installed wheel, not from the checkout: `full_venv` has the wheel installed with --no-deps
    and reaches the training dependencies (torch, ...) through a .pth file pointing at this interpreter's
    site-packages (tests/wheel_envs.py); they run with no PYTHONPATH, each in a folder with no checkout.
    Every process group is killed at the end, whatever happened."""
    from fedccrl_flower.federation import LocalFederation

    root = tmp_path_factory.mktemp("federation")
    fed = LocalFederation(root / "fed")
    try:
        for cid in SOURCES:
            add_wheel_supernode(fed, data, cid, root, full_venv, wait=False)
        fed.wait_supernodes()
        yield fed, root
    finally:
        fed.close()


@pytest.mark.full("a Flower deployment of real processes, the SuperNode from the wheel installed in a venv")
@pytest.mark.timeout(1800)
def test_one_supernode_from_the_installed_wheel_completes_a_round(data, full_venv, tmp_path):
    """In a folder with no checkout, one SuperNode of the installed wheel joins a loopback federation
    (SuperLink on 127.0.0.1) and completes a round of FedAvg; its ClientApp imports fedccrl from the wheel."""
    from fedccrl_flower.federation import LocalFederation
    from fedccrl_flower.follow import wait_for_result

    with LocalFederation(tmp_path / "fed") as fed:
        node = add_wheel_supernode(fed, data, "art_c0", tmp_path, full_venv)
        work = tmp_path / "work"
        run_id = fed.submit(make_spec(data, work, "fedavg", rounds=1, num_clients=1, min_clients=1, evaluators=[]))
        res = wait_for_result(fed, run_id, work, timeout=600)
        log = node.log_path.read_text()
    assert [r.metric("round") for r in res.history] == [1] and res.history[0].metric("clients") == 1
    assert "train_acc/art_c0" in res.history[0].to_dict() and "Receiving: train message" in log
    assert (node.args[0]).startswith(str(full_venv))


EVIL_CLIENT = """
import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.clientapp import ClientApp
from fedccrl_flower import messages as M
from fedccrl_flower.client_app import handle_query, handle_train

app = ClientApp()


@app.query()
def query(msg, context):
    return handle_query(msg, context)


@app.train()
def train(msg, context):
    reply = handle_train(msg, context)
    if context.node_config.get(M.NODE_CLIENT_ID) == "art_c0":  # a broken client: one mis-shaped array
        w = dict(reply.content[M.WEIGHTS].items())
        k = sorted(w)[0]
        w[k] = Array(np.zeros(tuple(w[k].shape) + (2,), np.float32))
        reply.content[M.WEIGHTS] = ArrayRecord(w)
    return reply
"""


@pytest.mark.full(
    "a Flower deployment or simulation of real processes (the loopback tests cover the Message API in-process)"
)
@pytest.mark.timeout(900)
def test_deployment_malformed_update_is_refused(deployment, data, tmp_path):
    """A SuperNode whose ClientApp sends a mis-shaped array: the ServerApp logs and refuses it and
    aggregates the two valid replies."""
    from fedccrl_flower.federation import APP_DIR
    from fedccrl_flower.follow import wait_for_result

    fed, _ = deployment
    app = tmp_path / "evil_app"
    app.mkdir()
    toml = (APP_DIR / "pyproject.toml").read_text().replace("fedccrl_flower.client_app:app", "evil_client:app")
    (app / "pyproject.toml").write_text(toml)
    (app / "evil_client.py").write_text(EVIL_CLIENT)
    work = tmp_path / "work"
    run_id = fed.submit(
        make_spec(data, work, "fedavg", rounds=1, num_clients=3, min_clients=2, evaluators=[]), app_dir=app
    )
    res = wait_for_result(fed, run_id, work, timeout=300)
    rec = res.history[0]
    assert rec.metric("clients") == 2 and rec.metric("refused") == 1 and "train_acc/art_c0" not in rec.to_dict()
    (refusal,) = res.extra["refused"]
    assert refusal["client"] == "art_c0" and "shape" in refusal["reason"]
    assert "REFUSED reply of art_c0" in (work / f"run-{run_id}" / "server.log").read_text()
    assert all(torch.isfinite(v.float()).all() for v in res.final_weights.values())


@pytest.mark.full(
    "a Flower deployment or simulation of real processes (the loopback tests cover the Message API in-process)"
)
@pytest.mark.timeout(900)
def test_deployment_killed_supernode_rejoins_and_serverapp_resumes(deployment, data, full_venv, tmp_path):
    """Process-level faults on one federation:
    (a) min_clients cannot be met -> the run fails with a clear message (FlowerRunError);
    (b) the photo SuperNode is SIGKILLed while it trains in round 2 -> round 2 completes with the
        other two (min_clients = 2); the SuperNode is restarted (same client id and state folder);
    (c) the ServerApp is stopped after round 2 (flwr stop) and the run resubmitted -> it resumes
        after round 2 and round 3 has all three clients again (the restarted node rejoined)."""
    from fedccrl_flower.follow import wait_for_result
    from fedccrl_flower.processes import FlowerRunError

    fed, root = deployment
    fail = tmp_path / "fail"
    run_id = fed.submit(
        make_spec(data, fail, "fedavg", rounds=1, num_clients=4, min_clients=4, wait_for_clients_s=3, evaluators=[])
    )
    with pytest.raises(
        FlowerRunError, match="3 SuperNode\\(s\\) connected after 3s, fewer than train.flower.min_clients = 4"
    ):
        wait_for_result(fed, run_id, fail, timeout=180)

    work = tmp_path / "work"
    spec = make_spec(
        data,
        work,
        "fedavg",
        rounds=3,
        num_clients=3,
        min_clients=2,
        query_timeout_s=30,
        train_timeout_s=45,
        evaluators=[],
    )
    photo = fed.supernodes["photo_c0"]
    seen = photo.log_path.read_text().count("Receiving: train message")  # earlier runs on this federation
    run_id = fed.submit(spec)
    wait_until(
        lambda: photo.log_path.read_text().count("Receiving: train message") >= seen + 2, 240, "round 2 at photo_c0"
    )
    photo.kill()
    add_wheel_supernode(fed, data, "photo_c0", root, full_venv)
    wait_until(lambda: len(_records(work, run_id)) >= 2, 240, "round 2's record", poll=0.1)
    # the other two SuperNodes are paused at once: round 3 cannot gather min_clients replies (it waits up to
    # train_timeout_s = 45 s), so the stop lands after round 2 however fast round 3 would train on this machine
    others = [fed.supernodes[c] for c in SOURCES if c != "photo_c0"]
    _signal_all(others, signal.SIGSTOP)
    try:
        fed.stop_run(run_id)
        wait_until(lambda: fed.status(run_id).get("status", "").startswith("finished"), 60, "the stopped run", poll=2)
    finally:
        _signal_all(others, signal.SIGCONT)
    first = _records(work, run_id)
    assert [r["clients"] for r in first[:2]] == [3, 2] and first[1]["dropped"] == 1  # rounds.jsonl's lines
    assert "train_acc/photo_c0" in first[0] and "train_acc/photo_c0" not in first[1]

    res = wait_for_result(fed, fed.submit(spec), work, timeout=300)
    assert res.resumed_from == 2 and [r.metric("round") for r in res.history] == [1, 2, 3]
    # the restarted node trained round 3 with the other two; the killed node's old registration may still be listed
    # until the SuperLink's heartbeat expires it, and is then recorded as dropped (0 or 1: a matter of timing)
    assert (
        res.history[2].metric("clients") == 3
        and res.history[2].metric("dropped") in (0, 1)
        and "train_acc/photo_c0" in res.history[2].to_dict()
    )
    assert fed.supernodes["photo_c0"].log_path.read_text().count("Receiving: train message") >= 1


@pytest.mark.full(
    "a Flower deployment or simulation of real processes (the loopback tests cover the Message API in-process)"
)
@pytest.mark.timeout(900)
def test_simulation_flwr_run_matches_inprocess(data, inprocess_fedccrl, tmp_path):
    """`train.flower.mode: simulation`: `flwr run` on a local simulation SuperLink, Flower's Ray
    backend (offline), 3 simulated SuperNodes (partition-id -> client id via the manifest)."""
    from fedccrl_flower.run import run_flower
    from fedccrl_flower.settings import FlowerSettings

    t0 = time.perf_counter()
    res = run_flower(
        FlowerSettings(mode="simulation", min_clients=3, client_cpus=1, ray_cpus=2, run_timeout_s=600),
        make_spec(data, tmp_path / "work"),
        data / "shards",
        data / "pools",
    )
    print(f"simulation, 2 rounds FedCCRL, 3 simulated SuperNodes: {time.perf_counter() - t0:.1f}s")
    assert [r.metric("clients") for r in res.history] == [3, 3]
    assert_same_history(res.history, inprocess_fedccrl.history, tol=0.0)  # Ray gives each actor one thread
    for k, v in inprocess_fedccrl.final_weights.items():
        assert torch.equal(res.final_weights[k].cpu(), v.cpu()), k


# ================================================================ FedDG-Bench's mixed-domain clients on both engines
@pytest.fixture(scope="module")
def mixed_data(tmp_path_factory) -> Path:
    """The embedded dataset as FedDG-Bench's lambda partition (lambda 0.5, 5 clients) with label skew."""
    return build_data(
        tmp_path_factory.mktemp("flower-mixed"),
        {
            "partition.scheme": "feddg_bench",
            "partition.num_clients": 5,
            "partition.dirichlet_alpha": 1.0,
            "partition.lambda": 0.5,
        },
    )


@pytest.mark.parametrize("algorithm", ["fedavg", "fedccrl"])
def test_loopback_mixed_domain_clients_match_inprocess_engine(algorithm, mixed_data, tmp_path):
    """partition.scheme feddg_bench: every client holds several domains; both engines drop the held-out
    domain's rows (and their statistics-pool rows) and give the same numbers, bit for bit."""
    from fedccrl_core.data.manifest import client_ids, load_manifest
    from fedccrl_core.federation.driver import load_clients

    shards, pools = mixed_data / "shards", mixed_data / "pools"
    manifest = load_manifest(shards)
    assert all(c.domain == "mixed" for c in manifest.clients)
    sources = [d for d in manifest.domains if d != HELD_OUT]
    clients = load_clients(shards, pools, sources, "cpu")
    ids = client_ids(manifest, HELD_OUT)
    assert [c.client_id for c in clients] == ids and len(ids) == 5
    assert sum(len(c.train_y) for c in clients) < sum(c.n_train for c in manifest.clients)  # rows dropped
    local = LocalConfig(**{**LOCAL, "mean": tuple(LOCAL["mean"]), "std": tuple(LOCAL["std"])})
    alg = build_algorithm(algorithm, local, HPARAMS.get(algorithm))
    model = build_seeded_model(alg, "small_cnn", 6, "none", SEED)
    run = held_out_run(alg, model, clients, load_domain_test(shards, HELD_OUT), 2, seed=SEED, batch_size=256)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = train(run, log=lambda m: None)
    finally:
        torch.set_num_threads(threads)
    res = serve(
        loopback(mixed_data, clients=ids), make_spec(mixed_data, tmp_path, algorithm, sources=ids, evaluators=[])
    )
    assert_same_history(res.history, ref.history)
    for k, v in ref.final_weights.items():
        assert torch.equal(res.final_weights[k].cpu(), v.cpu()), k
    assert all(r.metric("clients") == 5 for r in res.history)


def test_loopback_the_held_out_domains_site_evaluates_only_never_sampled(data, tmp_path):
    """The held-out domain's site (an evaluation site of the spec) answers QUERY with n = 0, is never sent a TRAIN
    message, and evaluates the target; a site that claims training rows without being a source, or no rows without
    being an evaluation site, is refused at every query. The run equals the in-process engine's."""
    ref = run_inprocess(data, "fedavg", 2)
    grid = loopback(data, clients=[*SOURCES, "sketch_c0"])
    res = serve(grid, make_spec(data, tmp_path, "fedavg"))
    assert_same_history(res.history, ref.history)
    for k, v in ref.final_weights.items():
        assert torch.equal(res.final_weights[k].cpu(), v.cpu()), k
    assert [r.metric("refused") for r in res.history] == [0, 0] and all(r.metric("clients") == 3 for r in res.history)
    assert all(r.metric("eval_sites") == 4 and r.metric("target_n") > 0 for r in res.history)
    assert not [m for m in grid.sent if m.metadata.message_type == M.TRAIN and m.metadata.dst_node_id == 103]
    assert len([m for m in grid.sent if m.metadata.message_type == M.EVALUATE and m.metadata.dst_node_id == 103]) == 2
    # the same site, not named an evaluation site: refused, and with no one holding sketch the target is NaN
    grid = loopback(data, clients=[*SOURCES, "sketch_c0"])
    res = serve(grid, make_spec(data, tmp_path / "b", "fedavg", evaluators=[]))
    assert [r.metric("refused") for r in res.history] == [1, 1]
    assert all(
        "sketch_c0 announces no training rows but is not an evaluation site"
        in r.to_dict()["refused_clients"][0]["reason"]
        for r in res.history
    )
    assert all(
        math.isnan(r.metric("target_acc")) and r.metric("val_acc") == q.to_dict()["val_acc"]
        for r, q in zip(res.history, ref.history)
    )


def _evaluate_spec_changed(grid: LoopbackGrid, node: int, change) -> LoopbackGrid:
    """`grid`, whose EVALUATE messages to `node` carry the spec as `change(spec)` makes it (a server that changes a
    run's spec mid-run; its run key unchanged)."""
    push = grid.push_messages

    def push_messages(messages):
        for m in messages:
            if m.metadata.message_type == M.EVALUATE and m.metadata.dst_node_id == node:
                cfg = m.content[M.CONFIG]
                cfg[M.F_SPEC] = json.dumps(change(json.loads(str(cfg[M.F_SPEC]))))
        return push(messages)

    grid.push_messages = push_messages  # type: ignore[method-assign]
    return grid


def test_loopback_a_site_refuses_a_held_out_changed_within_a_run(data, tmp_path):
    """Round 1's EVALUATE message to cartoon_c0, a source site that trained, says held_out 'cartoon' where the run's
    messages said 'sketch' (its run key unchanged): accepted, the site would return counts over its own cartoon images
    (training images) as the target's. It keeps the first held_out of the run and refuses, naming both; the server
    drops it from that evaluation, and the target counts are the held-out site's alone."""
    grid = _evaluate_spec_changed(loopback(data), 101, lambda spec: {**spec, "held_out": "cartoon"})  # cartoon_c0
    res = serve(grid, make_spec(data, tmp_path, "fedavg", rounds=1, min_clients=3))
    rec = res.history[0].to_dict()
    dropped = rec["dropped_clients"]
    assert [(d["client"], d["phase"], d["reason"]) for d in dropped] == [("cartoon_c0", "evaluate", "error")]
    assert "holds out 'cartoon'" in dropped[0]["detail"] and "held out 'sketch'" in dropped[0]["detail"]
    assert rec[contract.TARGET_N] == len(load_domain_test(data / "shards", HELD_OUT)[1])
    assert rec[contract.EVAL_SITES] == 3


def test_loopback_an_evaluation_site_refuses_a_run_that_drops_its_privacy(data, tmp_path, not_private):
    """A DP run whose round-1 EVALUATE message to sketch_c0, the held-out domain's site, says train.privacy is off
    (its run key unchanged) would have it count every row of sketch, images the study's other runs train on, where
    under train.privacy it counts its val rows only. It keeps the run's first setting and refuses, naming both; the
    server drops it from that evaluation, and no target count is taken."""
    no_privacy = lambda spec: {**spec, "local": {**spec["local"], "privacy": None}}  # noqa: E731
    grid = _evaluate_spec_changed(loopback(data), 103, no_privacy)  # sketch_c0
    priv = {"enabled": True, "weights_noise_multiplier": 0.8, "noise_seed": 3}
    res = serve(grid, make_spec(data, tmp_path, "fedavg", rounds=1, min_clients=3, privacy=priv))
    rec = res.history[0].to_dict()
    dropped = rec["dropped_clients"]
    assert [(d["client"], d["phase"], d["reason"]) for d in dropped] == [("sketch_c0", "evaluate", "error")]
    assert "train.privacy off" in dropped[0]["detail"] and "had it on in its first message" in dropped[0]["detail"]
    assert rec[contract.TARGET_N] == 0 and math.isnan(rec[contract.TARGET_ACC])
