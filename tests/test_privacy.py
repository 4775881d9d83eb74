"""Differential privacy on both upload channels (fedccrl_core/privacy): the accountant pinned to published
values, to Wang, Balle and Kasiviswanathan's bound on its own path (sampling without replacement, replace-one) and
to a hand calculation of the two channels' composition, the clipping bounds, the noise std against its formula,
noise that the run seed does not predict, the settings that would release something unnoised refused, and the
round loop's accounting and max_epsilon stop."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import held_out_run

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.algorithms.base import Reply
from fedccrl_core.federation.driver import build_seeded_model, train
from fedccrl_core.federation.engine import InProcessEngine, InProcessTransport
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.errors import ParamError
from fedccrl_core.privacy import accountant as A
from fedccrl_core.privacy.dp import (
    DPFedAvgAggregation,
    clip_update,
    noisy_moments,
    privatize,
    privatize_rows,
    stats_noise_std,
)
from fedccrl_core.privacy.settings import PrivacySettings

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Opacus's default RDP orders (opacus/accountants/rdp.py DEFAULT_ALPHAS), used by its test below
OPACUS_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


def test_rdp_accountant_matches_opacus_published_value():
    """Opacus's accountants test (test_rdp_accountant): sigma 1.5, q 0.04, int(90 / 0.04) = 2250 steps,
    delta 1e-5 -> RDP epsilon 7.32911117143. dp_accounting 0.6 with the same orders gives 7.3293347: the optimum
    is order 3.9, a fractional order, whose log-moment dp_accounting computes by a different series than Opacus
    (the gap, 2.2e-4, is in that order's RDP; the best integer order, 4, gives 7.32988 in both conventions)."""
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    acc = rdp.RdpAccountant(OPACUS_ORDERS)
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.04, dp_accounting.GaussianDpEvent(1.5)), int(90 / 0.04))
    eps, order = acc.get_epsilon_and_optimal_order(1e-5)
    assert eps == pytest.approx(7.32911117143, abs=5e-4)
    assert eps == pytest.approx(7.329334702381698, rel=1e-9)  # this library's own value, pinned
    assert order == 3.9


def hand_epsilon(rdp_per_round: np.ndarray, orders: np.ndarray, rounds: int, delta: float) -> float:
    """RDP adds over events and rounds; epsilon = min over orders of
    rdp + log((a - 1) / a) - (log delta + log a) / (a - 1) (Balle et al. 2020, Prop. 12)."""
    rdp_total = rounds * rdp_per_round
    eps = rdp_total + np.log((orders - 1) / orders) - (np.log(delta) + np.log(orders)) / (orders - 1)
    return float(np.min(eps[orders > 1.01]))


def test_two_channels_compose_as_the_hand_calculation():
    """Unsampled (every row and every client each round): the Gaussian mechanism's RDP at order a is
    a / (2 z^2) for noise multiplier z (Mironov 2017, Prop. 7). Statistics: z_s; weights: z / 2 (replace-one
    sensitivity 2 S against noise z S). Over R rounds: R a (1 / (2 z_s^2) + 4 / (2 z^2))."""
    s = PrivacySettings(enabled=True, stats_noise_multiplier=3.0, weights_noise_multiplier=5.0, delta=1e-5)
    run = A.RunPrivacy(s)
    rounds = 7
    for t in range(1, rounds + 1):
        run.statistics(t, {"a": (10, 10), "b": (20, 20)})
        run.weights(t, 3, 3)
    orders = np.array(A.rdp.DEFAULT_RDP_ORDERS, dtype=float)
    per_round = orders * (1 / (2 * 3.0**2) + 1 / (2 * (5.0 / 2) ** 2))
    rec = run.record()
    assert rec[contract.DP_EPSILON] == pytest.approx(hand_epsilon(per_round, orders, rounds, 1e-5), rel=1e-9)
    stats_only = hand_epsilon(orders / (2 * 3.0**2), orders, rounds, 1e-5)
    assert rec[contract.DP_EPSILON_STATISTICS] == pytest.approx(stats_only, rel=1e-9)
    assert rec[contract.DP_EPSILON_WEIGHTS] < rec[contract.DP_EPSILON]
    assert rec[contract.DP_EPSILON_STATISTICS] < rec[contract.DP_EPSILON]


