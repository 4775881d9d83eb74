"""The two Gaussian mechanisms (clipping and noise) and the RDP accountant, against loops written from their
definitions (Dwork & Roth 2014 Thm. A.1; McMahan et al. 2018 Alg. 1; dp_accounting's events composed one by one):
the tests that kill `make mutation`'s mutants of fedccrl_core/privacy/dp.py, accountant.py and charged.py that
tests/test_privacy.py leaves alive. The noise is checked draw for draw: a generator of the same seed feeds the loop."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from fedccrl_core.algorithms.base import Reply
from fedccrl_core.foundation import contract
from fedccrl_core.privacy import accountant as A
from fedccrl_core.privacy.charged import ChargedRelease
from fedccrl_core.privacy.dp import (
    RUNNING_VAR_FLOOR,
    DPFedAvgAggregation,
    clip_rows,
    clip_update,
    floating_keys,
    noisy_moments,
    privatize,
    privatize_moments,
    privatize_rows,
    stats_noise_std,
)
from fedccrl_core.privacy.settings import BudgetExhausted, PrivacySettings

MU_RANGE, SIGMA_RANGE = (-1.0, 2.0), (0.25, 1.5)


def settings(**kw) -> PrivacySettings:
    base = dict(
        enabled=True,
        stats_mu_range=list(MU_RANGE),
        stats_sigma_range=list(SIGMA_RANGE),
        stats_noise_multiplier=0.7,
        weights_clip=2.0,
        weights_noise_multiplier=1.3,
    )
    return PrivacySettings(**{**base, **kw})


def clip_loop(v: float, lo: float, hi: float) -> float:
    return lo if v < lo else hi if v > hi else v


def rows(k=6, c=3, seed=0):
    g = np.random.default_rng(seed)
    return g.normal(0.3, 1.5, (k, c)).astype(np.float32), np.abs(g.normal(0.8, 0.8, (k, c))).astype(np.float32)


def test_clip_rows_clips_each_coordinate_into_its_range_in_float64():
    mu, sigma = rows()
    cmu, csig = clip_rows(mu, sigma, settings())
    assert cmu.dtype == csig.dtype == np.float64
    for r in range(len(mu)):
        for c in range(mu.shape[1]):
            assert cmu[r, c] == clip_loop(float(mu[r, c]), *MU_RANGE)
            assert csig[r, c] == clip_loop(float(sigma[r, c]), *SIGMA_RANGE)


def test_row_noise_std_is_z_times_the_box_diameter():
    for c in (1, 3):
        diameter = math.sqrt(c * (MU_RANGE[1] - MU_RANGE[0]) ** 2 + c * (SIGMA_RANGE[1] - SIGMA_RANGE[0]) ** 2)
        assert stats_noise_std(settings(), c) == pytest.approx(0.7 * diameter, rel=1e-12)


def test_privatize_rows_is_clip_noise_clip_draw_for_draw():
    mu, sigma = rows(seed=1)
    s = settings()
    out_mu, out_sig = privatize_rows(mu, sigma, s, np.random.default_rng(5))
    assert out_mu.dtype == out_sig.dtype == np.float32
    rng = np.random.default_rng(5)
    std = stats_noise_std(s, 3)
    noise_mu, noise_sig = rng.normal(0.0, std, mu.shape), rng.normal(0.0, std, sigma.shape)
    for r in range(len(mu)):
        for c in range(3):
            m = clip_loop(clip_loop(float(mu[r, c]), *MU_RANGE) + noise_mu[r, c], *MU_RANGE)
            sd = clip_loop(clip_loop(float(sigma[r, c]), *SIGMA_RANGE) + noise_sig[r, c], *SIGMA_RANGE)
            assert out_mu[r, c] == np.float32(m) and out_sig[r, c] == np.float32(sd)
    assert privatize_rows(mu.astype(np.float64), sigma, s, np.random.default_rng(5))[0].dtype == np.float64


def moments_sensitivity_loop(c: int) -> float:
    """The sums' L2 sensitivity: per coordinate the range of a row value and of its square, over 2C coordinates."""
    (a, b), (lo, hi) = MU_RANGE, SIGMA_RANGE
    sq_mu = max(a * a, b * b) - (0.0 if a <= 0 <= b else min(a * a, b * b))
    sq_sig = max(lo * lo, hi * hi) - (0.0 if lo <= 0 <= hi else min(lo * lo, hi * hi))
    return math.sqrt(c * ((b - a) ** 2 + (hi - lo) ** 2 + sq_mu**2 + sq_sig**2))


