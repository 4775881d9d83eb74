"""Eq. 9-16 and the reference code's two forms against float64 loops written from the equations: the tests that
kill `make mutation`'s mutants of fedccrl_core/learning/losses.py that tests/test_losses.py leaves alive."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from fedccrl_core.foundation import contract
from fedccrl_core.learning.losses import (
    SUPCON,
    fedccrl_loss,
    js_loss,
    representation_alignment_loss,
    supcon_loss,
    supcon_self_positive_loss,
    three_view_ce,
)


def unit_rows(z: np.ndarray) -> np.ndarray:
    return z / np.linalg.norm(z, axis=1, keepdims=True)


def sim_loop(z: np.ndarray, tau: float) -> list[list[float]]:
    """sim(Z_i, Z_a) / tau, the cosine similarity (Eq. 11's s = exp of it)."""
    z = unit_rows(z)
    return [[float(z[i] @ z[a]) / tau for a in range(len(z))] for i in range(len(z))]


def supcon_loop(z1, z2, y1, y2, tau, reduction="mean") -> float:
    """Eq. 9-11: P(i) = A(i) with i's label, A(i) = I minus {i}; anchors with no positive skipped."""
    z, y = np.concatenate([z1, z2]).astype(np.float64), np.concatenate([y1, y2])
    sim, n, per_anchor = sim_loop(z, tau), len(z), []
    for i in range(n):
        a_i = [a for a in range(n) if a != i]
        p_i = [p for p in a_i if y[p] == y[i]]
        if p_i:
            log_den = math.log(sum(math.exp(sim[i][a]) for a in a_i))
            per_anchor.append(-sum(sim[i][p] - log_den for p in p_i) / len(p_i))
    if not per_anchor:
        return 0.0
    return sum(per_anchor) if reduction == "sum" else sum(per_anchor) / len(per_anchor)


def self_positive_loop(z1, z2, y1, y2, tau) -> float:
    """The reference code's form: positives P(i) u {i}, denominator over A(i), mean over all 2B anchors."""
    z, y = np.concatenate([z1, z2]).astype(np.float64), np.concatenate([y1, y2])
    sim, n, total = sim_loop(z, tau), len(z), 0.0
    for i in range(n):
        pos = [p for p in range(n) if y[p] == y[i]]  # i included
        log_den = math.log(sum(math.exp(sim[i][a]) for a in range(n) if a != i))
        total += log_den - sum(sim[i][p] for p in pos) / len(pos)
    return total / n


def softmax(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max())
    return e / e.sum()


def js_loop(l0, l1, l2) -> float:
    """Eq. 13-14 row by row, Y_bar clamped to [1e-7, 1] before the log."""
    total = 0.0
    for r in range(len(l0)):
        ps = [softmax(v[r].astype(np.float64)) for v in (l0, l1, l2)]
        y_bar = np.clip((ps[0] + ps[1] + ps[2]) / 3.0, 1e-7, 1.0)  # Eq. 13
        total += sum(float(np.sum(p * (np.log(p) - np.log(y_bar)))) for p in ps) / 3.0  # Eq. 14
    return total / len(l0)


def ce_loop(logits, y) -> float:
    return float(np.mean([-math.log(softmax(logits[r].astype(np.float64))[y[r]]) for r in range(len(y))]))


def data(b=4, v=5, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    z, z1, z2 = (torch.randn(b, v, generator=g) for _ in range(3))
    l0, l1, l2 = (torch.randn(b, c, generator=g) * 2 for _ in range(3))
    y = torch.tensor([0, 1, 0, 2][:b])
    return z, z1, z2, l0, l1, l2, y


def test_self_positive_form_equals_its_loop():
    z, z1, _, _, _, _, y = data()
    y2 = torch.tensor([1, 1, 0, 2])
    for tau in (0.1, 0.5):
        got = float(supcon_self_positive_loss(z, z1, y, y2, tau))
        assert got == pytest.approx(self_positive_loop(z.numpy(), z1.numpy(), y.numpy(), y2.numpy(), tau), rel=1e-5)


def test_self_positive_form_differs_from_eq11():
    z, z1, _, _, _, _, y = data(seed=3)
    assert float(supcon_self_positive_loss(z, z1, y, y)) != pytest.approx(float(supcon_loss(z, z1, y, y)), rel=1e-3)


def test_default_temperature_is_0_1_everywhere():
    z, z1, z2, _, _, _, y = data(seed=1)
    zn, z1n, z2n, yn = z.numpy(), z1.numpy(), z2.numpy(), y.numpy()
    assert float(supcon_loss(z, z1, y, y)) == pytest.approx(supcon_loop(zn, z1n, yn, yn, 0.1), rel=1e-5)
    assert float(supcon_self_positive_loss(z, z1, y, y)) == pytest.approx(
        self_positive_loop(zn, z1n, yn, yn, 0.1), rel=1e-5
    )
    ra = 0.5 * (supcon_loop(z1n, zn, yn, yn, 0.1) + supcon_loop(z2n, zn, yn, yn, 0.1))  # Eq. 12
    assert float(representation_alignment_loss(z, z1, z2, y)) == pytest.approx(ra, rel=1e-5)


def test_supcon_sum_and_mean_with_a_skipped_anchor():
    """One anchor of label 2 in one view only has no positive: the mean is over the 7 others, the sum over all."""
    z, z1, _, _, _, _, y = data(seed=2)
    y2 = torch.tensor([0, 1, 0, 1])  # label 2 (anchor 3 of Z') has no positive
    zn, z1n = z.numpy(), z1.numpy()
    for red in ("mean", "sum"):
        want = supcon_loop(zn, z1n, y.numpy(), y2.numpy(), 0.3, red)
        assert float(supcon_loss(z, z1, y, y2, 0.3, red)) == pytest.approx(want, rel=1e-5)


def test_supcon_with_no_positive_at_all_is_zero():
    z = torch.eye(3)
    y1, y2 = torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])
    assert float(supcon_loss(z, z, y1, y2)) == 0.0
    assert float(supcon_loss(z, z, y1, y2, reduction="sum")) == 0.0


