"""CCDT / MixStyle from the pool (Alg. 2), per-sample AugMix (Alg. 3), M = AugMix ∘ MixStyle (Eq. 3)
and the generator-friendly samplers, each pinned to hand or reference computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image, ImageOps

from fedccrl_core.augment.augmix import _augmix_with, augmix, op_magnitude, sample_augmix_plan
from fedccrl_core.augment.augmix_ops import IDENTITY, OPS, apply_op
from fedccrl_core.augment.ccdt import ccdt, mixstyle, sample_beta, sample_dirichlet, sample_gamma
from fedccrl_core.augment.compose import fedccrl_augment
from fedccrl_core.augment.settings import AugmentParams
from fedccrl_core.learning.statistics import IMAGENET_MEAN, IMAGENET_STD, channel_stats


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def to_tensor(img_u8: np.ndarray) -> torch.Tensor:
    """HWC uint8 -> [1, C, H, W] float in [0, 1]."""
    return torch.from_numpy(img_u8).permute(2, 0, 1)[None].float() / 255.0


def to_u8_float(x: torch.Tensor) -> np.ndarray:
    """[1, C, H, W] in [0, 1] -> HWC float on the 0..255 scale (not rounded)."""
    return x[0].permute(1, 2, 0).numpy().astype(np.float64) * 255.0


def random_image(h=40, w=48, low=0, high=256, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(low, high, (h, w, 3), dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# Samplers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("a,b", [(0.1, 0.1), (1.0, 1.0), (2.0, 5.0), (0.5, 3.0)])
def test_beta_sampler_matches_closed_form_moments(a, b):
    n = 200_000
    s = sample_beta(a, b, (n,), generator=gen(1)).double()
    mean = a / (a + b)
    var = a * b / ((a + b) ** 2 * (a + b + 1))
    assert torch.all((s >= 0) & (s <= 1)) and not torch.isnan(s).any()
    assert abs(s.mean().item() - mean) < 5 * math.sqrt(var / n)
    # the standard error of a sample variance is below sqrt(E[(x-mu)^4] / n) <= sqrt(var / n)
    assert abs(s.var().item() - var) < 5 * math.sqrt(var / n)


@pytest.mark.parametrize("a", [0.1, 1.0, 3.5])
def test_gamma_sampler_mean_and_variance_equal_shape(a):
    n = 200_000
    s = sample_gamma(a, (n,), generator=gen(2)).double()
    assert abs(s.mean().item() - a) < 5 * math.sqrt(a / n)
    assert abs(s.var().item() - a) / a < 0.05


def test_dirichlet_over_active_entries():
    active = torch.tensor([[True, False, False], [True, True, False], [True, True, True]])
    w = sample_dirichlet(1.0, (60_000, 3), active.repeat(20_000, 1), generator=gen(3))
    assert torch.allclose(w.sum(1), torch.ones(60_000))
    assert torch.all(w[~active.repeat(20_000, 1)] == 0)
    means = w.view(20_000, 3, 3).mean(0)
    expected = torch.tensor([[1, 0, 0], [1 / 2, 1 / 2, 0], [1 / 3, 1 / 3, 1 / 3]])
    assert torch.allclose(means, expected, atol=0.01)


def test_samplers_reproducible_with_a_seeded_generator():
    first = sample_beta(0.1, 0.1, (64,), generator=gen(7))
    assert torch.equal(first, sample_beta(0.1, 0.1, (64,), generator=gen(7)))
    assert not torch.equal(first, sample_beta(0.1, 0.1, (64,), generator=gen(8)))


# ---------------------------------------------------------------------------------------------
# CCDT / MixStyle from the pool (Alg. 2)
# ---------------------------------------------------------------------------------------------
def ccdt_numpy(x, mu_p, sigma_p, lam, eps):
    """Alg. 2 with the MixStyle reading, one sample and one channel at a time."""
    out = np.empty_like(x)
    for b in range(x.shape[0]):
        for c in range(x.shape[1]):
            v = x[b, c]
            mu = v.sum() / v.size  # Eq. 6
            sigma = math.sqrt(((v - mu) ** 2).sum() / v.size + eps)  # Eq. 7
            mu_mix = lam[b] * mu_p[b, c] + (1 - lam[b]) * mu
            sigma_mix = lam[b] * sigma_p[b, c] + (1 - lam[b]) * sigma
            out[b, c] = sigma_mix * (v - mu) / sigma + mu_mix
    return out


def testmixstyle_matches_numpy_on_2x3x4x4():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 4, 4))
    mu_p = rng.normal(size=(2, 3))
    sigma_p = rng.uniform(0.5, 2.0, size=(2, 3))
    lam = np.array([0.3, 0.85])
    got = mixstyle(*(torch.from_numpy(a) for a in (x, mu_p, sigma_p, lam)), eps=1e-6)
    np.testing.assert_allclose(got.numpy(), ccdt_numpy(x, mu_p, sigma_p, lam, 1e-6), rtol=1e-10, atol=1e-10)


def test_ccdt_output_has_the_mixed_statistics():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16) * 1.7 + 0.4
    mu_p, sigma_p = torch.randn(2, 3), torch.rand(2, 3) + 0.5
    lam = torch.tensor([0.25, 0.9])
    mu, sigma = channel_stats(x)
    out_mu, out_sigma = channel_stats(mixstyle(x, mu_p, sigma_p, lam))
    assert torch.allclose(out_mu, lam[:, None] * mu_p + (1 - lam[:, None]) * mu, atol=1e-5)
    assert torch.allclose(out_sigma, lam[:, None] * sigma_p + (1 - lam[:, None]) * sigma, atol=1e-5)


def test_ccdt_scales_by_std_and_shifts_by_mean_not_as_printed():
    """With lambda = 1 the sample takes the pool row's style exactly: mean mu', std sigma'. The
    printed Alg. 2 (gamma from means as the scale) would give std |mu'| and mean sigma'."""
    torch.manual_seed(1)
    x = torch.randn(1, 3, 8, 8)
    mu_p, sigma_p = torch.tensor([[-1.2, 0.3, 0.8]]), torch.tensor([[0.4, 1.5, 0.9]])
    out_mu, out_sigma = channel_stats(mixstyle(x, mu_p, sigma_p, torch.ones(1)))
    assert torch.allclose(out_mu, mu_p, atol=1e-5) and torch.allclose(out_sigma, sigma_p, atol=1e-5)
    assert torch.allclose(mixstyle(x, mu_p, sigma_p, torch.zeros(1)), x, atol=1e-5)  # lambda = 0


def test_ccdt_draws_differ_per_sample_and_are_reproducible():
    torch.manual_seed(2)
    x = torch.randn(1, 3, 8, 8).repeat(16, 1, 1, 1)  # 16 identical samples
    pool_mu, pool_sigma = torch.randn(50, 3), torch.rand(50, 3) + 0.3
    # alpha = 1 here: with alpha = 0.1 many lambdas are ~0 in float32, leaving samples unchanged
    out = ccdt(x, pool_mu, pool_sigma, alpha=1.0, generator=gen(5))
    flat = out.flatten(1)
    assert (torch.cdist(flat, flat) + torch.eye(16)).min() > 1e-4  # every pair differs
    assert torch.equal(out, ccdt(x, pool_mu, pool_sigma, alpha=1.0, generator=gen(5)))
    assert not torch.equal(out, ccdt(x, pool_mu, pool_sigma, alpha=1.0, generator=gen(6)))


def test_ccdt_output_styles_lie_between_own_and_a_pool_row():
    """Every output mean is lambda mu' + (1 - lambda) mu(x) for some pool row and one lambda in
    [0, 1] shared by its channels and its std."""
    torch.manual_seed(3)
    x = torch.randn(8, 3, 8, 8)
    pool_mu, pool_sigma = torch.randn(5, 3) * 2, torch.rand(5, 3) + 0.5
    mu, sigma = channel_stats(x)
    out_mu, out_sigma = channel_stats(ccdt(x, pool_mu, pool_sigma, alpha=0.5, generator=gen(9)))
    for b in range(8):
        fits = []
        for p in range(5):
            lam = ((out_mu[b] - mu[b]) / (pool_mu[p] - mu[b]))[0]
            pred_mu = lam * pool_mu[p] + (1 - lam) * mu[b]
            pred_sigma = lam * pool_sigma[p] + (1 - lam) * sigma[b]
            fits.append(
                -1e-4 <= lam <= 1 + 1e-4
                and torch.allclose(pred_mu, out_mu[b], atol=1e-4)
                and torch.allclose(pred_sigma, out_sigma[b], atol=1e-4)
            )
        assert any(fits)


def test_ccdt_commutes_with_the_channel_normalization():
    torch.manual_seed(4)
    pixels = torch.rand(4, 3, 8, 8)
    m = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    s = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    mu_p_pix, sigma_p_pix, lam = torch.rand(4, 3), torch.rand(4, 3) * 0.3 + 0.05, torch.rand(4)
    in_pixels = mixstyle(pixels, mu_p_pix, sigma_p_pix, lam, eps=0.0)
    in_normalized = mixstyle(
        (pixels - m) / s, (mu_p_pix - m.view(1, 3)) / s.view(1, 3), sigma_p_pix / s.view(1, 3), lam, eps=0.0
    )
    assert torch.allclose(in_normalized * s + m, in_pixels, atol=1e-5)


def test_ccdt_rejects_an_empty_pool():
    with pytest.raises(ValueError, match="non-empty"):
        ccdt(torch.randn(2, 3, 4, 4), torch.empty(0, 3), torch.empty(0, 3))


# ---------------------------------------------------------------------------------------------
# AugMix ops against PIL / torchvision
# ---------------------------------------------------------------------------------------------
def test_op_set_is_the_augmix_base_set():
    assert set(OPS) == {
        "autocontrast",
        "equalize",
        "posterize",
        "rotate",
        "solarize",
        "shear_x",
        "shear_y",
        "translate_x",
        "translate_y",
    }


@pytest.mark.parametrize(
    "name,magnitude,reference",
    [
        ("autocontrast", 0, lambda im: ImageOps.autocontrast(im)),
        ("equalize", 0, lambda im: ImageOps.equalize(im)),
        ("posterize", 4, lambda im: ImageOps.posterize(im, 4)),
        ("posterize", 3, lambda im: ImageOps.posterize(im, 3)),
        ("solarize", 180, lambda im: ImageOps.solarize(im, 180)),
        ("solarize", 254, lambda im: ImageOps.solarize(im, 254)),
    ],
)
def test_pixel_ops_equal_pil_imageops(name, magnitude, reference):
    img = random_image(low=40, high=181, seed=11)  # narrow range: autocontrast/equalize do work
    img[:5] = img[:5] // 2  # skew the histogram
    got = to_u8_float(apply_op(to_tensor(img), name, magnitude))
    want = np.asarray(reference(Image.fromarray(img))).astype(np.float64)
    assert np.abs(got - want).max() <= 1.0 + 1e-4
    assert np.mean(np.abs(got - want) > 1e-3) < 0.01  # nearly all pixels exactly equal


def test_pixel_ops_on_flat_channels_are_identity_like_pil():
    img = np.full((8, 8, 3), 77, dtype=np.uint8)
    for name in ("autocontrast", "equalize"):
        assert np.allclose(to_u8_float(apply_op(to_tensor(img), name)), 77.0, atol=1e-3)


@pytest.mark.parametrize(
    "name,magnitude,data",
    [
        ("shear_x", 0.09, (1, 0.09, 0, 0, 1, 0)),
        ("shear_x", -0.05, (1, -0.05, 0, 0, 1, 0)),
        ("shear_y", 0.07, (1, 0, 0, 0.07, 1, 0)),
        ("translate_x", 5, (1, 0, 5, 0, 1, 0)),
        ("translate_y", -3, (1, 0, 0, 0, 1, -3)),
    ],
)
def test_affine_ops_equal_pil_transform_on_the_interior(name, magnitude, data):
    """AugMix's reference: pil_img.transform(size, Image.AFFINE, data, resample=BILINEAR).
    Borders differ (grid_sample blends the last pixel with the 0 fill, PIL does not)."""
    img = random_image(seed=12)
    h, w = img.shape[:2]
    got = to_u8_float(apply_op(to_tensor(img), name, magnitude))
    want = np.asarray(Image.fromarray(img).transform((w, h), Image.AFFINE, data, resample=Image.BILINEAR))
    assert np.abs(got - want)[5:-5, 5:-5].max() <= 1.5  # PIL rounds its bilinear result to uint8


@pytest.mark.parametrize("degrees", [9, -7, 30])
def test_rotate_equals_torchvision_and_pil_rotate(degrees):
    img = random_image(seed=13)
    got = to_u8_float(apply_op(to_tensor(img), "rotate", degrees))
    bilinear = TF.InterpolationMode.BILINEAR
    tv = TF.rotate(torch.from_numpy(img).permute(2, 0, 1), float(degrees), interpolation=bilinear)
    assert np.abs(got - tv.permute(1, 2, 0).numpy()).max() <= 0.5 + 1e-3  # torchvision rounds to uint8
    pil = np.asarray(Image.fromarray(img).rotate(degrees, resample=Image.BILINEAR))
    assert np.abs(got - pil)[8:-8, 8:-8].max() <= 1.0 + 1e-4


def test_one_step_routes_each_sample_to_its_own_op():
    """A batch with a different op per sample equals the ops applied one image at a time."""
    from fedccrl_core.augment.augmix_ops import _apply_step

    x = torch.cat([to_tensor(random_image(low=30, high=200, seed=20 + i)) for i in range(10)])
    op = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, IDENTITY])
    mag = torch.tensor([0, 0, 3, -9, 200, 0.06, -0.08, 7, -4, 0], dtype=torch.float32)
    got = _apply_step(x.clone(), op, mag, compact=False)  # the accelerator path (torch.where)
    for i in range(9):
        assert torch.allclose(got[i : i + 1], apply_op(x[i : i + 1], OPS[i], mag[i]), atol=1e-6)
    assert torch.equal(got[9], x[9])
    assert torch.allclose(_apply_step(x.clone(), op, mag, compact=True), got, atol=1e-6)  # CPU path


def test_affine_grid_equals_torch_affine_grid():
    from fedccrl_core.augment.augmix_ops import _affine_grid

    theta = torch.randn(4, 2, 3)
    want = torch.nn.functional.affine_grid(theta, [4, 3, 10, 14], align_corners=False)
    assert torch.allclose(_affine_grid(theta, 10, 14), want, atol=1e-6)


def test_magnitudes_follow_the_augmix_reference_conventions():
    """int_parameter(u, M) = int(u M / 10), float_parameter(u, M) = u M / 10 (augmentations.py)."""
    op = torch.arange(9).repeat(2)
    level = torch.tensor([3.0] * 9 + [0.1] * 9)
    sign = torch.tensor([-1.0] * 9 + [1.0] * 9)
    got = op_magnitude(op, level, sign, height=224, width=224)
    #                     autoc eq  post rot   sol    shx    shy    trx    try
    want_hi = torch.tensor([0, 0, 3, -9, 180, -0.09, -0.09, -22, -22])
    want_lo = torch.tensor([0, 0, 4, 0, 254, 0.003, 0.003, 0, 0])
    assert torch.allclose(got, torch.cat([want_hi, want_lo]), atol=1e-6)
    unused = op_magnitude(torch.tensor([IDENTITY]), torch.tensor([3.0]), torch.tensor([1.0]), 32, 32)
    assert unused.item() == 0


# ---------------------------------------------------------------------------------------------
# AugMix (Alg. 3), per sample
# ---------------------------------------------------------------------------------------------
def test_plan_structure_follows_algorithm_3():
    plan = sample_augmix_plan(4000, 224, 224, beta=1.0, severity=3, generator=gen(30))
    used = plan.op != IDENTITY  # [S, B, D]
    slot_used = used[:, :, 0]
    k = slot_used.sum(0)
    depth = used.sum(2)
    assert set(k.tolist()) == {1, 2, 3}
    assert torch.equal(slot_used, torch.arange(3)[:, None] < k[None, :])  # slots 1..k
    assert torch.equal(used, torch.arange(3)[None, None, :] < depth[:, :, None])  # op1, op12, op123
    assert set(depth[slot_used].tolist()) == {1, 2, 3}
    counts = torch.bincount(k, minlength=4)[1:].float() / 4000  # k ~ U{1, 2, 3}
    assert torch.allclose(counts, torch.full((3,), 1 / 3), atol=0.04)
    assert torch.equal(plan.weight > 0, slot_used.T)
    assert torch.allclose(plan.weight.sum(1), torch.ones(4000))
    assert torch.all((plan.m >= 0) & (plan.m <= 1))
    assert set(plan.op[used].tolist()) == set(range(9))
    rot = plan.magnitude[plan.op == OPS.index("rotate")]
    assert rot.abs().max() <= 9 and torch.equal(rot, rot.round()) and (rot < 0).any() and (rot > 0).any()
    assert set(plan.magnitude[plan.op == OPS.index("posterize")].tolist()) == {3.0, 4.0}


def test_augmix_equals_a_per_sample_loop_over_its_draws():
    x = torch.cat([to_tensor(random_image(24, 24, seed=40 + i)) for i in range(6)])
    plan = sample_augmix_plan(6, 24, 24, beta=1.0, severity=3, generator=gen(31))
    got = _augmix_with(x, plan)
    for b in range(6):
        x_aug = torch.zeros_like(x[b : b + 1])
        for s in range(3):
            chain = x[b : b + 1]
            for d in range(3):
                if plan.op[s, b, d] != IDENTITY:
                    chain = apply_op(chain, int(plan.op[s, b, d]), plan.magnitude[s, b, d])
            x_aug += plan.weight[b, s] * chain  # line 10 (weight 0 on unused slots)
        want = plan.m[b] * x[b : b + 1] + (1 - plan.m[b]) * x_aug  # line 13
        assert torch.allclose(got[b : b + 1], want.clamp(0, 1), atol=1e-5)


def test_augmix_keeps_shape_and_range():
    x = torch.rand(5, 3, 20, 28)
    out = augmix(x, generator=gen(32))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert out.min() >= 0 and out.max() <= 1


def test_augmix_draws_are_per_sample():
    """torchvision's AugMix on a batch tensor would give identical outputs here."""
    x = to_tensor(random_image(32, 32, seed=50)).repeat(16, 1, 1, 1)
    out = augmix(x, generator=gen(33)).flatten(1)
    assert (torch.cdist(out, out) + torch.eye(16)).min() > 1e-3


