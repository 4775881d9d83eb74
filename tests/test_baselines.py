"""The Table 1 baselines FedSR, FedIIR, GA and FedADG: each equation pinned to hand-computed values,
one engine run of each with checkpoint/resume, and the model file round trip."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fixtures import held_out_run
from torch import nn

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import ALGORITHMS, build_algorithm, load_model
from fedccrl_core.algorithms.base import Reply, StepContext
from fedccrl_core.algorithms.ccst import CCSTKept
from fedccrl_core.algorithms.fedadg import (
    Discriminator,
    FedADG,
    FedADGKept,
    alignment_loss,
    discriminator_loss,
    generator_loss,
)
from fedccrl_core.algorithms.fediir import FedIIR, FedIIRScratch, classifier_gradient, ema_update, iir_penalty
from fedccrl_core.algorithms.fedsr import (
    ClassConditionalReference,
    FedSR,
    ProbabilisticEncoder,
    cmi,
    l2r,
    reparameterize,
)
from fedccrl_core.algorithms.ga import GA, GAKept, generalization_adjustment, step_size
from fedccrl_core.algorithms.local_bn import LocalBNKept
from fedccrl_core.federation.checkpoints import RoundCheckpoints
from fedccrl_core.federation.driver import train
from fedccrl_core.learning.clients import ClientState
from fedccrl_core.learning.model_file import ModelMeta, save_model

BASELINES = ("fedsr", "fediir", "ga", "fedadg")
SMALL = {"fedadg": {"rp_dim": 32, "disc_hidden": 32, "noise_dim": 8, "gen_hidden": 32, "e1": 1}, "fedsr": {"z_dim": 16}}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_registered():
    assert {ALGORITHMS[n] for n in BASELINES} == {FedSR, FedIIR, GA, FedADG}


# ---- FedSR ------------------------------------------------------------------------------------
def test_what_a_client_keeps_is_saved_under_the_keys_checkpoints_hold():
    """A KeptState is written into ClientState.extra under its field names, the keys that round checkpoints and
    Flower's client state files already hold (renaming a field would orphan them); nothing is written for None."""
    saved = {
        GAKept: ["ga_loss_local"],
        FedADGKept: ["discriminator", "opt_d", "opt_g"],
        LocalBNKept: ["local_bn"],
        CCSTKept: ["ccst_style_bank", "ccst_plan"],
    }
    for kept, keys in saved.items():
        assert [f.name for f in dataclasses.fields(kept)] == keys, kept
        extra: dict = {"optimizer_of_another": 1}
        kept().save_into(extra)
        assert extra == {"optimizer_of_another": 1} and kept.of(extra) == kept()
    extra = {}
    GAKept(0.25).save_into(extra)
    assert extra == {"ga_loss_local": 0.25} and GAKept.of(extra).ga_loss_local == 0.25


def test_fedsr_reparameterization_has_head_mean_and_softplus_std():
    enc = ProbabilisticEncoder(nn.Identity(), feature_dim=2, z_dim=2)
    with torch.no_grad():
        enc.head.weight.copy_(torch.eye(4, 2))  # mu = v, pre-softplus sigma = 0 -> sigma = log 2
        enc.head.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]))
    v = torch.tensor([[1.0, -2.0]])
    mu, sigma = enc.distribution(v)
    assert torch.allclose(mu, v) and torch.allclose(sigma, torch.tensor([[math.log(2), math.log(1 + math.e)]]))
    g = torch.Generator().manual_seed(0)
    z = reparameterize(mu.expand(20000, 2), sigma.expand(20000, 2), g)
    assert torch.allclose(z.mean(0), mu[0], atol=0.03) and torch.allclose(z.std(0), sigma[0], atol=0.03)
    eps = torch.randn((1, 2), generator=torch.Generator().manual_seed(5))  # z = mu + sigma * eps, same draw
    assert torch.allclose(reparameterize(mu, sigma, torch.Generator().manual_seed(5)), mu + sigma * eps)


def test_fedsr_l2r_by_hand():
    z = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    assert l2r(z, "squared").item() == pytest.approx((5 + 9) / 2)  # mean ||z||^2 (paper)
    assert l2r(z).item() == l2r(z, "norm").item() == pytest.approx((math.sqrt(5) + 3) / 2)  # official code