def test_noisy_moments_are_the_noised_sums_over_k():
    g = np.random.default_rng(2)
    data = g.normal(0, 1, (5, 4))
    s = settings(stats_noise_multiplier=0.05)
    mean, var = noisy_moments(data, s, np.random.default_rng(8))
    rng = np.random.default_rng(8)
    std = 0.05 * moments_sensitivity_loop(2)
    n1, n2 = rng.normal(0.0, std, 4), rng.normal(0.0, std, 4)
    for c in range(4):
        s1 = sum(data[r, c] for r in range(5)) + n1[c]
        s2 = sum(data[r, c] ** 2 for r in range(5)) + n2[c]
        assert mean[c] == pytest.approx(s1 / 5, rel=1e-12)
        assert var[c] == pytest.approx(max(s2 / 5 - (s1 / 5) ** 2, 0.0), rel=1e-9, abs=1e-15)


def test_noisy_moments_floor_a_negative_variance_at_0():
    """Constant rows and a large noise: S2 / k - mean^2 falls below 0 for some draws, and is then 0."""
    data = np.full((3, 2), 0.5)
    variances = np.concatenate(
        [noisy_moments(data, settings(stats_noise_multiplier=5.0), np.random.default_rng(seed))[1] for seed in range(8)]
    )
    assert (variances >= 0).all() and (variances == 0).sum() >= 2 and (variances > 0).sum() >= 2


def test_privatize_moments_draws_k_rows_from_the_noisy_moments():
    mu, sigma = rows(k=7, seed=3)
    s = settings(stats_release="moments", stats_noise_multiplier=0.2)
    out_mu, out_sig = privatize_moments(mu, sigma, s, np.random.default_rng(4))
    assert out_mu.shape == out_sig.shape == (7, 3) and out_mu.dtype == np.float32
    cmu = np.clip(mu.astype(np.float64), *MU_RANGE)
    csig = np.clip(sigma.astype(np.float64), *SIGMA_RANGE)
    rng = np.random.default_rng(4)
    mean, var = noisy_moments(np.concatenate([cmu, csig], axis=1), s, rng)
    z = rng.standard_normal((7, 6))
    for r in range(7):
        for c in range(6):
            v = mean[c] + math.sqrt(var[c]) * z[r, c]
            got = out_mu[r, c] if c < 3 else out_sig[r, c - 3]
            assert got == np.float32(clip_loop(v, *(MU_RANGE if c < 3 else SIGMA_RANGE)))
    dispatched = privatize(mu, sigma, s, np.random.default_rng(4))
    np.testing.assert_array_equal(dispatched[0], out_mu)
    rows_release = privatize(mu, sigma, settings(stats_noise_multiplier=0.2), np.random.default_rng(4))
    np.testing.assert_array_equal(
        rows_release[0], privatize_rows(mu, sigma, settings(stats_noise_multiplier=0.2), np.random.default_rng(4))[0]
    )


def test_floating_keys_are_the_sorted_floating_entries():
    state = {"b": torch.zeros(1), "a": torch.zeros(1, dtype=torch.float64), "n": torch.tensor(3), "c": torch.zeros(2)}
    assert floating_keys(state) == ["a", "b", "c"]