def test_sampling_amplifies_and_the_worst_client_counts():
    s = PrivacySettings(enabled=True)
    full = A.epsilon_of([A.statistics_event(s, {"a": (100, 100)})], 1e-5)
    tenth = A.epsilon_of([A.statistics_event(s, {"a": (100, 10)})], 1e-5)
    assert tenth < full
    assert A.statistics_event(s, {"a": (100, 10), "b": (10, 1), "c": (95, 10)}) == A.statistics_event(
        s, {"c": (95, 10)}
    )
    with pytest.raises(ValueError, match="a sample of 5 out of 3"):
        A.sampled_gaussian(3, 5, 1.0)


def test_clipped_updates_are_within_the_bound():
    g = torch.Generator().manual_seed(0)
    for scale in (1e-3, 0.5, 3.0, 100.0):
        update = {"a": torch.randn(50, generator=g) * scale, "b": torch.randn(3, 4, generator=g) * scale}
        clipped, norm = clip_update(update, 1.0)
        after = math.sqrt(sum(float((v**2).sum()) for v in clipped.values()))
        assert after <= 1.0 + 1e-12
        if norm <= 1.0:  # below the bound: untouched
            assert all(torch.equal(clipped[k], update[k].double()) for k in update)


def test_released_rows_stay_in_the_box():
    s = PrivacySettings(enabled=True)
    rng = np.random.default_rng(0)
    mu, sigma = rng.normal(0, 5, (500, 3)), rng.normal(0, 5, (500, 3))
    rmu, rsig = privatize_rows(mu.astype(np.float32), sigma.astype(np.float32), s, rng)
    assert rmu.dtype == np.float32 and rmu.shape == (500, 3)
    assert rmu.min() >= -2.2 and rmu.max() <= 2.7 and rsig.min() >= 0.0 and rsig.max() <= 1.5


def test_statistics_noise_std_matches_its_formula():
    """Rows at the box's centre with a noise small against the box (no post-clipping): the spread of
    released - true over 60,000 coordinates is z_s x D, D = sqrt(C (mu range)^2 + C (sigma range)^2)."""
    s = PrivacySettings(
        enabled=True, stats_noise_multiplier=0.04, stats_mu_range=[-10.0, 10.0], stats_sigma_range=[0.0, 1.0]
    )
    d = math.sqrt(3 * 20.0**2 + 3 * 1.0**2)
    assert stats_noise_std(s, 3) == pytest.approx(0.04 * d)
    mu = np.zeros((20000, 3))
    rmu, _ = privatize_rows(mu, np.full((20000, 3), 0.5), s, np.random.default_rng(1))
    n = rmu.size  # the sample std's standard error is std / sqrt(2 n): 5 of them
    assert float(rmu.std()) == pytest.approx(0.04 * d, rel=5 / math.sqrt(2 * n))
    assert abs(float(rmu.mean())) < 5 * 0.04 * d / math.sqrt(n)


def test_moments_sensitivity_is_the_hand_calculation():
    """Box mu in [-1, 2], sigma in [0, 1], C = 3: per channel the ranges of mu, sigma, mu^2, sigma^2 are 3, 1, 4, 1,
    so D_m = sqrt(3 (9 + 1 + 16 + 1)) = 9."""
    s = PrivacySettings(enabled=True, stats_mu_range=[-1.0, 2.0], stats_sigma_range=[0.0, 1.0])
    assert s.moments_sensitivity(3) == pytest.approx(9.0)
    assert PrivacySettings(enabled=True, stats_mu_range=[1.0, 2.0], stats_sigma_range=[0.5, 1.0]).moments_sensitivity(
        1
    ) == pytest.approx(math.sqrt(1 + 0.25 + 9 + 0.5625))  # squares of [1, 2]: [1, 4]; of [0.5, 1]: [0.25, 1]


