"""Alg. 2 (CCDT) and the core of Alg. 3 (AugMix's draws, op parameters and mixing) against float64 loops written
from the algorithms: the tests that kill `make mutation`'s mutants of fedccrl_core/augment/ccdt.py and of the
Alg. 3 functions of fedccrl_core/augment/augmix.py and augmix_ops.py that tests/test_augment.py leaves alive.

The samplers are checked draw for draw: the same seeded generator feeds a float64 loop of Marsaglia-Tsang
(2000) written from the module's description, so the loop sees the very normals and uniforms the sampler saw."""

from __future__ import annotations

import importlib
import math
import warnings

import numpy as np
import pytest
import torch

from fedccrl_core.augment.augmix import AugMixPlan, _augmix_with, augmix, op_magnitude, sample_augmix_plan
from fedccrl_core.augment.augmix_ops import BRIGHTNESS, IDENTITY, OPS, _apply_step
from fedccrl_core.augment.ccdt import (
    ccdt,
    mixstyle,
    pool_rows,
    sample_beta,
    sample_dirichlet,
    sample_gamma,
    sample_log_gamma,
)

ccdt_module = importlib.import_module("fedccrl_core.augment.ccdt")  # the package exports a function of that name
PROPOSALS = 8  # proposals per Gamma variate (module docstring)
EPS = 1e-6