def test_fedsr_cmi_is_closed_form_gaussian_kl():
    r = ClassConditionalReference(num_classes=2, z_dim=1)
    with torch.no_grad():
        r.r_mu.copy_(torch.tensor([[0.0], [3.0]]))
        r.r_sigma.copy_(torch.tensor([[math.log(math.e - 1)], [math.log(math.e**2 - 1)]]))  # softplus -> 1, 2
    mu, sigma, y = torch.tensor([[1.0], [1.0]]), torch.tensor([[2.0], [1.0]]), torch.tensor([0, 1])
    # KL(N(1, 2^2) || N(0, 1)) = log(1/2) + (4 + 1)/2 - 1/2; KL(N(1, 1) || N(3, 2^2)) = log 2 + (1 + 4)/8 - 1/2
    kl = [math.log(0.5) + 2.5 - 0.5, math.log(2) + 5 / 8 - 0.5]
    assert cmi(mu, sigma, y, r).item() == pytest.approx(sum(kl) / 2, rel=1e-6)
    ref = torch.distributions.kl_divergence(
        torch.distributions.Normal(mu, sigma),
        torch.distributions.Normal(torch.tensor([[0.0], [3.0]]), torch.tensor([[1.0], [2.0]])),
    )
    assert cmi(mu, sigma, y, r).item() == pytest.approx(ref.mean().item(), rel=1e-6)
    with torch.no_grad():
        r.C.fill_(2.0)  # the official scale: KL(N(C mu, C sigma) || r); first sample: log(1/4) + (16 + 4)/2 - 1/2
    assert cmi(mu[:1], sigma[:1], y[:1], r).item() == pytest.approx(math.log(0.25) + 10 - 0.5, rel=1e-6)


def test_fedsr_inference_is_deterministic_mean_and_training_samples():
    torch.manual_seed(0)
    model = FedSR.build_model("small_cnn", 3, "none", {"z_dim": 8}).eval()
    x = torch.randn(4, 3, 8, 8)
    mu, _ = model.h.distribution(x)
    assert torch.equal(model(x), model(x)) and torch.allclose(model(x), model.g(mu))
    assert {"r.r_mu", "r.r_sigma", "r.C", "h.head.weight"} <= set(model.state_dict())  # aggregated with Eq. 2
    alg = FedSR(LocalConfig(), {"z_dim": 8})
    ctx = StepContext(None, [], torch.Generator().manual_seed(1))
    loss, terms, logits = alg.train_step(model.train(), x, torch.tensor([0, 1, 2, 0]), ctx)
    assert set(terms) == {"l_cls", "l_l2r", "l_cmi"}
    assert loss.item() == pytest.approx((terms["l_cls"] + 0.01 * terms["l_l2r"] + 0.001 * terms["l_cmi"]).item())
    assert not torch.allclose(logits, model.g(model.h.distribution(x)[0]))  # trained on a sample z, not mu


# ---- FedIIR -----------------------------------------------------------------------------------
def _tiny_classifier():
    g = nn.Linear(2, 2)
    with torch.no_grad():
        g.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, -1.0]]))
        g.bias.copy_(torch.tensor([0.5, 0.0]))
    return g


def test_fediir_penalty_by_hand():
    g, z, y = _tiny_classifier(), torch.tensor([[1.0, 2.0], [0.0, 1.0]]), torch.tensor([0, 1])
    # logits [1.5, -2], [0.5, -1]; delta_n = dR/dlogit = (p_n - onehot(y_n)) / B
    # dR/dW = sum_n delta_n z_n^T, dR/db = sum_n delta_n
    delta = []
    for lo, t in (((1.5, -2.0), 0), ((0.5, -1.0), 1)):
        e = [math.exp(v) for v in lo]
        delta.append([(e[j] / sum(e) - (j == t)) / 2 for j in range(2)])
    d_w = [[sum(delta[n][j] * z[n, k].item() for n in range(2)) for k in range(2)] for j in range(2)]
    d_b = [delta[0][j] + delta[1][j] for j in range(2)]
    _risk, grads, _ = classifier_gradient(g, z, y, create_graph=True)
    assert torch.allclose(grads[0], torch.tensor(d_w)) and torch.allclose(grads[1], torch.tensor(d_b))
    g_bar = [torch.tensor([[0.1, -0.2], [0.3, 0.0]]), torch.tensor([0.05, -0.05])]
    by_hand = sum((d_w[j][k] - g_bar[0][j, k].item()) ** 2 for j in range(2) for k in range(2)) + sum(
        (d_b[j] - g_bar[1][j].item()) ** 2 for j in range(2)
    )
    assert iir_penalty(grads, g_bar).item() == pytest.approx(by_hand, rel=1e-6)
    assert iir_penalty(grads, [t.detach() for t in grads]).item() == 0.0  # client gradient == g_bar