def test_moments_noise_std_matches_its_formula():
    """k rows: the released mean moves from the true mean by the noise on the sum over k, std z_s D_m / k
    (4,000 draws of 6 coordinates)."""
    s = PrivacySettings(
        enabled=True, stats_noise_multiplier=0.3, stats_mu_range=[-1.0, 2.0], stats_sigma_range=[0.0, 1.0]
    )
    rng = np.random.default_rng(0)
    rows = np.concatenate([rng.uniform(-1, 2, (50, 3)), rng.uniform(0, 1, (50, 3))], axis=1)
    errors = np.stack([noisy_moments(rows, s, rng)[0] - rows.mean(0) for _ in range(4000)])
    std = 0.3 * 9.0 / 50
    assert float(errors.std()) == pytest.approx(std, rel=5 / math.sqrt(2 * errors.size))
    assert abs(float(errors.mean())) < 5 * std / math.sqrt(errors.size)


def test_moments_release_keeps_the_count_and_the_box_and_tracks_the_rows():
    s = PrivacySettings(enabled=True, stats_release="moments", stats_noise_multiplier=1e-6)
    rng = np.random.default_rng(0)
    mu, sigma = rng.normal(0.3, 0.2, (400, 3)), rng.uniform(0.2, 0.6, (400, 3))
    rmu, rsig = privatize(mu.astype(np.float32), sigma.astype(np.float32), s, rng)
    assert rmu.shape == (400, 3) and rmu.dtype == np.float32
    assert rmu.min() >= -2.2 and rmu.max() <= 2.7 and rsig.min() >= 0.0 and rsig.max() <= 1.5
    # almost no noise: the drawn rows have the rows' mean and spread per coordinate
    np.testing.assert_allclose(rmu.mean(0), mu.mean(0), atol=5 * 0.2 / math.sqrt(400))
    np.testing.assert_allclose(rmu.std(0), mu.std(0), rtol=0.2)
    noisy = PrivacySettings(enabled=True, stats_release="moments", stats_noise_multiplier=50.0)
    nmu, nsig = privatize(mu, sigma, noisy, np.random.default_rng(1))
    assert nmu.min() >= -2.2 and nmu.max() <= 2.7 and nsig.min() >= 0.0 and nsig.max() <= 1.5


def test_dp_fedavg_noise_std_matches_z_s_over_m():
    """Clients that return the global weights: the aggregate moves by the noise alone, std z S / m."""
    s = PrivacySettings(enabled=True, weights_clip=0.7, weights_noise_multiplier=1.3)
    gw = {"w": torch.zeros(40000), "bn.running_var": torch.ones(10), "bn.num_batches_tracked": torch.tensor(4)}
    agg = DPFedAvgAggregation(gw, 4, s, np.random.default_rng(0))
    for i in range(3):  # one of the 4 sampled dropped: the denominator stays 4
        agg.add(Reply(f"c{i}", {k: v.clone() for k, v in gw.items()}, 10))
    out = agg.result()
    std = 1.3 * 0.7 / 4
    assert agg.noise_std() == pytest.approx(std)
    n = out["w"].numel()
    assert float(out["w"].double().std()) == pytest.approx(std, rel=5 / math.sqrt(2 * n))
    assert torch.equal(out["bn.num_batches_tracked"], gw["bn.num_batches_tracked"])  # not released
    assert float(out["bn.running_var"].min()) > 0


def test_dp_fedavg_mean_of_clipped_updates():
    s = PrivacySettings(enabled=True, weights_clip=1.0, weights_noise_multiplier=1e-9)
    gw = {"w": torch.zeros(2)}
    agg = DPFedAvgAggregation(gw, 2, s, np.random.default_rng(0))
    agg.add(Reply("a", {"w": torch.tensor([3.0, 4.0])}, 1))  # norm 5 -> clipped to (0.6, 0.8)
    agg.add(Reply("b", {"w": torch.tensor([0.1, 0.0])}, 99))  # below S: kept; n_i does not weigh
    assert torch.allclose(agg.result()["w"], torch.tensor([0.35, 0.4]), atol=1e-6)


def test_settings_refuse_bad_values_with_the_key():
    with pytest.raises(ParamError, match="train.privacy.stats_mu_range"):
        PrivacySettings.from_mapping({"stats_mu_range": [1.0, -1.0]})
    with pytest.raises(ParamError, match="train.privacy.weights_clip"):
        PrivacySettings.from_mapping({"weights_clip": 0})
    with pytest.raises(ParamError, match="train.privacy.bogus"):
        PrivacySettings.from_mapping({"bogus": 1})
    with pytest.raises(ParamError, match="train.privacy.stats_release.*one of rows, moments"):
        PrivacySettings.from_mapping({"stats_release": "mean"})