def log_gamma_loop(a: float, n: int, seed: int, proposals: int = PROPOSALS) -> list[float]:
    """log Gamma(a, 1) by Marsaglia-Tsang, variate by variate in float64, from a generator seeded like the sampler's:
    z [8, n] normals, then u [8, n] uniforms, then (a < 1) n uniforms for the boost G(a) = G(a + 1) U^(1/a)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn((proposals, n), generator=g, dtype=torch.float64).numpy()
    u = torch.rand((proposals, n), generator=g, dtype=torch.float64).numpy()
    shape = a + 1.0 if a < 1.0 else a
    d = shape - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    out = []
    for j in range(n):
        value = math.log(d)  # no proposal accepted: log d
        for i in range(proposals):
            t = 1.0 + c * z[i, j]
            if t <= 0:
                continue
            v = t**3
            if math.log(u[i, j]) < 0.5 * z[i, j] ** 2 + d - d * v + d * math.log(v):
                value = math.log(d * v)
                break
        out.append(value)
    if a < 1.0:
        ub = torch.rand((n,), generator=g, dtype=torch.float64).numpy()
        out = [lg + math.log(max(ub[j], np.finfo(np.float64).tiny)) / a for j, lg in enumerate(out)]
    return out


@pytest.mark.parametrize("a", [0.1, 0.5, 1.0, 2.5, 7.0])
def test_log_gamma_is_marsaglia_tsang_draw_for_draw(a):
    got = sample_log_gamma(a, (300,), generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    assert got.shape == (300,) and got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), log_gamma_loop(a, 300, 11), rtol=1e-12, atol=1e-12)


def test_log_gamma_keeps_the_shape_and_float32_by_default():
    got = sample_log_gamma(2.0, (2, 3), generator=torch.Generator().manual_seed(0))
    assert got.shape == (2, 3) and got.dtype == torch.float32
    gamma = sample_gamma(2.0, (2, 3), generator=torch.Generator().manual_seed(0))
    np.testing.assert_allclose(gamma.numpy(), got.exp().numpy(), rtol=1e-6)


@pytest.mark.parametrize("a", [0.3, 1.0, 1.5])
def test_log_gamma_without_an_accepted_proposal_is_log_d(a, monkeypatch):
    """With one proposal per variate, about 1 in 20 is rejected: that variate is log d, d = a - 1/3 (a + 2/3
    under the boost, before it)."""
    monkeypatch.setattr(ccdt_module, "_MT_PROPOSALS", 1)
    got = sample_log_gamma(a, (400,), generator=torch.Generator().manual_seed(0), dtype=torch.float64).numpy()
    want = log_gamma_loop(a, 400, 0, proposals=1)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    if a >= 1.0:
        assert (np.asarray(want) == math.log(a - 1.0 / 3.0)).sum() > 0  # the rejected branch was taken


@pytest.mark.parametrize("a", [0.0, -1.0, float("nan")])
def test_log_gamma_refuses_a_nonpositive_concentration(a):
    with pytest.raises(ValueError, match="Gamma concentration must be > 0"):
        sample_log_gamma(a, (2,))


@pytest.mark.parametrize(("a", "b"), [(0.1, 0.1), (2.0, 0.5)])
def test_beta_is_x_over_x_plus_y_of_the_two_gamma_draws(a, b):
    got = sample_beta(a, b, (50,), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    # the same generator: first the 50 Gamma(a) variates, then the 50 Gamma(b) ones
    g = torch.Generator().manual_seed(3)
    lx = sample_log_gamma(a, (50,), generator=g, dtype=torch.float64).numpy()
    ly = sample_log_gamma(b, (50,), generator=g, dtype=torch.float64).numpy()
    want = np.exp(lx) / (np.exp(lx) + np.exp(ly))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-9, atol=1e-300)
    assert got.dtype == torch.float64


def test_dirichlet_is_normalized_gammas_over_the_active_entries():
    active = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    got = sample_dirichlet(0.7, (3, 3), active, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    lg = sample_log_gamma(0.7, (3, 3), generator=torch.Generator().manual_seed(5), dtype=torch.float64).numpy()
    for r in range(3):
        gam = [math.exp(lg[r, k]) if active[r, k] else 0.0 for k in range(3)]
        np.testing.assert_allclose(got[r].numpy(), np.array(gam) / sum(gam), rtol=1e-9)
    free = sample_dirichlet(0.7, (3, 3), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    np.testing.assert_allclose(free.numpy(), np.exp(lg) / np.exp(lg).sum(1, keepdims=True), rtol=1e-9)


def mixstyle_loop(x, mu_p, sigma_p, lam, unbiased=False, own=False):
    """Alg. 2 lines 4 and 7-9 (scale by the mixed std, shift by the mixed mean), sample by sample in float64."""
    b, c, h, w = x.shape
    out = np.zeros_like(x, dtype=np.float64)
    for i in range(b):
        for k in range(c):
            v = x[i, k].astype(np.float64)
            mu = v.mean()
            sigma = math.sqrt(((v - mu) ** 2).sum() / (h * w - (1 if unbiased else 0)) + EPS)  # Eq. 6-7
            wp, wo = (1 - lam[i], lam[i]) if own else (lam[i], 1 - lam[i])
            mu_mix = wp * mu_p[i, k] + wo * mu
            sigma_mix = wp * sigma_p[i, k] + wo * sigma
            out[i, k] = sigma_mix * (v - mu) / sigma + mu_mix
    return out


@pytest.mark.parametrize(("unbiased", "lam_weighs"), [(False, "pool"), (True, "pool"), (False, "own"), (True, "own")])
def test_mixstyle_equals_alg2_loop(unbiased, lam_weighs):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 4, 3, generator=g, dtype=torch.float64)
    mu_p = torch.randn(3, 2, generator=g, dtype=torch.float64)
    sigma_p = torch.rand(3, 2, generator=g, dtype=torch.float64) + 0.5
    lam = torch.tensor([0.2, 0.9, 0.5], dtype=torch.float64)
    got = mixstyle(x, mu_p, sigma_p, lam, unbiased=unbiased, lam_weighs=lam_weighs)
    want = mixstyle_loop(x.numpy(), mu_p.numpy(), sigma_p.numpy(), lam.numpy(), unbiased, lam_weighs == "own")
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12)


def test_mixstyle_refuses_an_unknown_lambda_side():
    x = torch.zeros(1, 1, 2, 2)
    with pytest.raises(ValueError, match="lam_weighs must be 'pool' or 'own', got 'both'"):
        mixstyle(x, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1), lam_weighs="both")


@pytest.mark.parametrize(("pool_draw", "n_pool"), [("with_replacement", 5), ("reference", 5), ("reference", 2)])
def test_ccdt_is_alg2_with_its_draws(pool_draw, n_pool):
    """Line 5's rows (uniform with replacement, or the reference's distinct rows when the pool holds a batch),
    then line 6's lambda ~ Beta(alpha, alpha), from one generator in that order; then lines 7-9."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 3, 4, generator=g)
    pool_mu = torch.randn(n_pool, 2, 1, 1, generator=g)
    pool_sigma = torch.rand(n_pool, 2, generator=g) + 0.5
    got = ccdt(x, pool_mu, pool_sigma, alpha=3.0, generator=torch.Generator().manual_seed(7), pool_draw=pool_draw)
    d = torch.Generator().manual_seed(7)
    if pool_draw == "reference" and n_pool >= 3:
        idx = torch.randperm(n_pool, generator=d)[:3]
    else:
        idx = torch.randint(n_pool, (3,), generator=d)
    lam = sample_beta(3.0, 3.0, (3,), generator=d)  # lambda away from 0 and 1: both styles show
    mu_p, sigma_p = pool_mu.reshape(n_pool, 2)[idx].numpy(), pool_sigma[idx].numpy()
    want = mixstyle_loop(x.numpy(), mu_p, sigma_p, lam.double().numpy())
    assert got.dtype == x.dtype and got.shape == x.shape
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)


