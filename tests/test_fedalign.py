"""FedAlign (fedalign.txt): clustering and variance-weighted sampling of the style pool (Sec. 3.3),
MixStyle (Eq. 7-11), L_RC (Eq. 13), L_JS (Eq. 15), Eq. 16 with its switches, the discriminator of
Sec. 3.4, and one engine run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fixtures import held_out_run

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import ALGORITHMS, build_algorithm, load_model
from fedccrl_core.algorithms.base import StepContext
from fedccrl_core.algorithms.fedalign import (
    DomainDiscriminator,
    FedAlign,
    adversarial_loss,
    cluster_variance,
    clustered_mixstyle,
    fedalign_loss,
    grad_reverse,
    kmeans,
    representation_consistency_loss,
    style_pool_distribution,
    style_sampling_probabilities,
)
from fedccrl_core.federation.driver import train
from fedccrl_core.learning.losses import js_loss, representation_alignment_loss
from fedccrl_core.learning.model_file import ModelMeta, save_model
from fedccrl_core.learning.statistics import channel_stats

SMALL = {"disc_hidden": 16}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_registered():
    assert ALGORITHMS["fedalign"] is FedAlign


# ---- Sec. 3.3: clustering and variance-weighted sampling ------------------------------------------
def _blobs(rng, sizes=(40, 25, 10), spreads=(0.05, 0.2, 0.1)):
    centers = np.array([[-2.0, -2, -2, 0.3, 0.3, 0.3], [0, 0, 0, 1, 1, 1], [2, 2, 2, 0.5, 0.5, 0.5]])
    pts = np.concatenate([c + s * rng.standard_normal((n, 6)) for c, n, s in zip(centers, sizes, spreads)])
    truth = np.repeat(np.arange(3), sizes)
    perm = rng.permutation(len(pts))
    return pts[perm], truth[perm]


def test_kmeans_recovers_known_clusters_and_is_seeded():
    pts, truth = _blobs(np.random.default_rng(0))
    labels, centers = kmeans(pts, 3, np.random.default_rng(1))
    assert centers.shape == (3, 6)
    pairs = set(zip(truth.tolist(), labels.tolist()))  # one predicted label per true cluster, a bijection
    assert len(pairs) == 3 and len({t for t, _ in pairs}) == 3 and len({p for _, p in pairs}) == 3
    for c in range(3):
        assert np.allclose(centers[c], pts[labels == c].mean(0))
    again, _ = kmeans(pts, 3, np.random.default_rng(1))
    assert np.array_equal(labels, again)
    assert labels[0] == 0  # renumbered by first appearance
    assert kmeans(pts[:2], 5, np.random.default_rng(0))[0].max() <= 1  # k > P: at most P clusters


def test_sampling_probabilities_follow_cluster_variance():
    pts, truth = _blobs(np.random.default_rng(3))
    # expected, computed directly: v_c = mean_j ||s_j - s_bar_c||^2, p_c = v_c / sum v, q_j = p_c / n_c
    v = np.array([np.mean(np.sum((pts[truth == c] - pts[truth == c].mean(0)) ** 2, axis=1)) for c in range(3)])
    p = v / v.sum()
    n = np.bincount(truth)
    expected = p[truth] / n[truth]
    assert np.allclose(cluster_variance(pts, truth), v)
    q = style_sampling_probabilities(pts, truth)
    assert np.allclose(q, expected) and q.sum() == pytest.approx(1.0)
    assert p[1] > p[0]  # the widest cluster (spread 0.2) is drawn most, though it is not the largest
    uniform = style_sampling_probabilities(pts, truth, variance_weights=False)
    assert np.allclose(uniform, (1 / 3) / n[truth])
    # frequencies of the device sampler: draws per cluster match p
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(torch.as_tensor(q, dtype=torch.float32), 60000, replacement=True, generator=g)
    freq = np.bincount(truth[draws.numpy()], minlength=3) / 60000
    assert np.allclose(freq, p, atol=0.01)
    # a pool that is all one point has zero variance everywhere: uniform fallback
    flat = style_sampling_probabilities(np.zeros((4, 6)), np.array([0, 0, 1, 1]))
    assert np.allclose(flat, 0.25)


def test_style_pool_distribution_clusters_the_mu_sigma_vectors():
    pts, truth = _blobs(np.random.default_rng(4))
    q, labels = style_pool_distribution(pts[:, :3], pts[:, 3:], 3, np.random.default_rng(0))
    assert len(set(zip(truth.tolist(), labels.tolist()))) == 3
    assert np.allclose(q, style_sampling_probabilities(pts, labels))
    q1, l1 = style_pool_distribution(pts[:, :3], pts[:, 3:], 1, np.random.default_rng(0))
    assert np.allclose(q1, 1 / len(pts)) and (l1 == 0).all()  # n_clusters = 1: FedCCRL's uniform pool


def test_mixstyle_eq_9_to_11():
    """FedAlign's M is augment/ccdt.py's MixStyle with lambda on the sample's own statistics (Eq. 9-10)."""
    from fedccrl_core.augment.ccdt import mixstyle as shared

    def mixstyle(x, mu, sigma, lam):
        return shared(x, mu, sigma, lam, lam_weighs="own")

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 5, 5, generator=g) * 2 + 1
    mu_j, sigma_j = torch.tensor([[0.5, -1.0]] * 3), torch.tensor([[2.0, 0.3]] * 3)
    out = mixstyle(x, mu_j, sigma_j, torch.zeros(3))  # lambda = 0: the pool row's statistics exactly
    m, s = channel_stats(out)
    assert torch.allclose(m, mu_j, atol=1e-5) and torch.allclose(s, sigma_j, atol=1e-4)
    assert torch.allclose(mixstyle(x, mu_j, sigma_j, torch.ones(3)), x, atol=1e-5)  # lambda = 1: x itself
    half = mixstyle(x, mu_j, sigma_j, torch.full((3,), 0.5))
    m0, s0 = channel_stats(x)
    m, s = channel_stats(half)
    assert torch.allclose(m, 0.5 * m0 + 0.5 * mu_j, atol=1e-5)
    assert torch.allclose(s, 0.5 * s0 + 0.5 * sigma_j, atol=1e-4)
    # clustered: a row with q = 0 is never used; here only row 1 can be drawn
    pool_mu, pool_sigma = torch.tensor([[9.0, 9.0], [0.5, -1.0]]), torch.tensor([[9.0, 9.0], [2.0, 0.3]])
    out = clustered_mixstyle(x, pool_mu, pool_sigma, torch.tensor([0.0, 1.0]), 0.1, g)
    m, _ = channel_stats(out)
    assert (m < 5).all()


