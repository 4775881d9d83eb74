"""Eq. 6-8 (the per-sample statistics and the upload) against float64 loops written from the paper's equations:
the tests that kill `make mutation`'s mutants of fedccrl_core/learning/statistics.py and of the Eq. 6-8 functions
of fedccrl_core/data/pools.py."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from fedccrl_core.data.pools import compute_statistics, sample_statistics, unbiased_sigma, upload_size
from fedccrl_core.foundation.errors import DataError
from fedccrl_core.learning.statistics import channel_stats, denormalize, normalize, normalize_u8, per_channel

EPS = 1e-6  # the eps of channel_stats (inside the square root, as MixStyle)


def stats_loop(x: np.ndarray, unbiased: bool = False, eps: float = EPS) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 6 and Eq. 7 (float64 loops over h, w) for x [B, C, H, W]; HW - 1 in Eq. 7 when unbiased."""
    b, c, h, w = x.shape
    mu, sigma = np.zeros((b, c)), np.zeros((b, c))
    for i in range(b):
        for k in range(c):
            m = sum(float(x[i, k, r, s]) for r in range(h) for s in range(w)) / (h * w)  # Eq. 6
            sq = sum((float(x[i, k, r, s]) - m) ** 2 for r in range(h) for s in range(w))
            mu[i, k] = m
            sigma[i, k] = math.sqrt(sq / (h * w - (1 if unbiased else 0)) + eps)  # Eq. 7
    return mu, sigma


@pytest.mark.parametrize("unbiased", [False, True])
def test_channel_stats_equal_eq6_eq7_loops(unbiased):
    x = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2 + 1
    mu, sigma = channel_stats(x, unbiased=unbiased)
    ref_mu, ref_sigma = stats_loop(x.numpy(), unbiased)
    assert mu.shape == sigma.shape == (2, 3)
    np.testing.assert_allclose(mu.numpy(), ref_mu, rtol=1e-12)
    np.testing.assert_allclose(sigma.numpy(), ref_sigma, rtol=1e-12)


def test_channel_stats_eps_is_inside_the_root():
    """A flat channel has sigma = sqrt(eps), and the eps given is the one used."""
    x = torch.full((1, 2, 3, 3), 0.7, dtype=torch.float64)
    _, sigma = channel_stats(x)
    np.testing.assert_allclose(sigma.numpy(), math.sqrt(EPS), rtol=1e-12)
    _, sigma = channel_stats(x, eps=0.25)
    np.testing.assert_allclose(sigma.numpy(), 0.5, rtol=1e-12)


def test_normalize_and_denormalize_are_the_per_channel_affine_maps():
    x = torch.rand(2, 3, 2, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mean, std = (0.1, 0.2, 0.3), (0.5, 0.25, 2.0)
    y = normalize(x, mean, std)
    for k in range(3):
        np.testing.assert_allclose(y[:, k].numpy(), (x[:, k].numpy() - mean[k]) / std[k], rtol=1e-12)
    back = denormalize(y, mean, std)
    for k in range(3):
        np.testing.assert_allclose(back[:, k].numpy(), y[:, k].numpy() * std[k] + mean[k], rtol=1e-12)
    np.testing.assert_allclose(back.numpy(), x.numpy(), rtol=1e-12, atol=1e-15)


def test_per_channel_is_a_1c11_constant_in_the_dtype_of_its_model():
    like = torch.zeros(1, dtype=torch.float64)
    t = per_channel([1, 2.5, -3], like)
    assert t.shape == (1, 3, 1, 1) and t.dtype == torch.float64
    assert t.flatten().tolist() == [1.0, 2.5, -3.0]


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_normalize_u8_is_u8_over_255_normalized_in_both_layouts(layout):
    rng = np.random.default_rng(2)
    nchw = rng.integers(0, 256, (2, 3, 4, 5), dtype=np.uint8)
    images = nchw.transpose(0, 2, 3, 1) if layout == "nhwc" else nchw
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    out = normalize_u8(torch.from_numpy(np.ascontiguousarray(images)), mean, std)
    assert out.shape == (2, 3, 4, 5) and out.dtype == torch.float32
    ref = (nchw.astype(np.float64) / 255.0 - np.array(mean)[None, :, None, None]) / np.array(std)[None, :, None, None]
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6)