@pytest.mark.parametrize("scale", [0.1, 1.0, 7.0])
def test_clip_update_scales_by_min_1_s_over_the_norm(scale):
    g = torch.Generator().manual_seed(0)
    update = {"w": torch.randn(3, 2, generator=g) * scale, "b": torch.randn(4, generator=g) * scale}
    norm = math.sqrt(sum(float(x) ** 2 for v in update.values() for x in v.flatten().double()))
    clipped, got_norm = clip_update(update, 2.0)
    assert got_norm == pytest.approx(norm, rel=1e-12)
    factor = min(1.0, 2.0 / norm)
    for k, v in update.items():
        assert clipped[k].dtype == torch.float64
        np.testing.assert_allclose(clipped[k].numpy(), v.double().numpy() * factor, rtol=1e-12)
    clipped_norm = math.sqrt(sum(float((v**2).sum()) for v in clipped.values()))
    assert clipped_norm == pytest.approx(min(norm, 2.0), rel=1e-9)


def test_clip_update_clips_an_update_of_norm_below_1():
    """S < ||update|| <= 1: the update is still scaled to norm S."""
    update = {"w": torch.tensor([0.3, 0.4], dtype=torch.float64)}  # norm 0.5
    clipped, norm = clip_update(update, 0.2)
    assert norm == pytest.approx(0.5, rel=1e-15)
    np.testing.assert_allclose(clipped["w"].numpy(), [0.3 * 0.4, 0.4 * 0.4], rtol=1e-15)


def test_clip_update_of_a_zero_update_is_zero():
    clipped, norm = clip_update({"w": torch.zeros(3)}, 1.0)
    assert norm == 0.0 and clipped["w"].tolist() == [0.0, 0.0, 0.0]


def global_state():
    g = torch.Generator().manual_seed(1)
    return {
        "conv.weight": torch.randn(2, 3, generator=g),
        "bn.running_var": torch.full((3,), 1e-4),
        "bn.num_batches_tracked": torch.tensor(4),
        "fc.bias": torch.randn(2, generator=g, dtype=torch.float64),
    }


def test_dp_fedavg_is_global_plus_mean_of_clipped_updates_plus_noise_draw_for_draw():
    glob = global_state()
    s = settings(weights_clip=0.5, weights_noise_multiplier=0.01)
    agg = DPFedAvgAggregation(glob, 3, s, np.random.default_rng(9))
    g = torch.Generator().manual_seed(2)
    updates = []
    for i in range(2):  # m = 3 sampled, 2 answer: the denominator stays 3
        w = {
            k: (v + torch.randn(v.shape, generator=g).to(v.dtype) * 0.4 if v.is_floating_point() else v + 7)
            for k, v in glob.items()
        }
        agg.add(Reply(f"c{i}", w, 10))
        updates.append({k: (w[k].double() - glob[k].double()) for k in glob if glob[k].is_floating_point()})
    assert agg.client_ids == ["c0", "c1"]
    assert agg.noise_std() == pytest.approx(0.01 * 0.5 / 3, rel=1e-12)
    out = agg.result()
    rng = np.random.default_rng(9)
    total = {k: np.zeros(tuple(glob[k].shape)) for k in updates[0]}
    for u in updates:
        norm = math.sqrt(sum(float((v**2).sum()) for v in u.values()))
        for k in u:
            total[k] += u[k].numpy() * min(1.0, 0.5 / norm)
    for k, g0 in glob.items():
        if not g0.is_floating_point():
            assert int(out[k]) == int(g0)  # an integer buffer is not released: the global value
            continue
        noise = rng.standard_normal(tuple(g0.shape)) * (0.01 * 0.5 / 3)
        want = g0.double().numpy() + total[k] / 3 + noise
        if k.endswith("running_var"):
            want = np.maximum(want, RUNNING_VAR_FLOOR)
        assert out[k].dtype == g0.dtype
        np.testing.assert_allclose(out[k].double().numpy(), want.astype(g0.numpy().dtype), rtol=1e-6, atol=1e-12)


