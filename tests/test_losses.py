"""Eq. 9-16 pinned to explicit numpy loops written straight from the paper's definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedccrl_core.learning.losses import (
    fedccrl_loss,
    js_loss,
    representation_alignment_loss,
    supcon_loss,
    three_view_ce,
)


def supcon_numpy(z_prime, z_dprime, y_prime, y_dprime, tau, reduction="mean"):
    """Eq. 9-11 with explicit loops over i, p and a (float64)."""
    z = np.concatenate([z_prime, z_dprime]).astype(np.float64)  # Eq. 9
    y = np.concatenate([y_prime, y_dprime])  # Eq. 10
    z = z / np.linalg.norm(z, axis=1, keepdims=True)
    n = len(z)

    def s(i, j):
        return math.exp(float(z[i] @ z[j]) / tau)

    losses = []
    for i in range(n):
        A = [a for a in range(n) if a != i]
        P = [p for p in A if y[p] == y[i]]
        if not P:
            continue  # no positive: skipped
        denominator = sum(s(i, a) for a in A)
        losses.append(-sum(math.log(s(i, p) / denominator) for p in P) / len(P))
    if not losses:
        return 0.0
    return float(np.mean(losses)) if reduction == "mean" else float(np.sum(losses))


def kl_numpy(p, q):
    return float(np.mean(np.sum(p * (np.log(p) - np.log(q)), axis=1)))


def softmax_numpy(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


# ---------------------------------------------------------------------------------------------
# L_SC (Eq. 9-11) and L_RA (Eq. 12)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_supcon_equals_the_explicit_loop_on_three_samples(reduction):
    rng = np.random.default_rng(0)
    z1, z2 = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    y = np.array([0, 1, 0])
    t = torch.from_numpy
    got = supcon_loss(t(z1), t(z2), t(y), t(y), 0.1, reduction)
    assert got.item() == pytest.approx(supcon_numpy(z1, z2, y, y, 0.1, reduction), rel=1e-5)


def test_supcon_by_hand_single_pair():
    """B = 1, two views with cosine 0.6: A(i) = P(i) = {the other view}, so every log-ratio is
    log 1 = 0 and L_SC = 0 exactly (P(i) excludes i). Counting i among its own positives (as the
    authors' code does) would give -1/2 (1 - 0.6) / tau = -2 instead."""
    z1 = torch.tensor([[1.0, 0.0]])
    z2 = torch.tensor([[0.6, 0.8]])  # cosine 0.6
    y = torch.tensor([3])
    assert supcon_loss(z1, z2, y, y, tau=0.1).item() == pytest.approx(0.0, abs=1e-6)


def test_supcon_by_hand_two_classes():
    """Z' = [e1, e2], Z'' = [e1, e2], labels [0, 1]. For anchor 1 (e1): A = {e2, e1, e2},
    P = {e1 in view 2}: loss = -log(e^{1/t} / (e^{1/t} + 2 e^0)); same for every anchor."""
    tau = 0.5
    e = torch.eye(2)
    y = torch.tensor([0, 1])
    want = -math.log(math.exp(1 / tau) / (math.exp(1 / tau) + 2.0))
    assert supcon_loss(e, e, y, y, tau).item() == pytest.approx(want, rel=1e-6)
    assert supcon_loss(e, e, y, y, tau, reduction="sum").item() == pytest.approx(4 * want, rel=1e-6)


def test_supcon_skips_anchors_without_positives():
    rng = np.random.default_rng(1)
    z1, z2 = rng.normal(size=(2, 5)), rng.normal(size=(2, 5))
    y1, y2 = np.array([0, 1]), np.array([0, 2])  # anchors with labels 1 and 2 have no positive
    got = supcon_loss(*(torch.from_numpy(a) for a in (z1, z2, y1, y2)), tau=0.1)
    assert got.item() == pytest.approx(supcon_numpy(z1, z2, y1, y2, 0.1), rel=1e-5)
    none = supcon_loss(*(torch.from_numpy(a) for a in (z1, z2, np.array([0, 1]), np.array([2, 3]))), tau=0.1)
    assert none.item() == 0.0


def test_supcon_is_stable_at_a_small_temperature_and_large_norms():
    rng = np.random.default_rng(2)
    z1, z2 = rng.normal(size=(8, 16)) * 1e4, rng.normal(size=(8, 16)) * 1e4
    y = rng.integers(0, 3, size=8)
    t = torch.from_numpy
    got = supcon_loss(t(z1).float(), t(z2).float(), t(y), t(y), tau=0.01)
    assert torch.isfinite(got)
    # the float64 loop evaluates exp(1/0.01) = e^100 ~ 3e43 directly, which float64 holds
    assert got.item() == pytest.approx(supcon_numpy(z1, z2, y, y, 0.01), rel=1e-4)


def test_supcon_gradient_is_finite():
    z1 = torch.randn(4, 8, requires_grad=True)
    z2 = torch.randn(4, 8, requires_grad=True)
    y = torch.tensor([0, 1, 0, 2])
    supcon_loss(z1, z2, y, y).backward()
    assert torch.isfinite(z1.grad).all() and torch.isfinite(z2.grad).all()


def test_representation_alignment_is_the_mean_of_two_supcon_terms():
    rng = np.random.default_rng(3)
    z, z1, z2 = (rng.normal(size=(4, 6)) for _ in range(3))
    y = np.array([1, 0, 1, 2])
    got = representation_alignment_loss(*(torch.from_numpy(a) for a in (z, z1, z2, y)), tau=0.1)
    want = 0.5 * (supcon_numpy(z1, z, y, y, 0.1) + supcon_numpy(z2, z, y, y, 0.1))  # Eq. 12
    assert got.item() == pytest.approx(want, rel=1e-5)


# ---------------------------------------------------------------------------------------------
# L_JS (Eq. 13-14), L_CLS (Eq. 16), L (Eq. 15)
# ---------------------------------------------------------------------------------------------
def test_js_equals_numpy():
    rng = np.random.default_rng(4)
    logits = [rng.normal(size=(5, 7)) * 2 for _ in range(3)]
    p = [softmax_numpy(t) for t in logits]
    y_bar = (p[0] + p[1] + p[2]) / 3  # Eq. 13
    want = sum(kl_numpy(pv, y_bar) for pv in p) / 3  # Eq. 14
    got = js_loss(*(torch.from_numpy(t) for t in logits))
    assert got.item() == pytest.approx(want, rel=1e-5)


def test_js_by_hand_two_classes():
    """p = (1, 0) (very confident), p1 = p2 = (1/2, 1/2): Y_bar = (2/3, 1/3);
    KL(p||Y_bar) = log(3/2); KL(p1||Y_bar) = 1/2 log(3/4) + 1/2 log(3/2)."""
    logits = torch.tensor([[60.0, 0.0]])
    half = torch.zeros(1, 2)
    want = (math.log(1.5) + 2 * (0.5 * math.log(0.75) + 0.5 * math.log(1.5))) / 3
    assert js_loss(logits, half, half).item() == pytest.approx(want, rel=1e-5)


def test_js_is_zero_for_identical_predictions_and_bounded():
    logits = torch.randn(6, 5)
    assert js_loss(logits, logits.clone(), logits.clone()).item() == pytest.approx(0.0, abs=1e-7)
    far = [torch.tensor([[50.0, 0, 0]]), torch.tensor([[0, 50.0, 0]]), torch.tensor([[0, 0, 50.0]])]
    assert js_loss(*far).item() == pytest.approx(math.log(3), rel=1e-4)  # the maximum, log 3


def test_three_view_ce_is_the_mean_of_three_cross_entropies():
    torch.manual_seed(0)
    logits = [torch.randn(4, 3) for _ in range(3)]
    y = torch.tensor([0, 2, 1, 2])
    want = sum(F.cross_entropy(t, y) for t in logits) / 3
    assert three_view_ce(*logits, y).item() == pytest.approx(want.item(), rel=1e-6)
    by_hand = np.mean([-np.log(softmax_numpy(t.numpy())[np.arange(4), y.numpy()]).mean() for t in logits])
    assert three_view_ce(*logits, y).item() == pytest.approx(float(by_hand), rel=1e-5)


def test_fedccrl_loss_combines_the_terms_and_honours_the_switches():
    torch.manual_seed(1)
    logits = [torch.randn(4, 3, requires_grad=True) for _ in range(3)]
    zs = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
    y = torch.tensor([0, 1, 1, 2])
    total, terms = fedccrl_loss(*logits, *zs, y, lambda1=0.3, lambda2=0.7, tau=0.1)
    cls = three_view_ce(*logits, y)
    ra = representation_alignment_loss(*zs, y, 0.1)
    js = js_loss(*logits)
    assert total.item() == pytest.approx((cls + 0.3 * ra + 0.7 * js).item(), rel=1e-6)  # Eq. 15
    assert set(terms) == {"loss", "l_cls", "l_ra", "l_js"}
    assert terms["l_ra"].item() == pytest.approx(ra.item()) and not terms["loss"].requires_grad
    total.backward()
    assert all(t.grad is not None for t in logits + zs)

    only_cls, terms = fedccrl_loss(*logits, *zs, y, l_ra=False, l_js=False)
    assert only_cls.item() == pytest.approx(cls.item()) and set(terms) == {"loss", "l_cls"}
    no_js, terms = fedccrl_loss(*logits, *zs, y, lambda1=0.3, l_js=False)
    assert no_js.item() == pytest.approx((cls + 0.3 * ra).item(), rel=1e-6) and "l_js" not in terms


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (checks the device path for host syncs)")
def test_fedccrl_loss_runs_on_cuda_without_host_syncs():
    device = torch.device("cuda")
    logits = [torch.randn(8, 7, device=device, requires_grad=True) for _ in range(3)]
    zs = [torch.randn(8, 16, device=device, requires_grad=True) for _ in range(3)]
    y = torch.randint(0, 7, (8,), device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        total, terms = fedccrl_loss(*logits, *zs, y)
        total.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(terms["loss"]).item()