# ------------------------------------------------------------------ the round loop
def _train(privacy, rounds=3, algorithm="fedccrl", fraction=1.0, log=None, engine=InProcessEngine):
    from test_round_loop import toy_clients

    clients = toy_clients(4, 12)
    for c in clients:  # statistics rows for FedCCRL's upload
        x = c.train_x.float() / 255
        c.stats_mu, c.stats_sigma = x.mean((2, 3)).numpy(), x.std((2, 3)).numpy()
    alg = build_algorithm(algorithm, LocalConfig(rounds=rounds, local_epochs=1, batch_size=4, privacy=privacy))
    model = build_seeded_model(alg, "small_cnn", 6, "none", 0)
    run = held_out_run(alg, model, clients, (clients[0].train_x, clients[0].train_y), rounds, client_fraction=fraction)
    return train(run, log=log or (lambda m: None), engine=engine)


def test_round_loop_logs_epsilon_every_round_and_noises_both_channels(not_private):
    """Epsilon grows every round; no client metric and no update norm is released; the noise comes from the OS,
    so the same seed gives another run, unless the test-only noise_seed seeds it (then marked in every record)."""
    priv = {"enabled": True, "stats_noise_multiplier": 2.0, "weights_noise_multiplier": 4.0}
    res = _train(priv, fraction=0.5)
    eps = [r.metric(contract.DP_EPSILON) for r in res.history]
    assert len(eps) == 3 and all(b > a > 0 for a, b in itertools.pairwise(eps))
    for r in res.history:
        assert contract.DP_EPSILON_STATISTICS in r.to_dict() and contract.DP_SEEDED_NOISE not in r.to_dict()
        assert not any(k.startswith((contract.TRAIN_ACC, contract.LOSS, "l_", "dp_update")) for k in r.to_dict()), (
            sorted(r.to_dict())
        )
    plain = _train(None, fraction=0.5)
    assert any(not torch.equal(v, plain.final_weights[k]) for k, v in res.final_weights.items())
    again = _train(priv, fraction=0.5)  # the same seed: other noise
    assert any(not torch.equal(v, again.final_weights[k]) for k, v in res.final_weights.items())
    seeded = {**priv, "noise_seed": 5}
    a, b = _train(seeded, fraction=0.5), _train(seeded, fraction=0.5)
    assert all(torch.equal(v, b.final_weights[k]) for k, v in a.final_weights.items())
    assert all(r.metric(contract.DP_SEEDED_NOISE) == 1.0 for r in a.history)
    logs = []
    _train(seeded, rounds=1, log=logs.append)
    assert any("NOT PRIVATE" in m for m in logs)
    assert "NOT PRIVATE" in PrivacySettings(enabled=True, noise_seed=5).noise_source()
    assert "not bit-reproducible" in PrivacySettings(enabled=True).noise_source()


class _Upload:
    """One client's statistics as the algorithm reads them (ClientData's stats fields)."""

    def __init__(self, mu, sigma, client_id="c0"):
        self.stats_mu, self.stats_sigma, self.client_id = mu, sigma, client_id