def test_normalize_u8_keeps_an_nchw_batch_whose_width_is_3():
    """[N, 3, H, 3] is NCHW (channels first): only a last dim of 3 with a second dim other than 3 is NHWC."""
    nchw = np.arange(2 * 3 * 2 * 3, dtype=np.uint8).reshape(2, 3, 2, 3)
    out = normalize_u8(torch.from_numpy(nchw), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    np.testing.assert_allclose(out.numpy(), nchw / 255.0, rtol=1e-6)


def test_compute_statistics_equals_eq6_eq7_over_the_normalized_images_in_several_batches():
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (5, 4, 3, 3), dtype=np.uint8)  # NHWC, 5 images in batches of 2
    mean, std = [0.5, 0.4, 0.3], [0.2, 0.3, 0.25]
    mu, sigma = compute_statistics(images, mean, std, batch=2)
    assert mu.dtype == sigma.dtype == np.float32 and mu.shape == sigma.shape == (5, 3)
    x = (images.transpose(0, 3, 1, 2).astype(np.float64) / 255.0 - np.array(mean)[None, :, None, None]) / np.array(std)[
        None, :, None, None
    ]
    ref_mu, ref_sigma = stats_loop(x)
    np.testing.assert_allclose(mu, ref_mu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sigma, ref_sigma, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("n", "r", "k"),
    [(100, 0.07, 7), (10, 0.15, 2), (10, 0.1, 1), (3, 1.0, 3), (7, 0.5, 4), (1, 0.01, 1), (9, 1, 9)],
)
def test_upload_size_is_ceil_r_n(n, r, k):
    """Eq. 8: |F_i| = ceil(r n_i), with r n_i taken to 9 decimals (0.07 * 100 is 7, not 8)."""
    assert upload_size(n, r) == k == upload_size(n, r, "ceil")


@pytest.mark.parametrize(("n", "r", "k"), [(100, 0.29, 28), (10, 0.15, 1), (7, 0.5, 3), (4, 1.0, 4)])
def test_upload_size_floor_is_the_reference_codes_int(n, r, k):
    assert upload_size(n, r, "floor") == k


def test_upload_size_floor_refuses_zero_rows_naming_the_key():
    with pytest.raises(DataError, match=r"floor\(r \* n\) = 0 rows of a client with n = 5 \(r = 0.1\)"):
        upload_size(5, 0.1, "floor")


def test_sample_statistics_draws_ceil_r_n_distinct_paired_rows():
    n = 40
    mu = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    sigma = mu + 1000.0
    for seed in range(5):
        m, s = sample_statistics(mu, sigma, 0.3, np.random.default_rng(seed))
        assert m.shape == s.shape == (12, 3)
        rows = (m[:, 0] / 3).astype(int)
        assert len(set(rows.tolist())) == 12  # without replacement
        np.testing.assert_array_equal(m, mu[rows])
        np.testing.assert_array_equal(s, sigma[rows])  # mu and sigma of the same samples
    m, _ = sample_statistics(mu, sigma, 0.3, np.random.default_rng(0), rounding="floor")
    assert len(m) == 12
    m, _ = sample_statistics(mu[:11], sigma[:11], 0.3, np.random.default_rng(0), rounding="floor")
    assert len(m) == 3  # int(11 * 0.3); ceil would give 4
    m, _ = sample_statistics(mu, sigma, 1.0, np.random.default_rng(0))
    assert sorted((m[:, 0] / 3).astype(int).tolist()) == list(range(n))


@pytest.mark.parametrize(("mu_shape", "sigma_shape"), [((4, 3), (4, 2)), ((4, 3), (5, 3)), ((4,), (4,))])
def test_sample_statistics_refuses_unmatched_arrays(mu_shape, sigma_shape):
    with pytest.raises(DataError, match=r"must be matching \[n, C\] arrays"):
        sample_statistics(np.zeros(mu_shape), np.zeros(sigma_shape), 0.5, np.random.default_rng(0))


def test_unbiased_sigma_equals_eq7_with_hw_minus_1():
    x = np.random.default_rng(4).normal(0.2, 1.3, (3, 3, 4, 5))
    _, population = stats_loop(x)
    _, unbiased = stats_loop(x, unbiased=True)
    out = unbiased_sigma(population.astype(np.float32), 4 * 5)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, unbiased, rtol=1e-6)


def test_unbiased_sigma_of_a_flat_channel_stays_sqrt_eps():
    """sigma^2 - eps below 0 (float rounding of a flat channel) is floored at 0 before the rescale."""
    sigma = np.array([[math.sqrt(EPS) * 0.5, math.sqrt(EPS), 2.0]], dtype=np.float32)
    out = unbiased_sigma(sigma, 4)
    expected = [math.sqrt(EPS), math.sqrt(EPS), math.sqrt((4.0 - EPS) * 4 / 3 + EPS)]
    np.testing.assert_allclose(out[0], expected, rtol=1e-6)


def test_per_channel_lands_on_the_device_of_its_model():
    """The constant is moved to like's device (the meta device stands for an accelerator on a CPU-only machine)."""
    t = per_channel([1.0, 2.0, 3.0], torch.empty(1, device="meta", dtype=torch.float16))
    assert t.device.type == "meta" and t.dtype == torch.float16 and t.shape == (1, 3, 1, 1)


@pytest.mark.parametrize(("n", "r"), [(10_000_000, 0.07), (10_000_000, 0.17), (123_457, 0.3)])
def test_upload_size_is_exact_for_large_clients(n, r):
    """ceil(r n) in exact rational arithmetic (r as written in params.yaml): at n = 1e7 the float product of r and n
    is off by about 1e-10, which the 9-decimal rounding absorbs."""
    assert upload_size(n, r) == math.ceil(Fraction(str(r)) * n)