# ---- Sec. 3.5-3.7: losses ---------------------------------------------------------------------
def test_l_rc_is_the_mean_squared_error_of_both_views():
    g = torch.Generator().manual_seed(0)
    z, z1, z2 = (torch.randn(4, 5, generator=g) for _ in range(3))
    direct = 0.5 * (((z1 - z) ** 2).sum() / z.numel() + ((z2 - z) ** 2).sum() / z.numel())
    assert representation_consistency_loss(z, z1, z2).item() == pytest.approx(direct.item(), rel=1e-6)
    assert representation_consistency_loss(z, z, z).item() == 0.0


def test_eq16_composition_and_switches():
    g = torch.Generator().manual_seed(0)
    lo, lo1, lo2 = (torch.randn(6, 3, generator=g) for _ in range(3))
    z, z1, z2 = (torch.randn(6, 8, generator=g) for _ in range(3))
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    l1, l2 = 0.3, 0.7
    loss, t = fedalign_loss(lo, lo1, lo2, z, z1, z2, y, l1, l2, 0.1)
    cls = F.cross_entropy(lo, y)  # Alg. 1: the original view only
    sc = representation_alignment_loss(z, z1, z2, y, 0.1)
    rc = representation_consistency_loss(z, z1, z2)
    js = js_loss(lo, lo1, lo2)
    assert set(t) == {"l_cls", "l_sc", "l_rc", "l_js"}
    assert t["l_cls"].item() == pytest.approx(cls.item()) and t["l_sc"].item() == pytest.approx(sc.item())
    assert t["l_rc"].item() == pytest.approx(rc.item()) and t["l_js"].item() == pytest.approx(js.item())
    assert loss.item() == pytest.approx((cls + l1 * (sc + rc) + l2 * js).item(), rel=1e-6)  # Eq. 16
    # L_JS (Eq. 15) by hand on the softmax outputs
    p = [F.softmax(v, 1) for v in (lo, lo1, lo2)]
    m = (p[0] + p[1] + p[2]) / 3
    by_hand = sum((pi * (pi.log() - m.log())).sum(1).mean() for pi in p) / 3
    assert js.item() == pytest.approx(by_hand.item(), rel=1e-5)
    off, t_off = fedalign_loss(lo, lo1, lo2, z, z1, z2, y, l1, l2, 0.1, l_sc=False, l_rc=True, l_js=False)
    assert set(t_off) == {"l_cls", "l_rc"} and off.item() == pytest.approx((cls + l1 * rc).item(), rel=1e-6)
    adv = torch.tensor(0.25)
    with_adv, t_adv = fedalign_loss(lo, lo1, lo2, z, z1, z2, y, l1, l2, 0.1, l_adv=adv)
    assert with_adv.item() == pytest.approx(loss.item() + 0.25, rel=1e-6) and "l_adv" in t_adv


# ---- Sec. 3.4: discriminator ------------------------------------------------------------------
def test_adversarial_loss_by_hand():
    d0, d1, d2 = torch.tensor([0.0, 2.0]), torch.tensor([1.0, -1.0]), torch.tensor([0.5, 0.0])
    sp = lambda v: math.log1p(math.exp(v))  # noqa: E731  BCE(logit, 1) = softplus(-l), BCE(logit, 0) = softplus(l)
    orig = (sp(0.0) + sp(2.0)) / 2
    aug = 0.5 * ((sp(-1.0) + sp(1.0)) / 2 + (sp(-0.5) + sp(0.0)) / 2)
    assert adversarial_loss(d0, d1, d2).item() == pytest.approx(0.5 * (orig + aug), rel=1e-6)