def test_an_attacker_with_the_run_seed_gains_nothing():
    """The attacker knows params.yaml (seed included) and the code. It regenerates the draws the run seed gives the
    upload (numpy_rng(seed, "upload", round, client), the generator the engines hand to client_upload: Eq. 8's
    sample, then the noise) and subtracts the noise it predicts. Every row equal and at the centre of a box wide
    against the noise (no clipping), so released - true is the noise applied: the attacker's residual keeps the
    full noise variance (2 z^2 D^2: its own draw is independent of the applied one), and its prediction is
    uncorrelated with the noise."""
    from fedccrl_core.data.pools import sample_statistics
    from fedccrl_core.foundation.seeding import numpy_rng

    s = {
        "enabled": True,
        "stats_noise_multiplier": 0.04,
        "stats_mu_range": [-100.0, 100.0],
        "stats_sigma_range": [0.0, 200.0],
    }
    alg = build_algorithm("fedccrl", LocalConfig(rounds=1, privacy=s), {"r": 0.5, "upload": "ceil"})
    n = 4000
    true = np.r_[[0.0] * 3, [100.0] * 3]
    data = _Upload(np.zeros((n, 3)), np.full((n, 3), 100.0))
    up = alg.client_upload(data, numpy_rng(0, "upload", 1, "c0"))
    released = np.concatenate([up["mu"], up["sigma"]], 1)
    rng = numpy_rng(0, "upload", 1, "c0")  # the attacker's replay of the seeded draws
    mu, sigma = sample_statistics(data.stats_mu, data.stats_sigma, 0.5, rng)
    pmu, psig = privatize(mu, sigma, PrivacySettings(**s), rng)
    predicted_noise = np.concatenate([pmu, psig], 1) - true
    noise = released - true
    std = stats_noise_std(PrivacySettings(**s), 3)
    k = noise.size
    assert float(noise.std()) == pytest.approx(std, rel=5 / math.sqrt(2 * k))
    residual = noise - predicted_noise  # what is left of the noise after the attacker subtracts its prediction
    assert float(residual.var()) == pytest.approx(2 * std**2, rel=5 * math.sqrt(2 / k))
    assert abs(float(np.corrcoef(noise.ravel(), predicted_noise.ravel())[0, 1])) < 5 / math.sqrt(k)


def test_the_weights_noise_is_not_the_seeds():
    """The weights channel, through the round loop: FedAvg, 1 round, every client sampled, so the clients' training
    is the same in every run (their draws are the run seed's); the aggregate's noise is the DP run's weights minus
    those of a run with z = 1e-12. The attacker regenerates the draw the run seed gives the server's noise
    (torch_generator(seed, "dp_weights", round), keys in sorted order, as before the noise came from the OS):
    subtracting it leaves twice the noise variance, and it is uncorrelated with the noise."""
    from fedccrl_core.foundation.seeding import torch_generator

    priv = {"enabled": True, "weights_clip": 0.5, "weights_noise_multiplier": 0.8}
    noisy = _train(priv, rounds=1, algorithm="fedavg").final_weights
    clean = _train({**priv, "weights_noise_multiplier": 1e-12}, rounds=1, algorithm="fedavg").final_weights
    gen, std = torch_generator(0, "dp_weights", 1), 0.8 * 0.5 / 4  # z S / m
    draws = {
        k: torch.randn(v.shape, dtype=torch.float64, generator=gen) * std  # one per float entry, in order
        for k, v in clean.items()
        if v.is_floating_point()
    }
    keys = [k for k in draws if not k.endswith("running_var")]  # a noised variance is clamped: left out
    noise = torch.cat([(noisy[k].double() - clean[k].double()).ravel() for k in keys])
    seeded = torch.cat([draws[k].ravel() for k in keys])
    n = noise.numel()
    assert float(noise.std()) == pytest.approx(std, rel=5 / math.sqrt(2 * n))
    assert float((noise - seeded).var()) == pytest.approx(2 * std**2, rel=5 * math.sqrt(2 / n))
    assert abs(float(torch.corrcoef(torch.stack([noise, seeded]))[0, 1])) < 5 / math.sqrt(n)


def test_the_rows_released_are_not_the_seeds_sample():
    """Eq. 8's sample is drawn from the OS too: the rows released are not those the run seed picks, and two
    uploads with the same seed release different rows. Rows carry their index in mu (noise 1e-7 of the box)."""
    from fedccrl_core.data.pools import sample_statistics
    from fedccrl_core.foundation.seeding import numpy_rng

    n = 200
    s = {
        "enabled": True,
        "stats_noise_multiplier": 1e-7,
        "stats_mu_range": [-1.0, float(n)],
        "stats_sigma_range": [0.0, 1.0],
    }
    alg = build_algorithm("fedccrl", LocalConfig(rounds=1, privacy=s), {"r": 0.1, "upload": "ceil"})
    data = _Upload(np.repeat(np.arange(n, dtype=np.float64)[:, None], 3, 1), np.full((n, 3), 0.5))
    picked = [
        set(np.rint(alg.client_upload(data, numpy_rng(0, "upload", 1, "c0"))["mu"][:, 0]).astype(int)) for _ in range(2)
    ]
    seeds = set(
        sample_statistics(data.stats_mu, data.stats_sigma, 0.1, numpy_rng(0, "upload", 1, "c0"))[0][:, 0].astype(int)
    )
    assert len(picked[0]) == len(seeds) == 20
    assert picked[0] != seeds and picked[1] != seeds and picked[0] != picked[1]


