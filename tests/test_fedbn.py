"""FedBN and SiloBN (fedfd-a.txt section 4.1): which tensors stay on the client, that they survive
across rounds per client, the complete global model, the paper's SGD setting, and engine runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from fixtures import held_out_run

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import ALGORITHMS, build_algorithm
from fedccrl_core.algorithms.fedbn import FedBN
from fedccrl_core.algorithms.local_bn import local_bn_keys
from fedccrl_core.algorithms.silobn import SiloBN
from fedccrl_core.federation.checkpoints import RoundCheckpoints
from fedccrl_core.federation.driver import train
from fedccrl_core.learning.aggregation import weighted_average
from fedccrl_core.learning.clients import ClientState

SMALL_SGD = {"batch_size": 8, "lr": 0.05}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def train_toy(toy_client, tmp_path, algorithm, hparams=None, rounds=2, ckpt_name="ck.pt", on_round=None):
    torch.manual_seed(0)
    clients = [
        toy_client(f"d{i}_c{k}", f"d{i}", 32, 10 * i + k, 30 * i, 1.0 + 0.3 * i) for i in range(2) for k in range(2)
    ]
    tx = toy_client("t", "t", 40, 99, 60, 0.6)
    local = LocalConfig(rounds=rounds, local_epochs=1, batch_size=8, lr=1e-2)
    alg = build_algorithm(algorithm, local, hparams)
    model = alg.build_model("small_cnn", 3, "none", alg.hp)
    run = held_out_run(
        alg,
        model,
        clients,
        (tx.train_x, tx.train_y),
        rounds,
        checkpoint_path=tmp_path / ckpt_name,
        run_info={"k": algorithm},
    )
    return train(run, on_round=on_round, log=lambda m: None)


def test_registered_and_frameworks():
    assert ALGORITHMS["fedbn"] is FedBN and ALGORITHMS["silobn"] is SiloBN
    model = SiloBN.build_model("small_cnn", 3)
    bns = [n for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(bns) == 4
    stats = {f"{b}.{s}" for b in bns for s in ("running_mean", "running_var", "num_batches_tracked")}
    affine = {f"{b}.{s}" for b in bns for s in ("weight", "bias")}
    assert set(local_bn_keys(model, "silobn")) == stats  # SiloBN: statistics only
    assert set(local_bn_keys(model, "fedbn")) == stats | affine  # FedBN: statistics and affine
    assert local_bn_keys(model, "fedavg") == []


def test_paper_sgd_setting_and_bad_params():
    alg = SiloBN(LocalConfig(batch_size=32))
    assert alg.local.batch_size == 64  # section 4.1: batch 64 replaces train.batch_size
    opt = alg.make_optimizer(torch.nn.Linear(2, 2))
    assert isinstance(opt, torch.optim.SGD)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["momentum"] == 0.5
    sched = alg.make_scheduler(opt)
    for _ in range(5):
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.01  # "a fixed learning rate"
    adam = FedBN(LocalConfig(batch_size=32), {"optimizer": "train", "batch_size": None})
    assert adam.local.batch_size == 32 and isinstance(adam.make_optimizer(torch.nn.Linear(2, 2)), torch.optim.Adam)
    for key, value in (("optimizer", "adam"), ("lr", 0), ("momentum", 1.0), ("batch_size", 1)):
        with pytest.raises(ValueError, match=f"train.fedbn.{key}"):
            FedBN(LocalConfig(), {key: value})
    with pytest.raises(ValueError, match="train.silobn.framework"):
        SiloBN(LocalConfig(), {"framework": "x"})


@pytest.mark.parametrize("algorithm", ["silobn", "fedbn"])
def test_local_tensors_survive_rounds_and_are_not_loaded_from_the_aggregate(toy_client, algorithm):
    torch.manual_seed(0)
    alg = build_algorithm(algorithm, LocalConfig(local_epochs=1), SMALL_SGD)
    model = alg.build_model("small_cnn", 3, "none", alg.hp)
    keys = set(local_bn_keys(model, algorithm))
    clients = {"a": toy_client("a", "da", 24, 1, 0), "b": toy_client("b", "db", 24, 2, 80, 0.5)}
    states = {c: ClientState() for c in clients}
    seen = {}  # client -> the model's state at its first step of round 2
    train_step = alg.train_step

    def spy(m, x, y, ctx):
        if ctx.state is None and spy.cid is not None:  # the client-round's first step (no scratch of its own)
            ctx.state = "spied"
            seen[spy.cid] = {k: v.detach().clone() for k, v in m.state_dict().items()}
        return train_step(m, x, y, ctx)

    spy.cid = None
    alg.train_step = spy
    g0 = {k: v.clone() for k, v in model.state_dict().items()}
    r1 = {
        c: alg.local_train(model, d, states[c], g0, None, torch.Generator().manual_seed(0), np.random.default_rng(0))
        for c, d in clients.items()
    }
    for c in clients:  # each client stored exactly its framework's local tensors, as its own values
        assert set(states[c].extra["local_bn"]) == keys
        assert all(torch.equal(states[c].extra["local_bn"][k], r1[c].weights[k]) for k in keys)
    g1 = alg.aggregate(g0, list(r1.values()))
    ref = weighted_average([r.weights for r in r1.values()], [r.n for r in r1.values()])
    assert g1.keys() == g0.keys()  # a complete, loadable global model (the held-out model)
    assert all(torch.equal(g1[k], ref[k]) for k in g1)  # Eq. 2 over every tensor: BN entries = average
    model.load_state_dict(g1)
    for c, d in clients.items():  # round 2
        spy.cid = c
        alg.local_train(model, d, states[c], g1, None, torch.Generator().manual_seed(1), np.random.default_rng(1))
        start = seen[c]
        for k in g1:
            expected = r1[c].weights[k] if k in keys else g1[k]
            assert torch.equal(start[k], expected), k
        assert any(not torch.equal(start[k], g1[k]) for k in keys if "running_mean" in k)
    bn_w = "h.features.1.weight"
    assert (bn_w in keys) == (algorithm == "fedbn")  # SiloBN aggregates gamma, FedBN keeps it


def test_engine_rounds_and_resume_keep_client_bn(toy_client, tmp_path):
    class Killed(Exception):
        pass

    full = train_toy(toy_client, tmp_path, "silobn", SMALL_SGD, ckpt_name="full.pt")
    assert all(math.isfinite(r.to_dict()[k]) for r in full.history for k in ("loss", "l_cls", "val_acc", "target_acc"))
    extra = RoundCheckpoints(tmp_path / "full.pt", "cpu").client_states()  # one state file per client
    means = [extra[c]["extra"]["local_bn"]["h.features.1.running_mean"] for c in sorted(extra)]
    assert len(means) == 4 and not torch.allclose(means[0], means[2])  # per-client statistics

    def die(rec):
        if rec.to_dict()["round"] == 2:
            raise Killed

    with pytest.raises(Killed):
        train_toy(toy_client, tmp_path, "silobn", SMALL_SGD, ckpt_name="resume.pt", on_round=die)
    resumed = train_toy(toy_client, tmp_path, "silobn", SMALL_SGD, ckpt_name="resume.pt")
    assert resumed.resumed_from == 1
    strip = lambda h: [{k: v for k, v in r.to_dict().items() if k != "seconds"} for r in h]  # noqa: E731
    assert strip(resumed.history) == strip(full.history)
    assert all(torch.equal(full.final_weights[k], resumed.final_weights[k]) for k in full.final_weights)


def test_engine_round_fedbn(toy_client, tmp_path):
    """Two FedBN rounds through the engine: every client ends with its own BN statistics and affine parameters
    (its state), and the global model's BN entries are their Eq. 2 average (n_i weighted), not any one client's."""
    res = train_toy(toy_client, tmp_path, "fedbn", SMALL_SGD, rounds=2)
    assert all(math.isfinite(r.to_dict()["loss"]) for r in res.history)
    states = RoundCheckpoints(tmp_path / "ck.pt", "cpu").client_states()
    keys = set(local_bn_keys(FedBN.build_model("small_cnn", 3), "fedbn"))
    local = [states[c]["extra"]["local_bn"] for c in sorted(states)]
    assert len(local) == 4 and all(set(t) == keys for t in local)
    n = [24] * 4  # each toy client: 32 images, 8 of them validation
    ref = weighted_average(local, n)
    for k in keys:
        got = res.final_weights[k]
        assert torch.allclose(got.float(), ref[k].float(), rtol=1e-5, atol=1e-6), k
    bn_w = "h.features.1.weight"  # an affine parameter: FedBN keeps it per client, so the clients differ
    assert not torch.equal(local[0][bn_w], local[2][bn_w])
    assert all(not torch.equal(res.final_weights[bn_w], t[bn_w]) for t in local)