def test_discriminator_descends_while_the_encoder_gets_the_reversed_gradient():
    torch.manual_seed(0)
    D = DomainDiscriminator(4, 8, 0.5)
    assert {"Linear", "BatchNorm1d", "ReLU", "Dropout"} <= {m.__class__.__name__ for m in D.net}  # Sec. 3.4
    D.eval()  # deterministic forward (dropout off) so the two passes below are comparable
    z = torch.randn(12, 4, requires_grad=True)
    d = D(grad_reverse(z, 0.5))
    assert torch.allclose(d, D(z.detach()))  # identity forward
    adversarial_loss(d[:4], d[4:8], d[8:]).backward()
    reversed_d_grads = [p.grad.clone() for p in D.parameters()]
    D.zero_grad()
    z_plain = z.detach().clone().requires_grad_(True)
    d = D(z_plain)
    adversarial_loss(d[:4], d[4:8], d[8:]).backward()
    assert z_plain.grad.abs().sum() > 0
    assert torch.allclose(z.grad, -0.5 * z_plain.grad, atol=1e-7)  # h: reversed and scaled by lambda_adv
    assert all(torch.allclose(a, p.grad) for a, p in zip(reversed_d_grads, D.parameters()))  # D: its own loss


def test_model_has_discriminator_but_infers_with_g_h_only(tmp_path):
    torch.manual_seed(0)
    model = FedAlign.build_model("small_cnn", 3, "none", SMALL).eval()
    assert any(k.startswith("discriminator.") for k in model.state_dict())  # aggregated with Eq. 2
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(model(x), model.g(model.h(x)))
    meta = {
        "backbone": "small_cnn",
        "num_classes": 3,
        "classes": ["a", "b", "c"],
        "image_size": 8,
        "mean": [0.5] * 3,
        "std": [0.25] * 3,
        "algorithm": "fedalign",
        "hparams": SMALL,
    }
    save_model(tmp_path / "m.pt", model, ModelMeta(**meta))
    loaded, _ = load_model(tmp_path / "m.pt")  # rebuilt through FedAlign.build_model
    assert loaded.state_dict().keys() == model.state_dict().keys() and torch.equal(loaded(x), model(x))


def test_train_step_terms_and_adv_switch():
    torch.manual_seed(0)
    g = np.random.default_rng(0)
    payload = {
        "mu": g.normal(size=(30, 3)).astype(np.float32),
        "sigma": (np.abs(g.normal(size=(30, 3))) + 0.5).astype(np.float32),
    }
    x, y = torch.randn(6, 3, 8, 8), torch.tensor([0, 1, 2, 0, 1, 2])
    for adv in (True, False):
        alg = FedAlign(LocalConfig(), {**SMALL, "adv": adv})
        model = FedAlign.build_model("small_cnn", 3, "none", SMALL).train()
        ctx = StepContext(payload, [], torch.Generator().manual_seed(0))
        loss, terms, logits = alg.train_step(model, x, y, ctx)
        assert set(terms) == {"l_cls", "l_sc", "l_rc", "l_js"} | ({"l_adv"} if adv else set())
        assert logits.shape == (6, 3) and math.isfinite(loss.item())
        assert ctx.state[2].sum().item() == pytest.approx(1.0, abs=1e-5)  # q, once per client-round
        loss.backward()
        has_grad = all(p.grad is not None for p in model.discriminator.parameters())
        assert has_grad == adv


# ---- one engine run ------------------------------------------------------------------------------
def test_engine_round(toy_client, tmp_path):
    torch.manual_seed(0)
    clients = [
        toy_client(f"d{i}_c{k}", f"d{i}", 32, 10 * i + k, 20 * i, stats=True, stats_mean=20 * i / 40)
        for i in range(2)
        for k in range(2)
    ]
    tx = toy_client("t", "t", 40, 99, 40, stats=True, stats_mean=40 / 40)
    local = LocalConfig(rounds=1, local_epochs=1, batch_size=8, lr=1e-2)
    alg = build_algorithm("fedalign", local, SMALL)
    model = alg.build_model("small_cnn", 3, "none", alg.hp)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run = held_out_run(
        alg, model, clients, (tx.train_x, tx.train_y), 1, checkpoint_path=tmp_path / "ck.pt", run_info={"k": "fedalign"}
    )
    res = train(run, log=lambda m: None)
    rec = res.history[0]
    for key in ("loss", "l_cls", "l_sc", "l_rc", "l_js", "l_adv", "val_acc", "target_acc"):
        assert math.isfinite(rec.to_dict()[key]), key
    w = res.final_weights
    assert not torch.equal(w["g.weight"], before["g.weight"])
    assert not torch.equal(w["discriminator.net.0.weight"], before["discriminator.net.0.weight"])
    k_i = math.ceil(0.1 * 24)  # statistics upload: ceil(r n_i) rows of (mu, sigma), 3 channels, float32
    w_bytes = sum(v.numel() * v.element_size() for v in before.values())
    assert rec.to_dict()["bytes_up"] == 4 * w_bytes + 4 * 2 * k_i * 3 * 4