def test_two_views_differ_and_a_seed_reproduces():
    x = torch.rand(4, 3, 16, 16)
    g = gen(34)
    view1, view2 = augmix(x, generator=g), augmix(x, generator=g)
    assert not torch.allclose(view1, view2)
    assert torch.equal(view1, augmix(x, generator=gen(34)))


# ---------------------------------------------------------------------------------------------
# M = AugMix ∘ MixStyle (Eq. 3)
# ---------------------------------------------------------------------------------------------
def test_fedccrl_augment_switches():
    torch.manual_seed(5)
    x = torch.randn(4, 3, 16, 16)
    pool_mu, pool_sigma = torch.randn(10, 3), torch.rand(10, 3) + 0.5
    off = AugmentParams(ccdt=False, difp=False)
    assert torch.equal(fedccrl_augment(x, None, None, off, gen(0)), x)
    ccdt_only = fedccrl_augment(x, pool_mu, pool_sigma, AugmentParams(ccdt=True, difp=False, alpha=0.3), gen(1))
    assert torch.equal(ccdt_only, ccdt(x, pool_mu, pool_sigma, 0.3, gen(1)))
    m = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    s = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    difp_only = fedccrl_augment(x, None, None, AugmentParams(ccdt=False), gen(2))
    want = (augmix((x * s + m).clamp(0, 1), 1.0, 3, gen(2)) - m) / s
    assert torch.allclose(difp_only, want, atol=1e-5)