def test_a_channel_released_without_its_mechanism_is_refused_naming_the_key():
    """FedCCRL with DP on the weights only would release its exact statistics rows while reporting an epsilon;
    any algorithm with DP off on the weights would release exact weights."""
    with pytest.raises(ValueError, match="train.privacy.statistics: fedccrl uploads statistics rows every round"):
        _train({"enabled": True, "statistics": False})
    with pytest.raises(ValueError, match="train.privacy.weights: fedccrl releases its weights every round"):
        _train({"enabled": True, "weights": False})
    with pytest.raises(ValueError, match="train.privacy.weights: fedavg releases its weights"):
        _train({"enabled": True, "weights": False}, algorithm="fedavg")
    _train({"enabled": True, "statistics": True}, algorithm="fedavg")  # nothing to noise: accepted, not charged


def test_weights_only_dp_for_fedccrl_is_refused_when_params_yaml_is_read(tmp_path):
    """The same refusal at validation, before any stage works: params.yaml with FedCCRL to train and
    train.privacy {enabled: true, statistics: false} is a ParamError naming the key."""
    import yaml

    from fedccrl_pipeline.params import load_config
    from fedccrl_pipeline.params_yaml import read_yaml

    d = read_yaml(ROOT / "params.yaml")
    d["train"]["algorithms"] = ["fedccrl", "fedavg"]
    d["train"]["privacy"] = {"enabled": True, "statistics": False}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ParamError, match="key 'train.privacy.statistics': got False; fedccrl uploads statistics"):
        load_config(tmp_path / "params.yaml")
    d["train"]["algorithms"] = ["fedavg"]  # FedAvg uploads no statistics: nothing to refuse
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(d))
    assert load_config(tmp_path / "params.yaml").train.privacy.on_weights


def test_max_epsilon_stops_before_any_release_of_the_round_that_would_pass_it():
    priv = {"enabled": True, "stats_noise_multiplier": 2.0, "weights_noise_multiplier": 4.0}
    full = _train(priv, rounds=4)
    eps = [r.metric(contract.DP_EPSILON) for r in full.history]
    limit = (eps[1] + eps[2]) / 2  # round 3 would cross it
    logs = []
    collected = []

    class Counting(InProcessTransport):  # counts the statistics uploads collected (their release) per round
        def collect_uploads(self, rnd, charged=None):
            collected.append(rnd)
            return super().collect_uploads(rnd, charged)

    class CountingEngine(InProcessEngine):
        transport_class = Counting

    res = _train({**priv, "max_epsilon": limit}, rounds=4, log=logs.append, engine=CountingEngine)
    assert collected == [1, 2]  # round 3's statistics never left the clients
    assert len(res.history) == 2 and res.history[-1].metric(contract.DP_EPSILON) <= limit
    stop = [m for m in logs if "privacy budget: round 3" in m]
    assert stop and "max_epsilon" in stop[0] and f"epsilon spent (the ledger): {eps[1]:.3f}" in stop[0]
    with pytest.raises(ValueError, match="no round completed"):
        _train({**priv, "max_epsilon": 1e-3})


def test_fedavg_is_not_charged_for_statistics_it_does_not_release():
    """FedAvg with statistics: true uploads no rows: its epsilon is the weights channel's alone, and a budget of
    exactly its R rounds lets it run all R."""
    priv = {"enabled": True, "statistics": True, "weights_noise_multiplier": 4.0}
    full = _train(priv, rounds=3, algorithm="fedavg")
    last = full.history[-1]
    assert contract.DP_EPSILON_STATISTICS not in last
    s = PrivacySettings(**priv)
    weights_only = A.epsilon_of([A.weights_event(s, 4, 4)] * 3, s.delta)
    assert last.metric(contract.DP_EPSILON) == pytest.approx(weights_only, rel=1e-12)
    res = _train({**priv, "max_epsilon": weights_only * (1 + 1e-9)}, rounds=3, algorithm="fedavg")
    assert len(res.history) == 3