def test_ccdt_uses_the_unbiased_variance_and_eps_it_is_given():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 1, 2, 2, generator=g, dtype=torch.float64)
    pool_mu, pool_sigma = torch.full((1, 1), 3.0, dtype=torch.float64), torch.full((1, 1), 2.0, dtype=torch.float64)
    got = ccdt(x, pool_mu, pool_sigma, alpha=4.0, generator=torch.Generator().manual_seed(0), unbiased=True, eps=0.5)
    d = torch.Generator().manual_seed(0)
    torch.randint(1, (2,), generator=d)
    lam = sample_beta(4.0, 4.0, (2,), generator=d).double().numpy()
    assert ((lam > 0.1) & (lam < 0.9)).all()
    v = x.numpy()
    for i in range(2):
        mu = v[i, 0].mean()
        sigma = math.sqrt(((v[i, 0] - mu) ** 2).sum() / 3 + 0.5)  # HW - 1 = 3, eps = 0.5
        want = (lam[i] * 2.0 + (1 - lam[i]) * sigma) * (v[i, 0] - mu) / sigma + lam[i] * 3.0 + (1 - lam[i]) * mu
        np.testing.assert_allclose(got[i, 0].numpy(), want, rtol=1e-6, atol=1e-7)


def test_ccdt_default_alpha_is_0_1():
    x = torch.randn(64, 1, 2, 2, generator=torch.Generator().manual_seed(3))
    pool_mu, pool_sigma = torch.randn(5, 1), torch.rand(5, 1) + 0.5
    default = ccdt(x, pool_mu, pool_sigma, generator=torch.Generator().manual_seed(1))
    np.testing.assert_array_equal(
        default.numpy(), ccdt(x, pool_mu, pool_sigma, 0.1, torch.Generator().manual_seed(1)).numpy()
    )
    assert not torch.equal(default, ccdt(x, pool_mu, pool_sigma, 0.2, torch.Generator().manual_seed(1)))


def test_mixstyle_returns_the_dtype_of_x():
    """Pool rows and lambda in float64, x in float32: every term is cast to x's dtype, so the result is float32."""
    x = torch.randn(2, 2, 3, 3, generator=torch.Generator().manual_seed(0))
    mu_p, sigma_p = torch.zeros(2, 2, dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64)
    lam = torch.tensor([0.3, 0.6], dtype=torch.float64)
    assert mixstyle(x, mu_p, sigma_p, lam).dtype == torch.float32
    assert mixstyle(x, mu_p.float(), sigma_p, lam.float()).dtype == torch.float32
    assert mixstyle(x, mu_p.float(), sigma_p.float(), lam).dtype == torch.float32
    assert mixstyle(x, mu_p, sigma_p.float(), lam.float()).dtype == torch.float32


