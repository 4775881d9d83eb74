"""Federation core: Eq. 2 aggregation, Eq. 8 upload size, pool exclusion, client sampling,
checkpoint/resume and determinism of the in-process engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from fixtures import evalsets_for

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.algorithms.fedccrl import pool_without
from fedccrl_core.data.pools import upload_size
from fedccrl_core.federation.engine import InProcessEngine
from fedccrl_core.federation.loop import nbytes
from fedccrl_core.federation.sampling import sample_clients
from fedccrl_core.learning.aggregation import weighted_average
from fedccrl_core.learning.clients import ClientData
from fedccrl_core.learning.models import build_model


def test_weighted_average_eq2_hand_computed():
    a = {"w": torch.tensor([1.0, 2.0]), "bn.num_batches_tracked": torch.tensor(3)}
    b = {"w": torch.tensor([4.0, -1.0]), "bn.num_batches_tracked": torch.tensor(5)}
    out = weighted_average([a, b], [1, 3])  # N = 4: (1*[1,2] + 3*[4,-1]) / 4 = [13/4, -1/4]
    assert torch.allclose(out["w"], torch.tensor([3.25, -0.25]))
    assert out["bn.num_batches_tracked"].item() == 5 and out["bn.num_batches_tracked"].dtype == torch.int64


def test_weighted_average_rejects_mismatch():
    with pytest.raises(ValueError, match="shape"):
        weighted_average([{"w": torch.zeros(2)}, {"w": torch.zeros(3)}], [1, 1])
    with pytest.raises(ValueError, match="no client"):
        weighted_average([], [])


@pytest.mark.parametrize("r,n,expected", [(0.1, 100, 10), (0.1, 101, 11), (0.1, 5, 1), (1.0, 7, 7), (0.33, 10, 4)])
def test_upload_size_eq8(r, n, expected):
    assert upload_size(n, r) == expected == min(n, math.ceil(r * n))


def test_pool_excludes_own_statistics():
    uploads = {
        c: {"mu": np.full((k, 3), i, np.float32), "sigma": np.full((k, 3), 10 + i, np.float32)}
        for i, (c, k) in enumerate([("a", 2), ("b", 3), ("c", 4)])
    }
    mu, sigma = pool_without(uploads, "b")
    assert mu.shape == (6, 3) and sigma.shape == (6, 3)
    assert set(np.unique(mu)) == {0.0, 2.0}  # a and c only, never b's own (value 1)
    assert set(np.unique(sigma)) == {10.0, 12.0}
    alg = build_algorithm("fedccrl", LocalConfig())
    payloads = alg.server_payloads(uploads)
    for cid, own in (("a", 0), ("b", 1), ("c", 2)):
        assert own not in np.unique(payloads[cid]["mu"])
        assert len(payloads[cid]["mu"]) == 9 - len(uploads[cid]["mu"])


def test_fedccrl_client_upload_draws_ceil_r_n_of_its_own():
    alg = build_algorithm("fedccrl", LocalConfig(), {"r": 0.1})
    mu = np.arange(45 * 3, dtype=np.float32).reshape(45, 3)
    data = ClientData(
        "c",
        "d",
        torch.zeros(45, 3, 4, 4, dtype=torch.uint8),
        torch.zeros(45, dtype=torch.long),
        torch.zeros(0, 3, 4, 4, dtype=torch.uint8),
        torch.zeros(0, dtype=torch.long),
        mu,
        mu + 1,
    )
    up1 = alg.client_upload(data, np.random.default_rng(1))
    up2 = alg.client_upload(data, np.random.default_rng(2))
    assert up1["mu"].shape == (5, 3)  # ceil(0.1 * 45) = 5
    assert np.all(up1["sigma"] == up1["mu"] + 1)  # rows stay paired
    assert {tuple(r) for r in up1["mu"]} <= {tuple(r) for r in mu}
    assert not np.array_equal(up1["mu"], up2["mu"])  # a fresh draw each round


def test_sample_clients_fraction():
    ids = [f"c{i}" for i in range(6)]
    assert sample_clients(ids, 1.0, 0, 1) == ids
    half = sample_clients(ids, 0.5, 0, 1)
    assert len(half) == 3 and set(half) <= set(ids)
    assert half == sample_clients(ids, 0.5, 0, 1)
    assert any(sample_clients(ids, 0.5, 0, r) != half for r in range(2, 8))


def test_unknown_algorithm_and_hparam_named():
    with pytest.raises(ValueError, match="unknown algorithm 'fedfoo'"):
        build_algorithm("fedfoo", LocalConfig())
    with pytest.raises(ValueError, match="train.fedprox.nu"):
        build_algorithm("fedprox", LocalConfig(), {"nu": 1})


# ---- a tiny learnable federation: class = which colour channel is bright -------------------------
def _engine(toy_client, tmp_path, algorithm="fedavg", rounds=3, ckpt_name="ck.pt", on_round=None, hp=None):
    torch.manual_seed(0)
    clients = [
        toy_client(f"d{i}_c{k}", f"d{i}", 40, 10 * i + k, 20 * i, stats=True) for i in range(2) for k in range(2)
    ]
    tx = toy_client("t", "t", 48, 99, 40, stats=True)
    ev = evalsets_for(clients, (tx.train_x, tx.train_y))
    local = LocalConfig(rounds=rounds, local_epochs=1, batch_size=8, lr=1e-2)
    model = build_model("small_cnn", 3)
    return InProcessEngine(
        build_algorithm(algorithm, local, hp),
        model,
        clients,
        ev,
        rounds,
        seed=0,
        checkpoint_path=tmp_path / ckpt_name,
        on_round=on_round,
        run_info={"k": algorithm},
        log=lambda m: None,
    )


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "fedccrl"])
def test_engine_lowers_loss_and_records_rounds(toy_client, tmp_path, algorithm):
    seen = []
    res = _engine(toy_client, tmp_path, algorithm, rounds=3, on_round=seen.append).run()
    assert [r.to_dict()["round"] for r in res.history] == [1, 2, 3] == [r.to_dict()["round"] for r in seen]
    assert res.history[-1].to_dict()["loss"] < res.history[0].to_dict()["loss"]
    for key in ("val_acc", "target_acc", "train_acc", "lr", "seconds", "bytes_up", "bytes_down", "l_cls"):
        assert key in res.history[0].to_dict()
    if algorithm == "fedprox":
        assert res.history[-1].to_dict()["l_prox"] > 0
    if algorithm == "fedccrl":  # Eq. 15 terms, and the statistics pools travel both ways (Eq. 8, line 7)
        assert res.history[-1].to_dict()["l_ra"] > 0 and res.history[-1].to_dict()["l_js"] >= 0
        assert res.history[0].to_dict()["bytes_up"] > 4 * nbytes(res.final_weights)
    # cosine schedule over rounds x epochs, stepped per epoch: lr after epoch t = 0.005 (1 + cos(pi t / 3))
    assert res.history[0].to_dict()["lr"] == pytest.approx(0.005 * (1 + math.cos(math.pi / 3)))
    w_bytes = nbytes(res.final_weights)
    if algorithm != "fedccrl":
        assert (
            res.history[0].to_dict()["bytes_up"] == 4 * w_bytes
            and res.history[0].to_dict()["bytes_down"] == 4 * w_bytes
        )


def test_engine_is_deterministic_and_resumes_identically(toy_client, tmp_path):
    full = _engine(toy_client, tmp_path, rounds=3, ckpt_name="full.pt").run()
    again = _engine(toy_client, tmp_path / "x", rounds=3, ckpt_name="again.pt").run()
    strip = lambda h: [{k: v for k, v in r.to_dict().items() if k != "seconds"} for r in h]  # noqa: E731
    assert strip(full.history) == strip(again.history)

    class Killed(Exception):
        pass

    def die_after_2(rec):
        if rec.to_dict()["round"] == 2:
            raise Killed

    with pytest.raises(Killed):  # killed during round 2's logging: only round 1 is checkpointed
        _engine(toy_client, tmp_path, rounds=3, ckpt_name="resume.pt", on_round=die_after_2).run()
    resumed = _engine(toy_client, tmp_path, rounds=3, ckpt_name="resume.pt").run()
    assert resumed.resumed_from == 1
    assert strip(resumed.history) == strip(full.history)
    for k in full.final_weights:
        assert torch.equal(full.final_weights[k], resumed.final_weights[k]), k


def test_checkpoint_of_other_config_is_ignored(toy_client, tmp_path):
    _engine(toy_client, tmp_path, "fedavg", rounds=1, ckpt_name="shared.pt").run()
    res = _engine(toy_client, tmp_path, "fedprox", rounds=1, ckpt_name="shared.pt").run()
    assert res.resumed_from == 0


def test_a_collapsed_global_model_is_reported(toy_client, tmp_path):
    """A global model that predicts one class for all validation images gets a warning and
    val_pred_classes = 1 in its round record, since its accuracy is then only that class's share; a healthy one does not."""
    logs = []
    eng = _engine(toy_client, tmp_path, rounds=1, ckpt_name="collapsed.pt")
    eng.loop.log = logs.append
    eng.alg.local = eng.alg.local.model_copy(update={"lr": 0.0})  # Adam with lr 0: the global model stays
    # the collapsed initial one (LocalConfig is immutable: a changed copy)
    with torch.no_grad():
        eng.model.g.weight.zero_()
        eng.model.g.bias.copy_(torch.tensor([0.0, 100.0, 0.0]))  # always class 1
    rec = eng.run().history[-1]
    assert rec.to_dict()["val_pred_classes"] == 1
    assert any("collapsed" in m for m in logs), logs
    n1 = int((eng.loop.evalsets.val_y == 1).sum())
    assert rec.to_dict()["val_acc"] == pytest.approx(
        n1 / len(eng.loop.evalsets.val_y)
    )  # a class share, as the warning says

    logs.clear()
    healthy = _engine(toy_client, tmp_path, rounds=1, ckpt_name="healthy.pt")
    healthy.loop.log = logs.append
    assert healthy.run().history[-1].to_dict()["val_pred_classes"] > 1 and not any("collapsed" in m for m in logs)