def test_algorithms_the_mechanisms_do_not_cover_declare_it_and_are_refused():
    """An algorithm whose hooks release what train.privacy does not cover (an upload other than the statistics rows,
    an aggregation other than Eq. 2) declares why in its Params (`dp_refusal`, read by params.yaml's validation
    without torch); the round loop refuses it naming train.privacy.enabled. The declaration and the hooks agree for
    every registered algorithm."""
    from fedccrl_core.algorithms import ALGORITHMS
    from fedccrl_core.federation.round_privacy import uncovered_release

    refused = []
    for name, cls in ALGORITHMS.items():
        hp = {"adain_weights": "random"} if name == "ccst" else None
        alg = build_algorithm(name, LocalConfig(rounds=1), hp)
        assert bool(cls.Params.dp_refusal) == bool(uncovered_release(alg)), name
        if cls.Params.dp_refusal:
            refused.append(name)
    assert refused == ["ccst", "ga", "fediir", "fedomg", "fedccrl_omg"]
    with pytest.raises(ValueError, match="train.privacy.enabled: ga: GA weighs the clients by their generalization"):
        _train({"enabled": True, "statistics": False}, algorithm="ga")


def test_algorithms_without_a_mechanism_are_refused_at_validation(tmp_path):
    """params.yaml with train.privacy on and an algorithm that has no mechanism to train: one ParamError line per
    such algorithm, naming train.privacy.enabled and what to change, before any stage works (no MLflow run)."""
    import yaml

    from fedccrl_pipeline.params import load_config
    from fedccrl_pipeline.params_yaml import read_yaml

    d = read_yaml(ROOT / "params.yaml")
    d["train"]["algorithms"] = ["fedavg", "ga", "fedccrl_omg"]
    d["train"]["privacy"] = {"enabled": True}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ParamError) as err:
        load_config(tmp_path / "params.yaml")
    lines = [line for line in str(err.value).splitlines() if "train.privacy.enabled" in line]
    assert len(lines) == 2 and "ga cannot train under train.privacy" in lines[0], str(err.value)
    assert "leave fedccrl_omg out of train.algorithms" in lines[1], str(err.value)
    d["train"]["algorithms"] = ["fedavg"]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(d))
    assert load_config(tmp_path / "params.yaml").train.privacy.enabled