def test_dirichlet_normalizes_the_last_dimension_of_any_shape():
    w = sample_dirichlet(0.5, (2, 3, 4), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    np.testing.assert_allclose(w.sum(-1).numpy(), np.ones((2, 3)), rtol=1e-12)


def test_ccdt_refusals_name_the_shapes():
    x = torch.zeros(2, 3, 4, 4)
    with pytest.raises(ValueError, match=r"ccdt expects a \[B, C, H, W\] batch, got shape \(3, 4, 4\)"):
        ccdt(x[0], torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"non-empty with matching rows, got mu \(0, 3\) and sigma \(0, 3\)"):
        ccdt(x, torch.zeros(0, 3), torch.ones(0, 3))
    with pytest.raises(ValueError, match=r"got mu \(2, 3\) and sigma \(3, 3\)"):
        ccdt(x, torch.zeros(2, 3), torch.ones(3, 3))
    with pytest.raises(ValueError, match="pool has 2 channels, batch has 3"):
        ccdt(x, torch.zeros(2, 2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="pool has 3 channels, batch has 3"):
        ccdt(x, torch.zeros(2, 3), torch.ones(2, 2))


def test_pool_rows_draws():
    """with_replacement: randint; reference: a permutation's first rows when the pool holds the batch (equal sizes
    included), randint otherwise; anything else refused."""
    for n_pool, batch in ((6, 4), (4, 4)):
        rows = pool_rows(n_pool, batch, "reference", torch.Generator().manual_seed(0))
        assert rows.tolist() == torch.randperm(n_pool, generator=torch.Generator().manual_seed(0))[:batch].tolist()
    rows = pool_rows(3, 5, "reference", torch.Generator().manual_seed(0))
    assert rows.tolist() == torch.randint(3, (5,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = pool_rows(6, 4, generator=torch.Generator().manual_seed(0))
    assert rows.tolist() == torch.randint(6, (4,), generator=torch.Generator().manual_seed(0)).tolist()
    with pytest.raises(ValueError, match="pool_draw must be 'with_replacement' or 'reference', got 'unique'"):
        pool_rows(6, 4, "unique")


# ---------------------------------------------------------------------------------------------
# Alg. 3
# ---------------------------------------------------------------------------------------------
def magnitude_loop(op: int, u: float, sign: float, h: int, w: int) -> float:
    """The AugMix reference's parameter of each op at level u (module docstring), for one application."""
    name = OPS[op] if op >= 0 else "identity"
    return {
        "autocontrast": 0.0,
        "equalize": 0.0,
        "posterize": 4 - int(u * 4 / 10),
        "rotate": sign * int(u * 30 / 10),
        "solarize": 256 - int(u * 256 / 10),
        "shear_x": sign * u * 0.3 / 10,
        "shear_y": sign * u * 0.3 / 10,
        "translate_x": sign * int(u * (w / 3) / 10),
        "translate_y": sign * int(u * (h / 3) / 10),
        "identity": 0.0,
    }[name]


def test_op_magnitude_equals_the_reference_parameters():
    ops = torch.tensor([*range(len(OPS)), IDENTITY] * 3)
    levels = torch.tensor([0.1, 2.95, 9.99, 5.5] * 7 + [3.3, 7.7], dtype=torch.float64)
    signs = torch.tensor([1.0, -1.0] * 15, dtype=torch.float64)
    got = op_magnitude(ops, levels, signs, 40, 31)
    want = [magnitude_loop(int(o), float(u), float(s), 40, 31) for o, u, s in zip(ops, levels, signs)]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-9, atol=1e-12)


def test_plan_draws_in_alg3_order_and_ranges():
    """k ~ U{1,2,3} (line 4), depth ~ U{1,2,3}, ops ~ U(O) (line 7), levels ~ U[0.1, severity], signs, then the
    Dirichlet weights over the k used chains (line 5) and m ~ Beta (line 12), all from one generator."""
    b, h, w, beta, severity = 64, 20, 30, 0.6, 4
    plan = sample_augmix_plan(b, h, w, beta, severity, torch.Generator().manual_seed(9))
    g = torch.Generator().manual_seed(9)
    k = torch.randint(1, 4, (b,), generator=g)
    depth = torch.randint(1, 4, (3, b), generator=g)
    op = torch.randint(0, len(OPS), (3, b, 3), generator=g)
    level = 0.1 + (severity - 0.1) * torch.rand((3, b, 3), generator=g)
    sign = torch.where(torch.rand((3, b, 3), generator=g) < 0.5, -1.0, 1.0)
    for s in range(3):
        for j in range(b):
            for d in range(3):
                used = s < k[j] and d < depth[s, j]
                assert int(plan.op[s, j, d]) == (int(op[s, j, d]) if used else IDENTITY)
                want = magnitude_loop(int(plan.op[s, j, d]), float(level[s, j, d]), float(sign[s, j, d]), h, w)
                assert float(plan.magnitude[s, j, d]) == pytest.approx(want, rel=1e-5, abs=1e-6)
    used = torch.arange(3)[None, :] < k[:, None]
    weight = sample_dirichlet(beta, (b, 3), used, generator=g)
    m = sample_beta(beta, beta, (b,), generator=g)
    np.testing.assert_allclose(plan.weight.numpy(), weight.numpy(), rtol=1e-6)
    np.testing.assert_allclose(plan.m.numpy(), m.numpy(), rtol=1e-6)
    assert (plan.weight.numpy()[~used.numpy()] == 0).all()


@pytest.mark.parametrize("severity", [0, 11])
def test_plan_refuses_a_severity_outside_1_10(severity):
    with pytest.raises(ValueError, match=f"AugMix severity must be in \\[1, 10\\], got {severity}"):
        sample_augmix_plan(2, 8, 8, severity=severity)


@pytest.mark.parametrize("severity", [1, 10])
def test_plan_accepts_severity_1_and_10(severity):
    plan = sample_augmix_plan(4, 8, 8, severity=severity, generator=torch.Generator().manual_seed(0))
    assert plan.op.shape == (3, 4, 3)


def test_augmix_with_is_line_13_of_the_chains():
    """x_hat = m x + (1 - m) sum_i w_i chain_i(x), each chain its ops in order (op1, then op2, then op3), clamped to
    [0, 1]; chains computed one image and one op at a time with _apply_step."""
    g = torch.Generator().manual_seed(4)
    x = torch.rand(2, 3, 6, 5, generator=g)
    op = torch.tensor([[[2, 4, IDENTITY], [5, 0, 7]], [[3, IDENTITY, IDENTITY], [1, 2, 8]], [[IDENTITY] * 3] * 2])
    magnitude = torch.tensor(
        [[[3.0, 200.0, 0.0], [0.2, 0.0, 1.0]], [[-12.0, 0.0, 0.0], [0.0, 2.0, -2.0]], [[0.0] * 3] * 2]
    )
    weight = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    m = torch.tensor([0.25, 0.6])
    got = _augmix_with(x, AugMixPlan(op, magnitude, weight, m))
    for j in range(2):
        mix = np.zeros((3, 6, 5))
        for s in range(3):
            y = x[j : j + 1].clone()
            for d in range(3):
                y = _apply_step(y, op[s, j, d : d + 1], magnitude[s, j, d : d + 1])
            mix += float(weight[j, s]) * y[0].double().numpy()
        want = np.clip(float(m[j]) * x[j].double().numpy() + (1 - float(m[j])) * mix, 0.0, 1.0)
        np.testing.assert_allclose(got[j].numpy(), want, rtol=1e-5, atol=1e-6)


def test_augmix_draws_its_plan_from_the_generator():
    x = torch.rand(3, 3, 8, 7, generator=torch.Generator().manual_seed(1))
    got = augmix(x, 0.5, 2, torch.Generator().manual_seed(5))
    plan = sample_augmix_plan(3, 8, 7, 0.5, 2, torch.Generator().manual_seed(5))
    np.testing.assert_array_equal(got.numpy(), _augmix_with(x, plan).numpy())
    with pytest.raises(ValueError, match=r"augmix expects a \[B, C, H, W\] batch, got shape \(3, 8, 7\)"):
        augmix(x[0])


def test_augmix_and_plan_defaults_are_beta_1_severity_3():
    x = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    np.testing.assert_array_equal(
        augmix(x, generator=torch.Generator().manual_seed(3)).numpy(),
        augmix(x, 1.0, 3, torch.Generator().manual_seed(3)).numpy(),
    )
    a = sample_augmix_plan(6, 8, 8, generator=torch.Generator().manual_seed(4))
    b = sample_augmix_plan(6, 8, 8, 1.0, 3, torch.Generator().manual_seed(4))
    for f in ("op", "magnitude", "weight", "m"):
        np.testing.assert_array_equal(getattr(a, f).numpy(), getattr(b, f).numpy())


def levels_image(values: list[int]) -> torch.Tensor:
    """One 1 x 3 x 1 x len image whose every channel holds the 8-bit levels `values` (as k / 255)."""
    return (torch.tensor(values, dtype=torch.float32) / 255.0).expand(1, 3, 1, len(values)).clone()


def test_solarize_inverts_the_levels_at_or_above_the_threshold():
    ks = [0, 1, 127, 128, 129, 200, 255]
    out = _apply_step(levels_image(ks), torch.tensor([OPS.index("solarize")]), torch.tensor([128.0]))
    want = [(255 - k if k >= 128 else k) / 255.0 for k in ks]
    np.testing.assert_allclose(out[0, 0, 0].numpy(), want, rtol=1e-6, atol=1e-7)


def test_lut_ops_quantize_values_outside_0_1_to_the_8_bit_range():
    """8 bits kept (the identity table): the result is the 8-bit image, 0 below 0 and 1 above 1."""
    y = torch.tensor([-0.3, 0.0, 0.5, 1.0, 1.4]).expand(1, 3, 1, 5).clone()
    out = _apply_step(y, torch.tensor([OPS.index("posterize")]), torch.tensor([8.0]))
    np.testing.assert_allclose(out[0, 1, 0].numpy(), [0.0, 0.0, 128 / 255, 1.0, 1.0], rtol=1e-6, atol=1e-7)


def test_one_step_keeps_a_float64_image_float64():
    y = torch.rand(2, 3, 6, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ops = torch.tensor([OPS.index("posterize"), OPS.index("rotate")])
    out = _apply_step(y.clone(), ops, torch.tensor([3.0, 20.0]))
    assert out.dtype == torch.float64
    ref = _apply_step(y.float().clone(), ops, torch.tensor([3.0, 20.0]))
    np.testing.assert_allclose(out.numpy(), ref.double().numpy(), atol=1e-5)


def test_the_affine_ops_name_their_grid_convention():
    """No deprecated default of grid_sample (align_corners given): torch warns when it is left out."""
    y = torch.rand(2, 3, 6, 6, generator=torch.Generator().manual_seed(6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _apply_step(y, torch.tensor([OPS.index("rotate"), OPS.index("shear_x")]), torch.tensor([10.0, 0.2]))


def test_a_brightness_step_scales_by_1_plus_its_magnitude():
    """The reference code's color ops (all_ops): brightness blends with black, f y clamped to [0, 1]."""
    y = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(7))
    op = torch.tensor([BRIGHTNESS, BRIGHTNESS])
    out = _apply_step(y.clone(), op, torch.tensor([0.5, -0.25]), all_ops=True)
    want = np.stack([np.clip(1.5 * y[0].numpy(), 0, 1), np.clip(0.75 * y[1].numpy(), 0, 1)])
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6, atol=1e-7)


def test_augmix_with_passes_all_ops_to_every_step_and_clamps_and_keeps_the_dtype():
    """Line 13 for a plan of one brightness chain (all_ops), m = 0.5: 0.5 x + 0.5 clamp(1.5 x), then [0, 1];
    an input outside [0, 1] (MixStyle's output can be) is clamped; a float64 input stays float64."""
    x = torch.tensor([-0.4, 0.2, 0.6, 1.3], dtype=torch.float64).expand(1, 3, 3, 4).clone()  # 3 x 3 at least: sharpness
    op = torch.full((3, 1, 3), IDENTITY)
    op[0, 0, 0] = BRIGHTNESS
    magnitude = torch.zeros(3, 1, 3)
    magnitude[0, 0, 0] = 0.5
    plan = AugMixPlan(op, magnitude, torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([0.5]))
    out = _augmix_with(x, plan, all_ops=True)
    assert out.dtype == torch.float64
    v = x[0, 0, 0].numpy()
    want = np.clip(0.5 * v + 0.5 * np.clip(1.5 * v, 0, 1), 0, 1)
    np.testing.assert_allclose(out[0, 0, 0].numpy(), want, rtol=1e-6, atol=1e-7)
    plain = _augmix_with(x, AugMixPlan(torch.full((3, 1, 3), IDENTITY), torch.zeros(3, 1, 3), plan.weight, plan.m))
    np.testing.assert_allclose(plain[0, 0, 0].numpy(), np.clip(v, 0, 1), rtol=1e-6, atol=1e-7)