def test_fediir_penalty_trains_the_encoder():
    h, g = nn.Linear(2, 2), _tiny_classifier()
    _, grads, _ = classifier_gradient(g, h(torch.tensor([[1.0, 2.0], [0.0, 1.0]])), torch.tensor([0, 1]), True)
    iir_penalty(grads, [torch.zeros_like(t) for t in grads]).backward()  # create_graph: second order reaches h
    assert h.weight.grad is not None and h.weight.grad.abs().sum() > 0


def test_fediir_ema_by_hand_in_aggregate():
    assert ema_update(torch.tensor([1.0]), torch.tensor([3.0]), 0.9).item() == pytest.approx(1.2)
    alg = FedIIR(LocalConfig(), {"ema": 0.9})
    alg.load_server_state({"g_bar": {"weight": torch.tensor([1.0]), "bias": torch.tensor([0.0])}})
    glob = {"g.weight": torch.tensor([5.0])}

    def reply(cid, w, gw, gb, n):  # g_i travels in the reply's upload, next to the weights
        return Reply(
            cid, {"g.weight": torch.tensor([w])}, n, upload={"weight": torch.tensor([gw]), "bias": torch.tensor([gb])}
        )

    out = alg.aggregate(glob, [reply("a", 0.0, 2.0, 0.0, 1), reply("b", 4.0, 4.0, 1.0, 3)])
    assert out["g.weight"].item() == pytest.approx(3.0)  # Eq. 2: (0 + 3 * 4) / 4
    g_bar = alg.server_state()["g_bar"]  # server half's state, not in the model
    assert g_bar["weight"].item() == pytest.approx(0.9 * 1.0 + 0.1 * (2.0 + 3 * 4.0) / 4)  # g_bar EMA
    assert g_bar["bias"].item() == pytest.approx(0.1 * 0.75)
    assert set(out) == {"g.weight"}
    assert all(p is g_bar for p in alg.server_payloads({"a": None, "b": None}).values())  # down: g_bar
    fresh = FedIIR(LocalConfig(), {"ema": 0.9})
    assert fresh.server_payloads({"a": None}) == {"a": None}  # before round 1: nothing to send (zeros)
    fresh.aggregate(glob, [reply("a", 0.0, 2.0, 1.0, 1)])
    assert fresh.server_state()["g_bar"]["weight"].item() == pytest.approx(0.1 * 2.0)  # from g_bar = 0