@pytest.mark.parametrize("fn", [supcon_loss, three_view_ce])
def test_an_unknown_reduction_is_refused(fn):
    args = (torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'max'"):
        fn(*args, reduction="max") if fn is three_view_ce else fn(*args[:2], args[3], args[3], reduction="max")


def test_representation_alignment_with_the_reference_form():
    z, z1, z2, _, _, _, y = data(seed=4)
    zn, z1n, z2n, yn = z.numpy(), z1.numpy(), z2.numpy(), y.numpy()
    want = 0.5 * (self_positive_loop(z1n, zn, yn, yn, 0.2) + self_positive_loop(z2n, zn, yn, yn, 0.2))
    assert float(representation_alignment_loss(z, z1, z2, y, 0.2, "self_positive")) == pytest.approx(want, rel=1e-5)
    assert SUPCON == {"paper": supcon_loss, "self_positive": supcon_self_positive_loss}


def test_js_equals_its_loop_with_confident_views():
    """Views confident on different classes: Y_bar stays above the clamp, and the three KL terms differ."""
    l0 = torch.tensor([[8.0, -8.0, 0.0], [0.5, 0.1, -0.2]])
    l1 = torch.tensor([[-8.0, 8.0, 0.0], [0.0, 1.0, 0.3]])
    l2 = torch.tensor([[0.0, 0.0, 8.0], [2.0, -1.0, 0.0]])
    assert float(js_loss(l0, l1, l2)) == pytest.approx(js_loop(l0.numpy(), l1.numpy(), l2.numpy()), rel=1e-5)


def test_js_clamps_y_bar_at_1e_minus_7():
    """A class with probability ~e^-40 in every view: log Y_bar is log(1e-7) there; the JS of near one-hot views
    is then the clamp's: p (log p - log 1e-7) with p ~ e^-40 is ~0, so the loss stays at the loop's value."""
    l0 = torch.tensor([[20.0, -20.0, 0.0]])
    l1 = torch.tensor([[20.0, -20.0, 1.0]])
    l2 = torch.tensor([[19.0, -20.0, 0.0]])
    assert float(js_loss(l0, l1, l2)) == pytest.approx(js_loop(l0.numpy(), l1.numpy(), l2.numpy()), rel=1e-4)


def test_three_view_ce_sum_and_mean():
    _, _, _, l0, l1, l2, y = data(seed=5)
    ce = [ce_loop(v.numpy(), y.numpy()) for v in (l0, l1, l2)]
    assert float(three_view_ce(l0, l1, l2, y)) == pytest.approx(sum(ce) / 3.0, rel=1e-5)  # Eq. 16
    assert float(three_view_ce(l0, l1, l2, y, "sum")) == pytest.approx(sum(ce), rel=1e-5)


@pytest.mark.parametrize(("l_cls", "supcon"), [("mean", "paper"), ("sum", "self_positive")])
def test_fedccrl_loss_is_eq15_with_distinct_lambdas(l_cls, supcon):
    z, z1, z2, l0, l1, l2, y = data(seed=6)
    zn, z1n, z2n, yn = z.numpy(), z1.numpy(), z2.numpy(), y.numpy()
    form = supcon_loop if supcon == "paper" else self_positive_loop
    ce = sum(ce_loop(v.numpy(), yn) for v in (l0, l1, l2)) / (3.0 if l_cls == "mean" else 1.0)
    ra = 0.5 * (form(z1n, zn, yn, yn, 0.4) + form(z2n, zn, yn, yn, 0.4))
    js = js_loop(l0.numpy(), l1.numpy(), l2.numpy())
    total, terms = fedccrl_loss(l0, l1, l2, z, z1, z2, y, lambda1=0.3, lambda2=0.7, tau=0.4, l_cls=l_cls, supcon=supcon)
    assert float(total) == pytest.approx(ce + 0.3 * ra + 0.7 * js, rel=1e-5)  # Eq. 15
    assert float(terms[contract.L_CLS]) == pytest.approx(ce, rel=1e-5)
    assert float(terms[contract.L_RA]) == pytest.approx(ra, rel=1e-5)
    assert float(terms[contract.L_JS]) == pytest.approx(js, rel=1e-5)
    assert float(terms[contract.LOSS]) == float(total)
    assert all(not t.requires_grad for t in terms.values())


def test_fedccrl_loss_defaults_are_the_papers():
    """lambda1 = lambda2 = tau = 0.1 (Table 1 caption), the mean L_CLS and Eq. 11."""
    z, z1, z2, l0, l1, l2, y = data(seed=7)
    zn, z1n, z2n, yn = z.numpy(), z1.numpy(), z2.numpy(), y.numpy()
    ce = sum(ce_loop(v.numpy(), yn) for v in (l0, l1, l2)) / 3.0
    ra = 0.5 * (supcon_loop(z1n, zn, yn, yn, 0.1) + supcon_loop(z2n, zn, yn, yn, 0.1))
    js = js_loop(l0.numpy(), l1.numpy(), l2.numpy())
    total, terms = fedccrl_loss(l0, l1, l2, z, z1, z2, y)
    assert float(total) == pytest.approx(ce + 0.1 * ra + 0.1 * js, rel=1e-5)
    assert set(terms) == {contract.L_CLS, contract.L_RA, contract.L_JS, contract.LOSS}


@pytest.mark.parametrize(("l_ra", "l_js"), [(False, True), (True, False), (False, False)])
def test_fedccrl_loss_switches_leave_a_term_out(l_ra, l_js):
    z, z1, z2, l0, l1, l2, y = data(seed=8)
    zn, z1n, z2n, yn = z.numpy(), z1.numpy(), z2.numpy(), y.numpy()
    want = sum(ce_loop(v.numpy(), yn) for v in (l0, l1, l2)) / 3.0
    if l_ra:
        want += 0.2 * 0.5 * (supcon_loop(z1n, zn, yn, yn, 0.1) + supcon_loop(z2n, zn, yn, yn, 0.1))
    if l_js:
        want += 0.5 * js_loop(l0.numpy(), l1.numpy(), l2.numpy())
    total, terms = fedccrl_loss(l0, l1, l2, z, z1, z2, y, lambda1=0.2, lambda2=0.5, l_ra=l_ra, l_js=l_js)
    assert float(total) == pytest.approx(want, rel=1e-5)
    assert (contract.L_RA in terms) == l_ra and (contract.L_JS in terms) == l_js


def test_the_losses_are_float32_from_half_inputs():
    z, z1, z2, l0, l1, l2, y = data(seed=9)
    h = [t.to(torch.bfloat16) for t in (z, z1, z2, l0, l1, l2)]
    assert supcon_loss(h[0], h[1], y, y).dtype == torch.float32
    assert supcon_self_positive_loss(h[0], h[1], y, y).dtype == torch.float32
    assert js_loss(*h[3:]).dtype == torch.float32
    assert three_view_ce(*h[3:], y).dtype == torch.float32


def test_the_losses_name_their_softmax_dimension():
    """No deprecated implicit-dimension softmax (torch warns and may pick another axis for other ranks)."""
    z, z1, z2, l0, l1, l2, y = data(seed=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        js_loss(l0, l1, l2)
        fedccrl_loss(l0, l1, l2, z, z1, z2, y)