def test_dp_fedavg_sums_the_clipped_updates_in_float64():
    """One update of 1 then 200 of 1e-9: a float32 sum loses every small one (1 + 1e-9 == 1 in float32), the
    float64 sum of the stated algorithm keeps them."""
    m, z, clip = 201, 0.01, 10.0  # clip above every norm: no update is scaled
    glob = {"w": torch.zeros(3, dtype=torch.float64)}
    agg = DPFedAvgAggregation(
        glob, m, settings(weights_clip=clip, weights_noise_multiplier=z), np.random.default_rng(4)
    )
    steps = [1.0] + [1e-9] * (m - 1)
    for i, d in enumerate(steps):
        agg.add(Reply(f"c{i}", {"w": torch.full((3,), d, dtype=torch.float64)}, 1))
    total64, total32 = 0.0, np.float32(0.0)
    for d in steps:
        total64 += d
        total32 = np.float32(total32 + np.float32(d))
    assert abs(float(total32) - total64) > 1e-7  # the case tells float32 from float64
    noise = np.random.default_rng(4).standard_normal(3) * (z * clip / m)
    want = 0.0 + total64 / m + noise
    np.testing.assert_allclose(agg.result()["w"].numpy(), want, rtol=0, atol=1e-15)


def test_dp_fedavg_floors_a_noised_running_variance():
    glob = {"bn.running_var": torch.full((50,), 1e-5, dtype=torch.float64)}
    agg = DPFedAvgAggregation(
        glob, 1, settings(weights_noise_multiplier=1.0, weights_clip=1.0), np.random.default_rng(0)
    )
    agg.add(Reply("c", {"bn.running_var": torch.full((50,), 1e-5, dtype=torch.float64)}, 1))
    out = agg.result()["bn.running_var"]
    assert float(out.min()) == RUNNING_VAR_FLOOR and float(out.max()) > 0.1


def test_dp_fedavg_refusals():
    glob = global_state()
    with pytest.raises(ValueError, match="^DP-FedAvg: no client sampled$"):
        DPFedAvgAggregation(glob, 0, settings(), np.random.default_rng(0))
    agg = DPFedAvgAggregation(glob, 1, settings(), np.random.default_rng(0))
    with pytest.raises(ValueError, match="^DP-FedAvg: no client update to aggregate$"):
        agg.result()
    with pytest.raises(
        ValueError,
        match=r"^DP-FedAvg: client c7 uploads more than weights \(\['g'\]\); "
        r"train\.privacy\.weights covers the weights only$",
    ):
        agg.add(Reply("c7", glob, 1, upload={"g": torch.zeros(1)}))


# ---------------------------------------------------------------------------------------------
# The accountant
# ---------------------------------------------------------------------------------------------
def test_sampled_gaussian_events():
    assert A.sampled_gaussian(10, 10, 1.5) == dp_accounting.GaussianDpEvent(1.5)
    assert A.sampled_gaussian(10, 3, 1.5) == dp_accounting.SampledWithoutReplacementDpEvent(
        10, 3, dp_accounting.GaussianDpEvent(1.5)
    )
    assert A.sampled_gaussian(10, 1, 1.5) == dp_accounting.SampledWithoutReplacementDpEvent(
        10, 1, dp_accounting.GaussianDpEvent(1.5)
    )
    for population, sample in ((10, 0), (10, 11)):
        with pytest.raises(ValueError, match=f"^privacy accounting: a sample of {sample} out of {population}$"):
            A.sampled_gaussian(population, sample, 1.0)


def test_worst_client_is_the_largest_sampling_ratio_then_the_smallest_client():
    assert A.worst_client({"a": (100, 10), "b": (30, 6), "c": (50, 5)}) == (30, 6)
    assert A.worst_client({"a": (20, 2), "b": (10, 1), "c": (40, 4)}) == (10, 1)
    assert A.worst_client({"a": (10, 1), "b": (20, 2)}) == (10, 1)


def test_the_channels_events():
    s = settings(stats_noise_multiplier=0.9, weights_noise_multiplier=3.0)
    want = dp_accounting.SampledWithoutReplacementDpEvent(30, 6, dp_accounting.GaussianDpEvent(0.9))
    assert A.statistics_event(s, {"a": (100, 10), "b": (30, 6)}) == want
    want = dp_accounting.SampledWithoutReplacementDpEvent(8, 2, dp_accounting.GaussianDpEvent(1.5))  # z / 2
    assert A.weights_event(s, 8, 2) == want