def test_fediir_sends_gradient_on_global_model_and_trains_against_g_bar(toy_client):
    torch.manual_seed(0)
    local = LocalConfig(rounds=1, local_epochs=1, batch_size=8, lr=1e-2)
    alg = FedIIR(local)
    model = FedIIR.build_model("small_cnn", 3)
    data = toy_client("c", "d", 24, 0, 0)
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    assert not any(k.startswith("grad_g") for k in glob)  # the model holds no gradient
    payload = {"weight": torch.zeros_like(model.g.weight), "bias": torch.tensor([0.1, -0.2, 0.1])}  # g_bar
    model.load_state_dict(glob)
    expected = alg.mean_classifier_gradient(model, data)  # g_i on w^t, before any local step
    model.load_state_dict(glob)
    state = ClientState()
    reply = alg.local_train(
        model, data, state, glob, payload, torch.Generator().manual_seed(0), np.random.default_rng(0)
    )
    # up: g_i, in the reply; local_train runs channels_last (train.fast, CPU too), which reorders the conv
    # sums: equal to float32 round-off, not bit for bit. Measured: 3e-7 of 0.33 with AVX2 kernels, 1.0e-6 of
    # 0.012 (8.4e-5 relative) with ATen's unvectorized ones (ATEN_CPU_CAPABILITY=default); twice that allowed
    torch.testing.assert_close(reply.upload["weight"], expected[0], rtol=2e-4, atol=2e-6)
    torch.testing.assert_close(reply.upload["bias"], expected[1], rtol=2e-4, atol=2e-6)
    assert reply.metrics["l_iir"] > 0 and not torch.equal(reply.weights["g.weight"], glob["g.weight"])
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 0])  # the step's penalty is against g_bar
    model.train()
    g_bar = [payload["weight"], payload["bias"]]
    loss, terms, _ = alg.train_step(model, x, y, StepContext(payload, [], None, state=FedIIRScratch(g_bar)))
    _, grads, _ = classifier_gradient(model.g, model.h(x), y, create_graph=False)
    assert terms["l_iir"].item() == pytest.approx(iir_penalty(grads, g_bar).item(), rel=1e-5)
    assert loss.item() == pytest.approx((terms["l_cls"] + 0.001 * terms["l_iir"]).item(), rel=1e-6)


# ---- GA ---------------------------------------------------------------------------------------
def test_ga_adjustment_moves_toward_larger_gap_and_stays_normalized():
    a = generalization_adjustment({"a": 0.5, "b": 0.5}, {"a": 0.4, "b": 0.2}, d_r=0.1)
    assert a == pytest.approx({"a": 0.6, "b": 0.4})  # centered gaps +-0.1, / max 0.1 -> +-1 step of 0.1
    three = generalization_adjustment({"a": 0.2, "b": 0.3, "c": 0.5}, {"a": 1.0, "b": 0.0, "c": 0.5}, 0.05)
    assert three == pytest.approx({"a": 0.25, "b": 0.25, "c": 0.5}) and sum(three.values()) == pytest.approx(1)
    clipped = generalization_adjustment({"a": 0.02, "b": 0.98}, {"a": 0.0, "b": 1.0}, 0.1)  # a -> -0.08 -> 0
    assert clipped == pytest.approx({"a": 0.0, "b": 1.0})
    equal_gaps = generalization_adjustment({"a": 0.3, "b": 0.7}, {"a": 0.2, "b": 0.2}, 0.1)
    assert equal_gaps == pytest.approx({"a": 0.3, "b": 0.7})  # no gap spread: no step


def test_ga_step_decays_linearly():
    steps = [step_size(0.05, r, 10, 2) for r in range(1, 11)]
    assert steps[0] == pytest.approx(0.025) and steps[-1] == pytest.approx(0.0025)
    assert all(s1 > s2 for s1, s2 in itertools.pairwise(steps))
    assert steps[4] - steps[5] == pytest.approx(steps[0] - steps[1])


def test_ga_aggregate_reweights_by_gap_and_keeps_state():
    alg = GA(LocalConfig(rounds=4), {"step_size": 0.2})
    w = lambda v: {"w": torch.tensor([v])}  # noqa: E731
    out1 = alg.aggregate(None, [Reply("a", w(0.0), 10), Reply("b", w(1.0), 30)])  # round 1: n_i / N
    assert out1["w"].item() == pytest.approx(0.75) and alg.a == pytest.approx({"a": 0.25, "b": 0.75})
    replies = [Reply("a", w(0.0), 10, {"ga_gap": 0.5}), Reply("b", w(1.0), 30, {"ga_gap": 0.1})]
    out2 = alg.aggregate(None, replies)  # round 2: d^2 = 0.2 / 2 * (1 - 1/4) = 0.075 toward a
    assert alg.a == pytest.approx({"a": 0.325, "b": 0.675}) and out2["w"].item() == pytest.approx(0.675)
    again = GA(LocalConfig(rounds=4), {"step_size": 0.2})
    again.load_server_state(alg.server_state())
    assert again.a == alg.a and again.round == 2
    with pytest.raises(ValueError, match="train.ga.gap_data"):
        GA(LocalConfig(), {"gap_data": "test"})