def _wbk19_theorem27_rdp(q: float, z: float, orders) -> np.ndarray:
    """RDP at the integer `orders` of the Gaussian of noise multiplier z on a sample of a fraction q drawn without
    replacement, replace-one neighbours: Wang, Balle, Kasiviswanathan, "Subsampled Renyi Differential Privacy and
    Analytical Moments Accountant", AISTATS 2019, Theorem 27 (arXiv:1808.00087v2):
      (alpha - 1) eps(alpha) <= log(1 + q^2 C(alpha, 2) min(4 (e^eps(2) - 1), 2 e^eps(2))
                                   + sum_{j=3..alpha} q^j C(alpha, j) min(4 sqrt(|D^(2 floor(j/2))| |D^(2 ceil(j/2))|),
                                                                          2 e^((j - 1) eps(j))))
    with eps(a) = a / (2 z^2) the Gaussian's RDP and D^l the l-th forward difference at 0 of x -> e^((x - 1) eps(x)).
    Computed here in 300-digit decimals (the alternating sums of the forward differences cancel heavily)."""
    from decimal import Decimal, localcontext

    top = int(max(orders))
    out = []
    with localcontext() as ctx:
        ctx.prec = 300
        q, s2 = Decimal(q), 2 * Decimal(z) ** 2
        h = [(Decimal((x - 1) * x) / s2).exp() for x in range(top + 2)]  # e^((x - 1) eps(x))
        diff = [abs(sum((-1) ** (j - i) * math.comb(j, i) * h[i] for i in range(j + 1))) for j in range(top + 2)]
        e2 = (2 / s2).exp()
        for alpha in orders:
            alpha = int(alpha)
            a = 1 + q**2 * math.comb(alpha, 2) * min(4 * (e2 - 1), 2 * e2)
            for j in range(3, alpha + 1):
                a += (
                    q**j
                    * math.comb(alpha, j)
                    * min(4 * (diff[2 * (j // 2)] * diff[2 * ((j + 1) // 2)]).sqrt(), 2 * h[j])
                )
            out.append(float(a.ln()) / (alpha - 1))
    return np.array(out)


@pytest.mark.parametrize("n, k, z", [(108, 11, 1.0), (108, 11, 4.0), (60, 6, 2.5)])
def test_accountant_own_path_matches_wbk19_theorem27(n, k, z):
    """The project's statistics event (k of n rows without replacement, REPLACE_ONE) over 10 rounds: epsilon at
    delta 1e-5 from dp_accounting through accountant.py, against Theorem 27 computed in this test and converted as
    Balle et al. 2020, Prop. 12 (hand_epsilon), on the integer orders 2..64. (108, 11, 1.0) is the default
    setting of docs/privacy.md: 8 clients of 108 images, r = 0.1, z_s = 1."""
    orders = np.arange(2, 65)
    s = PrivacySettings(enabled=True, stats_noise_multiplier=z)
    ours = A.epsilon_of([A.statistics_event(s, {"c": (n, k)})] * 10, 1e-5, orders=list(orders))
    rdp = _wbk19_theorem27_rdp(k / n, z, orders)
    assert ours == pytest.approx(hand_epsilon(rdp, orders.astype(float), 10, 1e-5), rel=1e-9)
    full = A.epsilon_of([A.statistics_event(s, {"c": (n, n)})] * 10, 1e-5, orders=list(orders))
    assert ours < full  # and the sample amplifies


def test_tradeoff_calibration_reaches_the_target_epsilon():
    """scripts/privacy_tradeoff.py's bisection: the multipliers it returns spend the target epsilon over the
    rounds, as the round loop's accountant composes them (6 clients of 108 images, r = 0.1, 10 rounds)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("privacy_tradeoff", ROOT / "scripts" / "privacy_tradeoff.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    sizes = {f"c{i}": (108, 11) for i in range(6)}
    for target, (stats, weights, release) in ((8.0, (True, True, "moments")), (1.0, (True, True, "rows"))):
        s = PrivacySettings.from_mapping(script.calibrate(target, stats, weights, release, 10, 6, sizes))
        assert (s.on_statistics, s.on_weights, s.stats_release) == (stats, weights, release)
        run = A.RunPrivacy(s)
        for t in range(1, 11):
            run.statistics(t, sizes)
            run.weights(t, 6, 6)
        assert run.record()[contract.DP_EPSILON] == pytest.approx(target, rel=1e-3)


def test_a_seeded_noise_needs_the_environment_to_say_not_private(monkeypatch):
    """train.privacy.noise_seed (tests only: anyone with the params file removes the noise) is refused, naming the
    key and the variable, unless FEDCCRL_NOT_PRIVATE=1 says where the run starts that it is not private."""
    from fedccrl_core.foundation.hparams import validate
    from fedccrl_core.privacy.settings import NOT_PRIVATE_VARIABLE

    monkeypatch.delenv(NOT_PRIVATE_VARIABLE, raising=False)
    with pytest.raises(ParamError, match=rf"train.privacy.noise_seed.*not private.*{NOT_PRIVATE_VARIABLE}=1"):
        validate(PrivacySettings, {"enabled": True, "noise_seed": 3}, prefix="train.privacy")
    assert validate(PrivacySettings, {"enabled": True}, prefix="train.privacy").noise_seed is None
    monkeypatch.setenv(NOT_PRIVATE_VARIABLE, "1")
    assert validate(PrivacySettings, {"enabled": True, "noise_seed": 3}, prefix="train.privacy").seeded


def test_a_run_is_private_only_when_its_privacy_is_enabled():
    # LocalConfig.private decides the held-out split (shards.held_out_parts), a site's pin and Flower's state cleanup
    assert not LocalConfig().private
    assert not LocalConfig(privacy=PrivacySettings()).private  # train.privacy present, enabled: false
    assert LocalConfig(privacy=PrivacySettings(enabled=True)).private