def epsilon_loop(events, delta, orders=None) -> float:
    """Every event composed on its own, in order (no self-composition grouping)."""
    kw = {"neighboring_relation": dp_accounting.NeighboringRelation.REPLACE_ONE}
    acc = rdp.RdpAccountant(orders, **kw) if orders is not None else rdp.RdpAccountant(**kw)
    for e in events:
        acc.compose(e)
    return float(acc.get_epsilon(delta))


def test_epsilon_of_equals_the_events_composed_one_by_one():
    """Sampled events on a few orders (each costs ~1 s on the default orders), unsampled ones on the defaults."""
    e1 = A.sampled_gaussian(100, 10, 1.2)
    e2 = A.sampled_gaussian(8, 2, 2.0)
    orders = [2.0, 4.0, 8.0]
    events = [e1, e2, e1, e1, e2, A.sampled_gaussian(5, 5, 4.0)]
    assert A.epsilon_of(events, 1e-5, orders) == pytest.approx(epsilon_loop(events, 1e-5, orders), rel=1e-9)
    assert A.epsilon_of([e1], 1e-3, orders) == pytest.approx(epsilon_loop([e1], 1e-3, orders), rel=1e-9)
    g1, g2 = A.sampled_gaussian(5, 5, 1.5), A.sampled_gaussian(3, 3, 0.8)
    gauss = [g1, g2, g1, g1]
    assert A.epsilon_of(gauss, 1e-5) == pytest.approx(epsilon_loop(gauss, 1e-5), rel=1e-9)
    assert A.epsilon_of(gauss, 1e-5, [2.0, 4.0]) > A.epsilon_of(gauss, 1e-5)  # fewer orders, a looser bound
    assert A.epsilon_of([], 1e-5) == 0.0


def test_epsilon_of_takes_the_unsampled_bound_where_it_is_smaller():
    """9 of 10 sampled: the sampled Gaussian's bound (Thm. 27) is looser than the Gaussian's own, and a sampled event
    is bounded by both: epsilon is the smaller composition, on the orders given."""
    orders = [2.0, 4.0, 8.0]
    e = A.sampled_gaussian(10, 9, 1.0)
    g = dp_accounting.GaussianDpEvent(1.0)
    other = A.sampled_gaussian(5, 5, 3.0)  # an unsampled event is kept as it is
    sampled, unsampled = epsilon_loop([e, other, e], 1e-5, orders), epsilon_loop([g, other, g], 1e-5, orders)
    assert unsampled < sampled
    assert A.epsilon_of([e, other, e], 1e-5, orders) == pytest.approx(unsampled, rel=1e-9)
    assert epsilon_loop([g, other, g], 1e-5) < unsampled  # the default orders give another value


def test_ledger_composes_by_channel_and_answers_would_exceed():
    s = settings(max_epsilon=0.0, delta=1e-4)
    ledger = A.Ledger(s)
    e_s, e_w = A.sampled_gaussian(50, 50, 1.0), A.sampled_gaussian(10, 10, 2.0)  # unsampled: fast epsilons
    ledger.record("statistics", 1, e_s)
    ledger.record("weights", 1, e_w)
    assert ledger.releases == [("statistics", 1, e_s), ("weights", 1, e_w)]
    assert ledger.epsilon() == pytest.approx(epsilon_loop([e_s, e_w], 1e-4), rel=1e-9)
    assert ledger.epsilon(channel="weights") == pytest.approx(epsilon_loop([e_w], 1e-4), rel=1e-9)
    assert ledger.epsilon([e_s], channel="statistics") == pytest.approx(epsilon_loop([e_s, e_s], 1e-4), rel=1e-9)
    assert ledger.would_exceed([e_s] * 50) is None  # no limit
    after = epsilon_loop([e_s, e_w, e_w], 1e-4)
    ledger.settings = settings(max_epsilon=after * 0.999, delta=1e-4)
    assert ledger.would_exceed([e_w]) == pytest.approx(after, rel=1e-9)
    ledger.settings = settings(max_epsilon=ledger.epsilon([e_w]), delta=1e-4)
    assert ledger.would_exceed([e_w]) is None  # equal to the bound: allowed