# ---- FedADG -----------------------------------------------------------------------------------
def test_fedadg_least_squares_losses_by_hand():
    d_ref, d_feat = torch.tensor([0.8, 0.6]), torch.tensor([0.3, 0.1])
    assert discriminator_loss(d_ref, d_feat).item() == pytest.approx(((0.04 + 0.09) + (0.16 + 0.01)) / 2)
    assert alignment_loss(d_feat).item() == pytest.approx((0.49 + 0.81) / 2)
    assert generator_loss(d_ref).item() == pytest.approx((0.64 + 0.36) / 2)


def test_fedadg_each_player_updates_only_its_modules():
    torch.manual_seed(0)
    alg = FedADG(LocalConfig(), SMALL["fedadg"])
    model = FedADG.build_model("small_cnn", 3, "none", SMALL["fedadg"]).train()
    D = Discriminator(model.feature_dim, 3, 32, 32)
    opt = alg.make_optimizer(model)
    opt_d, opt_g = torch.optim.SGD(D.parameters(), lr=0.1), torch.optim.SGD(model.generator.parameters(), lr=0.1)
    assert {id(p) for p in opt.param_groups[0]["params"]}.isdisjoint(id(p) for p in model.generator.parameters())
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 0])
    y_soft = F.one_hot(y, 3).float() * 0.7
    xi = torch.rand(4, 8)
    snap = lambda m: [p.detach().clone() for p in m.parameters()]  # noqa: E731
    changed = lambda m, before: any(not torch.equal(p, b) for p, b in zip(m.parameters(), before))  # noqa: E731

    def grads(m):
        return [p.grad for p in m.parameters()]

    z, r = model.h(x), model.generator(xi, y_soft)
    h0, g0, G0, D0 = snap(model.h), snap(model.g), snap(model.generator), snap(D)
    alg.discriminator_step(D, opt_d, z, r, y_soft)  # L_advd: D only
    assert changed(D, D0) and all(gr is None for gr in grads(model.h) + grads(model.generator))
    D1 = snap(D)
    loss = alg.feature_loss(model, D, z, y, y_soft)[0]  # lambda0 L_err + (1 - lambda0) L_advf: h and g, not G or D
    opt.zero_grad(set_to_none=True)  # as the base local loop steps it
    loss.backward()
    opt.step()
    assert changed(model.h, h0) and changed(model.g, g0) and not changed(D, D1)
    assert all(gr is None for gr in grads(model.generator))
    h1 = snap(model.h)
    alg.generator_step(D, opt_g, r, y_soft)  # L_advg: G only
    assert changed(model.generator, G0) and not changed(D, D1) and not changed(model.h, h1)


# ---- one engine run of each, checkpoint + resume -------------------------------------------------
def _run(toy_client, tmp_path, algorithm, rounds=2, ckpt_name="ck.pt"):
    torch.manual_seed(0)
    clients = [toy_client(f"d{i}_c{k}", f"d{i}", 32, 10 * i + k, 20 * i) for i in range(2) for k in range(2)]
    tx = toy_client("t", "t", 40, 99, 40)
    local = LocalConfig(rounds=rounds, local_epochs=1, batch_size=8, lr=1e-2)
    alg = build_algorithm(algorithm, local, SMALL.get(algorithm))
    model = alg.build_model("small_cnn", 3, "none", alg.hp)
    return held_out_run(
        alg,
        model,
        clients,
        (tx.train_x, tx.train_y),
        rounds,
        checkpoint_path=tmp_path / ckpt_name,
        run_info={"k": algorithm},
    )


TERMS = {
    "fedsr": ("l_cls", "l_l2r", "l_cmi"),
    "fediir": ("l_cls", "l_iir"),
    "ga": ("l_cls", "ga_loss_global", "ga_loss_local"),
    "fedadg": ("l_cls", "l_advf", "l_advd", "l_advg"),
}


class Killed(Exception):
    pass