def test_fedccrl_augment_is_augmix_after_mixstyle():
    torch.manual_seed(6)
    x = torch.randn(4, 3, 16, 16)
    pool_mu, pool_sigma = torch.randn(10, 3), torch.rand(10, 3) + 0.5
    params = AugmentParams(alpha=0.1, beta=1.0, severity=3, ccdt=True, difp=True)
    got = fedccrl_augment(x, pool_mu, pool_sigma, params, gen(3))
    g = gen(3)
    styled = ccdt(x, pool_mu, pool_sigma, 0.1, g)
    m = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    s = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    want = (augmix((styled * s + m).clamp(0, 1), 1.0, 3, g) - m) / s
    assert torch.allclose(got, want, atol=1e-5)
    pixels = got * s + m
    assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5


def test_fedccrl_augment_needs_a_pool_when_ccdt_is_on():
    with pytest.raises(ValueError, match="pool"):
        fedccrl_augment(torch.randn(2, 3, 8, 8), None, None, AugmentParams(), gen(0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (checks the device path for host syncs)")
def test_fedccrl_augment_runs_on_cuda_without_host_syncs():
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(8, 3, 32, 32, device=device)
    pool_mu, pool_sigma = torch.randn(20, 3, device=device), torch.rand(20, 3, device=device) + 0.5
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        out = fedccrl_augment(x, pool_mu, pool_sigma, AugmentParams(), g)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == x.shape and out.device.type == "cuda"


# ---------------------------------------------------------------------------------------------
# Per-sample randomness of the device-side path (the fast engine path)
# ---------------------------------------------------------------------------------------------
def test_augmix_plan_op_choice_differs_per_sample():
    """Each sample of a batch draws its own ops (torchvision's batch AugMix draws one chain per batch):
    the first op of the first chain takes every op of O across a batch, about uniformly."""
    plan = sample_augmix_plan(900, 32, 32, beta=1.0, severity=3, generator=gen(60))
    first = plan.op[0, :, 0]  # slot 0 is always used, step 0 always applied
    assert torch.all(first != IDENTITY)
    freq = torch.bincount(first, minlength=len(OPS)).float() / 900
    assert torch.allclose(freq, torch.full((len(OPS),), 1 / len(OPS)), atol=0.04)
    assert len(set(plan.weight.argmax(1).tolist())) == 3 and plan.m.std() > 0.1  # w and m per sample too


def test_fedccrl_augment_identical_inputs_give_different_outputs():
    """16 copies of one image through M (Eq. 3): every output differs from every other, and the two
    views of each sample differ."""
    img = to_tensor(random_image(24, 24, seed=61))
    x = (img - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    x = x.repeat(16, 1, 1, 1)
    pool_mu, pool_sigma = torch.randn(30, 3) * 0.5, torch.rand(30, 3) + 0.5
    g = gen(62)
    cfg = AugmentParams(alpha=1.0)  # alpha = 1: lambda rarely ~0, so CCDT changes every sample too
    x1, x2 = fedccrl_augment(x, pool_mu, pool_sigma, cfg, g), fedccrl_augment(x, pool_mu, pool_sigma, cfg, g)
    for view in (x1, x2):
        flat = view.flatten(1)
        assert (torch.cdist(flat, flat) + torch.eye(16) * 1e9).min() > 1e-3
    assert torch.all((x1 - x2).flatten(1).abs().amax(1) > 1e-3)


# ---- augmix_impl: pil (augment/augmix_pil.py): the same Alg. 3 reading, other random draws ----------------------
def _synthetic_batch(n=256, size=24):
    from fedccrl_benchmarks.speed_data import generate

    return (
        torch.from_numpy(np.concatenate([generate(n // 4, d, size, 0)[0] for d in range(4)]))
        .permute(0, 3, 1, 2)
        .float()
        / 255.0
    )


def test_pil_augmix_has_the_distribution_of_the_tensor_augmix():
    """Per image: the mean absolute change |x_hat - x| and the per-channel mean of x_hat, averaged over 2 x 256
    images, agree between the two implementations within 4 standard errors (+ the 8-bit quantization, 1/255)."""
    from fedccrl_core.augment.augmix_pil import augmix_pil

    x = _synthetic_batch()
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    t = torch.cat([augmix(x, 1.0, 3, g1) for _ in range(2)])
    p = torch.cat([augmix_pil(x, 1.0, 3, g2) for _ in range(2)])
    assert p.shape == t.shape and p.dtype == t.dtype and 0 <= p.min() and p.max() <= 1
    xx = torch.cat([x, x])
    for stat in (lambda y: (y - xx).abs().mean(dim=(1, 2, 3)), lambda y: y.mean(dim=(2, 3))):
        a, b = stat(t), stat(p)
        se = torch.sqrt(a.var(0) / len(a) + b.var(0) / len(b))
        assert torch.all((a.mean(0) - b.mean(0)).abs() < 4 * se + 1 / 255), (a.mean(0), b.mean(0), se)
    assert (t - xx).abs().mean() > 0.01 and (p - xx).abs().mean() > 0.01  # both really augment


def test_pil_augmix_is_reproducible_from_the_generator_and_per_sample():
    from fedccrl_core.augment.augmix_pil import augmix_pil

    x = _synthetic_batch(16)
    a = augmix_pil(x, 1.0, 3, torch.Generator().manual_seed(3))
    assert torch.equal(a, augmix_pil(x, 1.0, 3, torch.Generator().manual_seed(3)))
    assert not torch.equal(a, augmix_pil(x, 1.0, 3, torch.Generator().manual_seed(4)))
    same = augmix_pil(x[:1].repeat(8, 1, 1, 1), 1.0, 3, torch.Generator().manual_seed(0))
    assert len({tuple(s.flatten()[:64].tolist()) for s in same}) > 1  # own draws per sample


def test_fedccrl_augment_routes_augmix_impl_and_refuses_pil_for_the_batch_reading():
    from fedccrl_core.algorithm_params.train import LocalConfig
    from fedccrl_core.algorithms import build_algorithm

    x = torch.randn(8, 3, 16, 16)
    cfg = dict(ccdt=False, difp=True)
    outs = {
        impl: fedccrl_augment(x, None, None, AugmentParams(**cfg, augmix_impl=impl), torch.Generator().manual_seed(0))
        for impl in ("tensor", "pil")
    }
    assert outs["tensor"].shape == outs["pil"].shape and not torch.equal(outs["tensor"], outs["pil"])
    assert torch.equal(
        outs["pil"],
        fedccrl_augment(x, None, None, AugmentParams(**cfg, augmix_impl="pil"), torch.Generator().manual_seed(0)),
    )
    with pytest.raises(ValueError, match="train.fedccrl.augmix_impl pil implements augmix per_sample only"):
        build_algorithm("fedccrl", LocalConfig(), {"variant": "reference", "augmix_impl": "pil"})
    assert build_algorithm("fedccrl", LocalConfig(), {"augmix_impl": "pil"}).hp.augmix_impl == "pil"