def test_run_privacy_round_by_round():
    s = settings(stats_noise_multiplier=1.1, weights_noise_multiplier=2.2, delta=1e-5)
    run = A.RunPrivacy(s)
    sizes = {"a": (40, 4), "b": (20, 4)}
    assert run.round_events(sizes, 6, 3) == [A.statistics_event(s, sizes), A.weights_event(s, 6, 3)]
    assert run.round_events({}, 0, 0) == [dp_accounting.GaussianDpEvent(1.1), dp_accounting.GaussianDpEvent(1.1)]
    full = {"a": (40, 40), "b": (20, 20)}  # every row and every client: unsampled events, fast epsilons
    run.before_round(1, full, 6, 6)
    run.statistics(1, full)
    run.before_weights(1, 6, 6)
    run.weights(1, 6, 6)
    run.statistics(2, {})  # nothing announced: nothing recorded
    assert run.state() == [["statistics", 1, 20, 20, 1.1], ["weights", 1, 6, 6, 1.1]]  # the tie: the smaller client
    rec = run.record()
    e_s, e_w = A.sampled_gaussian(20, 20, 1.1), A.sampled_gaussian(6, 6, 1.1)
    assert rec[contract.DP_EPSILON] == pytest.approx(epsilon_loop([e_s, e_w], 1e-5), rel=1e-9)
    assert rec[contract.DP_EPSILON_WEIGHTS] == pytest.approx(epsilon_loop([e_w], 1e-5), rel=1e-9)
    assert rec[contract.DP_EPSILON_STATISTICS] == pytest.approx(epsilon_loop([e_s], 1e-5), rel=1e-9)
    assert contract.DP_SEEDED_NOISE not in rec
    resumed = A.RunPrivacy(s)
    resumed.load_state(run.state())
    assert resumed.state() == run.state() and resumed.record() == rec
    resumed.load_state(None)
    assert resumed.state() == [] and resumed.record()[contract.DP_EPSILON] == 0.0


def test_run_privacy_without_uploads_and_seeded(not_private):
    s = settings(noise_seed=3, weights_noise_multiplier=2.0)
    run = A.RunPrivacy(s, uploads=False)
    assert run.round_events({"a": (10, 1)}, 4, 2) == [A.weights_event(s, 4, 2)]
    run.statistics(1, {"a": (10, 1)})
    run.weights(1, 4, 4)
    assert run.state() == [["weights", 1, 4, 4, 1.0]]
    rec = run.record()
    assert set(rec) == {contract.DP_EPSILON, contract.DP_EPSILON_WEIGHTS, contract.DP_SEEDED_NOISE}
    assert rec[contract.DP_SEEDED_NOISE] == 1.0


@pytest.mark.parametrize("uploads", [True, False])
def test_the_budget_stops_before_the_round_that_would_pass_it(uploads):
    one_round = (
        [A.sampled_gaussian(10, 10, 1.0), A.sampled_gaussian(4, 4, 1.0)] if uploads else [A.sampled_gaussian(4, 4, 1.0)]
    )
    eps1 = epsilon_loop(one_round, 1e-5)
    s = settings(stats_noise_multiplier=1.0, weights_noise_multiplier=2.0, max_epsilon=eps1 * 1.01)
    run = A.RunPrivacy(s, uploads=uploads)
    run.before_round(1, {"a": (10, 10)}, 4, 4)
    run.statistics(1, {"a": (10, 10)})
    run.weights(1, 4, 4)
    what = "releases \\(statistics and weights\\)" if uploads else "weights release"
    with pytest.raises(BudgetExhausted, match=f"^privacy budget: round 2's {what} would bring epsilon to "):
        run.before_round(2, {"a": (10, 10)}, 4, 4)
    with pytest.raises(
        BudgetExhausted,
        match="round 3's weights release would bring epsilon to .* at delta 1e-05, "
        "above train.privacy.max_epsilon = .*; stopping before it. epsilon spent \\(the ledger\\): ",
    ):
        run.before_weights(3, 4, 4)