@pytest.mark.parametrize("algorithm", BASELINES)
def test_engine_round_and_resume_keep_server_state(toy_client, tmp_path, algorithm):
    full_run = _run(toy_client, tmp_path, algorithm, ckpt_name="full.pt")
    full = train(full_run, log=lambda m: None)
    for key in TERMS[algorithm] + ("loss", "train_acc", "val_acc", "target_acc"):
        assert all(math.isfinite(rec.to_dict()[key]) for rec in full.history), key
    last = full.history[-1]
    if algorithm == "ga":  # round 2 reports the gap of round 1 and reweights away from n_i / N = 1/4 each
        assert "ga_gap" in last.to_dict() and "ga_gap" not in full.history[0].to_dict()
        a = full_run.algorithm.server_state()["a"]
        assert sum(a.values()) == pytest.approx(1) and max(abs(v - 0.25) for v in a.values()) > 1e-6
    if algorithm == "fediir":  # g_bar is the server half's state: EMA of the clients' classifier gradients
        g, g_bar = full_run.model.g, full_run.algorithm.server_state()["g_bar"]
        assert g_bar["weight"].shape == g.weight.shape and g_bar["bias"].abs().sum() > 0
    extra = RoundCheckpoints(tmp_path / "full.pt", "cpu").client_states()["d0_c0"]["extra"]
    if algorithm == "fedadg":  # G is aggregated; D and the D, G optimizers stay with the client
        assert any(k.startswith("generator.") for k in full.final_weights)
        assert not any(k.startswith("discriminator") for k in full.final_weights)
        assert {"discriminator", "opt_d", "opt_g"} <= set(extra)
        assert full.history[0].metric("lr") == pytest.approx(
            0.005
        )  # cosine over rounds x (E0 + E1) = 4 epochs, after 2
    if algorithm == "ga":
        assert "ga_loss_local" in extra

    def die_in_round_2(rec):
        if rec.metric("round") == 2:
            raise Killed

    with pytest.raises(Killed):  # only round 1 is checkpointed
        killed = _run(toy_client, tmp_path, algorithm, ckpt_name="resume.pt")
        train(killed, on_round=die_in_round_2, log=lambda m: None)
    resumed_run = _run(toy_client, tmp_path, algorithm, ckpt_name="resume.pt")
    resumed = train(resumed_run, log=lambda m: None)
    assert resumed.resumed_from == 1
    strip = lambda h: [{k: v for k, v in r.to_dict().items() if k != "seconds"} for r in h]  # noqa: E731
    assert strip(resumed.history) == strip(full.history)
    for k in full.final_weights:
        assert torch.equal(full.final_weights[k], resumed.final_weights[k]), k
    s_full, s_res = full_run.algorithm.server_state(), resumed_run.algorithm.server_state()
    assert s_full.keys() == s_res.keys()
    for k in s_full:
        v1, v2 = s_full[k], s_res[k]
        if isinstance(v1, dict) and all(isinstance(t, torch.Tensor) for t in v1.values()):  # FedIIR's g_bar
            assert v1.keys() == v2.keys() and all(torch.equal(v1[n], v2[n]) for n in v1), k
        else:
            assert all(torch.equal(a, b) for a, b in zip(v1, v2)) if isinstance(v1, list) else v1 == v2, k


@pytest.mark.parametrize("algorithm", BASELINES)
def test_model_file_round_trip(tmp_path, algorithm):
    torch.manual_seed(1)
    cls = ALGORITHMS[algorithm]
    model = cls.build_model("small_cnn", 3, "none", SMALL.get(algorithm)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    meta = {
        "backbone": "small_cnn",
        "num_classes": 3,
        "classes": ["a", "b", "c"],
        "image_size": 8,
        "mean": [0.5] * 3,
        "std": [0.25] * 3,
        "algorithm": algorithm,
        "hparams": SMALL.get(algorithm),
    }
    save_model(tmp_path / "m.pt", model, ModelMeta(**meta))
    loaded, meta2 = load_model(tmp_path / "m.pt")
    assert meta2.algorithm == algorithm and type(loaded.h) is type(model.h)
    state, state2 = model.state_dict(), loaded.state_dict()
    assert state.keys() == state2.keys() and all(torch.equal(state[k], state2[k]) for k in state)
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(model(x), loaded(x)) and not loaded.training