def test_before_round_charges_the_announced_sizes_not_their_upper_bound():
    """max_epsilon between the announced round's epsilon and its upper bound (every row, every client): the
    announced round passes, the upper bound would not."""
    delta = 1e-5
    s = settings(stats_noise_multiplier=1.0, weights_noise_multiplier=2.0, delta=delta)
    gauss = dp_accounting.GaussianDpEvent(1.0)  # z = 1 on both channels (the weights' z / 2)
    # statistics: 1 row of 100 announced; weights: every client (unsampled)
    announced = epsilon_loop([A.sampled_gaussian(100, 1, 1.0), gauss], delta)
    upper = epsilon_loop([gauss, gauss], delta)
    assert announced < upper
    run = A.RunPrivacy(settings(**{**s.model_dump(), "max_epsilon": (announced + upper) / 2}))
    run.before_round(1, {"a": (100, 1)}, 4, 4)
    with pytest.raises(BudgetExhausted):
        run.before_round(1, {}, 4, 4)
    # weights: 1 client of 100 sampled, no statistics channel
    announced = epsilon_loop([A.sampled_gaussian(100, 1, 1.0)], delta)
    upper = epsilon_loop([gauss], delta)
    assert announced < upper
    run = A.RunPrivacy(settings(**{**s.model_dump(), "max_epsilon": (announced + upper) / 2}), uploads=False)
    run.before_round(1, {}, 100, 1)
    with pytest.raises(BudgetExhausted):
        run.before_round(1, {}, 0, 0)


def test_each_release_is_kept_then_handed_on_as_charged():
    """keep(state()) and on_release(release) at every release, in that order (the ledger file, then the study's):
    the release as [channel, round, population, sample, z], the worst client's ratio for the statistics."""
    s = settings(stats_noise_multiplier=1.1, weights_noise_multiplier=2.2, delta=1e-5)
    run = A.RunPrivacy(s)
    seen: list = []
    run.keep = lambda state: seen.append(("keep", len(state)))
    run.on_release = lambda release: seen.append(("release", release))
    run.statistics(3, {"a": (40, 4), "b": (20, 4)})
    run.weights(3, 6, 2)
    assert seen == [
        ("keep", 1),
        ("release", [A.STATISTICS, 3, 20, 4, 1.1]),
        ("keep", 2),
        ("release", [A.WEIGHTS, 3, 6, 2, 1.1]),
    ]


def test_a_charged_release_covers_a_ratio_no_larger_in_integers():
    """privacy/charged.py: k' of n' rows are covered by the charged (n, k) when k' n <= k n' (the ratio, compared
    exactly); the refusal names both (n, k) and their ratios; a charge needs 0 < k <= n."""
    charged = ChargedRelease(216, 22)  # the site: k = 22 of n = 216 announced
    assert charged.covers(216, 22) and charged.covers(220, 22) and charged.covers(1000, 100)
    assert not charged.covers(215, 22)  # 22/215 > 22/216: the integers tell, not a rounded ratio
    assert ChargedRelease(20, 2).covers(10, 1) and not ChargedRelease(20, 2).covers(9, 1)  # an equal ratio is covered
    assert ChargedRelease(1, 1).covers(1, 1) and ChargedRelease(3, 3).covers(5, 5)  # charged unsampled: any release
    assert charged.refusal(216, 22) == "" and charged.refusal(10_000, 1) == ""
    assert charged.refusal(11, 2) == (  # its folder shrank: k = 2 of 11
        "releasing k = 2 of its n = 11 rows (ratio 0.1818) exceeds the k = 22 of n = 216 (ratio 0.1019) that the "
        "pre-round check charged (train.privacy.max_epsilon); refused before any row was drawn"
    )
    for n, k in ((0, 0), (5, 0), (5, 6), (1, 2)):
        with pytest.raises(ValueError, match=rf"^a charged release of k = {k} rows out of n = {n}: needs 0 < k <= n$"):
            ChargedRelease(n, k)
