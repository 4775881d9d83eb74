"""The audit of the statistics upload (fedccrl_core/privacy/audit.py, fedccrl_core/federation/capture.py,
pipeline/fedccrl_pipeline/audit.py).

`fedccrl audit`, the one-run canary audit of what the engine uploads: its p-value and epsilon lower bound (Steinke
et al. 2023), its decision on exact and on noised releases, the capture of the engine's uploads with the round
loop's accounting, and the command: exit 0 on the default DP run, exit 1 with the noise removed or the upload
broken (full tier).

The membership measurement of real images on a replay of the engine's draw (`audit`, scripts/privacy_audit.py):
the attacks find what was released when nothing protects it; the likelihood-ratio attack, which knows the
mechanism, finds more than the nearest row under noise; at the default DP settings the TPR stays within what
epsilon allows."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest

from fedccrl_core.data.pools import unbiased_sigma, upload_size
from fedccrl_core.privacy.audit import Client, audit, bound, clopper_pearson, release, threshold_at_fpr, tpr_at_fpr
from fedccrl_core.privacy.settings import PrivacySettings


def clients(n_each=300, seed=0, domains=("a", "a", "b", "b")) -> list[Client]:
    rng = np.random.default_rng(seed)
    out = []
    for i, dom in enumerate(domains):
        shift = 0.0 if dom == "a" else 0.8
        out.append(
            Client(
                f"{dom}{i}",
                dom,
                rng.normal(shift, 0.5, (n_each, 3)).astype(np.float32),
                np.abs(rng.normal(0.6 + shift / 4, 0.2, (n_each, 3))).astype(np.float32),
                hw=32 * 32,
            )
        )
    return out


def test_without_noise_tpr_at_low_fpr_is_the_released_share():
    res = audit(clients(), 0.1, 3, seed=0, privacy=PrivacySettings())
    for rec in res["rounds"]:
        assert "lr/auc" not in rec and math.isinf(rec["epsilon_statistics"])  # no mechanism: nothing to model
        for f in (0.001, 0.01):  # a released row is found exactly; the FPR is the one chosen on calibration
            assert rec[f"nearest/tpr_hi@{f:g}"] >= rec["released_share"] >= rec[f"nearest/tpr_lo@{f:g}"] - 0.02
            assert rec[f"nearest/fpr_lo@{f:g}"] <= f
    shares = [r["released_share"] for r in res["rounds"]]
    assert shares == sorted(shares) and shares[-1] == pytest.approx(1 - 0.9**3, abs=0.05)
    assert res["attribution"]["domain_accuracy"] > res["attribution"]["domain_chance"] + 0.2
    assert not res["violated"] and res["noise"] == "off"


@pytest.mark.parametrize("stats_release", ["rows", "moments"])
def test_with_strong_noise_tpr_is_near_the_fpr(stats_release, not_private):
    strong = PrivacySettings(enabled=True, stats_noise_multiplier=5.0, stats_release=stats_release, noise_seed=1)
    res = audit(clients(), 0.1, 3, seed=0, privacy=strong)
    for rec in res["rounds"]:
        for attack in ("nearest", "lr") if stats_release == "rows" else ("nearest",):
            # TPR indistinguishable from the FPR: their intervals overlap
            assert rec[f"{attack}/tpr_lo@0.01"] <= rec[f"{attack}/fpr_hi@0.01"]
            assert rec[f"{attack}/fpr_lo@0.01"] <= rec[f"{attack}/tpr_hi@0.01"] and rec[f"{attack}/tpr@0.01"] < 0.05
            assert abs(rec[f"{attack}/auc"] - 0.5) < 0.06
    assert ("lr/auc" in res["rounds"][0]) == (stats_release == "rows")  # the LR attack models the rows release


@pytest.mark.parametrize("noise_seed", [3, 4])
def test_the_likelihood_ratio_attack_finds_more_than_the_nearest_row_under_noise(noise_seed, not_private):
    """z_s = 0.015 (noise std 0.13 per coordinate against rows spread 0.5), 4 rounds: the mechanism-aware score
    finds members well above FPR 1 %, more than the nearest row does, with a larger AUC. Seeded noise (the
    test switch): fixed numbers (LR 0.102 / 0.098 against nearest 0.058 / 0.037 when written)."""
    weak = PrivacySettings(enabled=True, stats_noise_multiplier=0.015, noise_seed=noise_seed)
    last = audit(clients(), 0.1, 4, seed=0, privacy=weak)["rounds"][-1]
    assert last["lr/tpr_lo@0.01"] > 0.05 and last["lr/tpr_lo@0.01"] > last["lr/fpr_hi@0.01"]
    assert last["lr/tpr@0.01"] > last["nearest/tpr@0.01"] and last["lr/auc"] > last["nearest/auc"]


def test_at_the_default_dp_settings_the_tpr_lies_within_the_bound():
    """docs/privacy.md's setting: 8 clients of 108 images (two per domain), r = 0.1, 10 rounds, train.privacy at
    its defaults (z_s = 1, the default box), noise from the OS. Each attack's TPR at FPR 1 % has its interval's
    lower end at or below e^eps FPR_hi + delta, eps the statistics channel's after the round."""
    res = audit(
        clients(108, domains=("a", "a", "b", "b", "c", "c", "d", "d")),
        0.1,
        10,
        seed=0,
        privacy=PrivacySettings(enabled=True),
    )
    eps = [r["epsilon_statistics"] for r in res["rounds"]]
    assert all(0 < a < b for a, b in itertools.pairwise(eps)) and eps[-1] == pytest.approx(4.644, abs=0.01)
    for rec in res["rounds"]:
        for attack in ("nearest", "lr"):
            assert rec[f"{attack}/tpr_lo@0.01"] <= rec[f"{attack}/bound@0.01"]
            assert rec[f"{attack}/bound@0.01"] == pytest.approx(
                min(1.0, math.exp(rec["epsilon_statistics"]) * rec[f"{attack}/fpr_hi@0.01"] + 1e-5)
            )
    assert not res["violated"]


def test_a_mechanism_weaker_than_its_epsilon_is_flagged(monkeypatch):
    """The check can fail: the rows leave unnoised while train.privacy claims z_s = 5 (eps about 0.1 after 3
    rounds). Every released row is found at FPR 0: the TPR's interval lies far above e^eps FPR_hi + delta."""
    import fedccrl_core.privacy.audit as audit_module

    monkeypatch.setattr(audit_module, "privatize", lambda mu, sigma, s, rng: (mu, sigma))
    res = audit(clients(), 0.1, 3, seed=0, privacy=PrivacySettings(enabled=True, stats_noise_multiplier=5.0))
    last = res["rounds"][-1]
    assert last["epsilon_statistics"] < 0.5
    assert last["nearest/violated@0.01"] and last["nearest/tpr_lo@0.01"] > last["nearest/bound@0.01"]
    assert res["violated"]


def test_release_replays_the_engines_draw():
    """Without DP, the rows the audit replays are those StatisticsExchange.client_upload sends: the same
    generator. With DP on the statistics they come from the OS: another replay of the same seed differs."""
    from fedccrl_core.data.pools import sample_statistics
    from fedccrl_core.foundation.seeding import numpy_rng

    c = clients()[0]
    rows, chosen = release(c, 0.1, 7, 3, PrivacySettings())
    mu, sigma = sample_statistics(c.mu, c.sigma, 0.1, numpy_rng(7, "upload", 3, c.client_id))
    assert np.array_equal(rows, np.concatenate([mu, sigma], 1).astype(np.float64))
    assert len(chosen) == upload_size(300, 0.1) and np.array_equal(c.rows[chosen], rows)
    on = PrivacySettings(enabled=True)
    assert not np.array_equal(release(c, 0.1, 7, 3, on)[1], release(c, 0.1, 7, 3, on)[1])


def test_upload_floor_unbiased_is_honoured():
    """train.fedccrl.upload floor_unbiased: floor(r n_i) rows, sigma the unbiased std (FedCCRL.client_upload)."""
    c = clients(105)[0]
    rows, chosen = release(c, 0.1, 0, 1, PrivacySettings(), upload="floor_unbiased")
    assert len(chosen) == 10 and len(release(c, 0.1, 0, 1, PrivacySettings())[1]) == 11
    assert np.array_equal(rows[:, 3:], unbiased_sigma(c.sigma, 32 * 32)[chosen].astype(np.float64))
    res = audit(clients(105), 0.1, 2, seed=0, privacy=PrivacySettings(), upload="floor_unbiased")
    assert res["upload"] == "floor_unbiased"
    assert res["rounds"][0]["nearest/tpr@0.01"] >= res["rounds"][0]["released_share"] - 0.05
    with pytest.raises(ValueError, match="train.fedccrl.upload must be one of ceil, floor_unbiased"):
        release(c, 0.1, 0, 1, PrivacySettings(), upload="floor")


def test_clopper_pearson_and_the_threshold():
    """The interval's closed forms at the ends: x = 0 -> [0, 1 - (a/2)^(1/n)], x = n -> [(a/2)^(1/n), 1]; and
    the interval of 5 of 10 from beta quantiles (Clopper & Pearson 1934, tabulated: 0.187, 0.813)."""
    assert clopper_pearson(0, 10) == (0.0, pytest.approx(1 - 0.025**0.1))
    assert clopper_pearson(10, 10) == (pytest.approx(0.025**0.1), 1.0)
    lo, hi = clopper_pearson(5, 10)
    assert lo == pytest.approx(0.187, abs=1e-3) and hi == pytest.approx(0.813, abs=1e-3)
    cal = np.arange(1000.0)  # FPR 1 %: at most 10 of the 1000 above the threshold
    t = threshold_at_fpr(cal, 0.01)
    assert (cal > t).sum() == 10
    assert bound(math.log(2.0), 0.01, 1e-5) == pytest.approx(0.02001) and bound(float("inf"), 0.01, 1e-5) == 1.0


def test_tpr_at_fpr_reads_the_roc():
    assert tpr_at_fpr(np.array([3.0, 2.0, 0.5]), np.linspace(0, 1, 100), 0.01) == pytest.approx(2 / 3)


def test_audit_stage_writes_table_plot_and_json(tmp_path):
    """The command's table names the verdict and the numbers it rests on (the epsilon lower bound and the reach);
    the plot is a PNG; the record is JSON."""
    from fedccrl_core.privacy.canary_audit import CanaryAudit, one_run_audit
    from fedccrl_pipeline.audit_report import plot, table

    coins = np.random.default_rng(0).random(600) < 0.5
    scores = np.where(coins, 1.0, -1.0) * (np.arange(600) < 300)  # half the slots seen, every one right
    found = one_run_audit(coins, scores, 300, 2.0, 1e-5)
    run = dict(
        rounds=1,
        attack="rows",
        copies=2,
        clients=2,
        slots_per_client=3,
        r=0.5,
        upload="ceil",
        seed=0,
        guess_share=0.6,
        noise="OS entropy",
        privacy={"enabled": True},
        scores=list(scores),
        coins=[bool(x) for x in coins],
    )
    res = CanaryAudit(**dataclasses.asdict(found), **run)
    lines = table(res)
    lb, reach = res.epsilon_lower_bound, res.epsilon_reach
    assert lb == reach and lb > 2.0 and res.violated and res.testable and res.verdict() == "DP violated"
    assert lines[2].startswith("| 1 | rows | 600 | 300 | 300 | 1.000 [") and "**DP violated**" in lines[2]
    assert f"| {lb:.2f} | {reach:.2f} |" in lines[2]
    assert lines[-1].startswith("FAILURE")
    beyond = CanaryAudit(**dataclasses.asdict(one_run_audit(coins, scores, 300, 8.0, 1e-5)), **run)
    assert not beyond.violated and not beyond.testable  # 300 guesses cannot refute eps 8
    assert "**beyond reach**" in table(beyond)[2] and table(beyond)[-1].startswith("WARNING")
    assert CanaryAudit(**{**dataclasses.asdict(beyond), "privacy": None}).verdict() == "no DP claim"
    plot(res, tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads(json.dumps(dataclasses.asdict(res)))["correct"] == 300  # plain numbers only


def test_one_client_per_domain_is_refused_naming_the_setting():
    """Without a second client of the same domain there are no non-members: a clear error, not a table."""
    one_each = [c for c in clients() if c.client_id in ("a0", "b2")]
    with pytest.raises(ValueError, match="clients_per_domain >= 2"):
        audit(one_each, 0.1, 2, seed=0, privacy=PrivacySettings())


def test_audit_command_names_a_missing_shard_manifest_and_writes_nothing(tmp_path):
    from click.testing import CliRunner

    from fedccrl_pipeline.audit import command

    out = tmp_path / "audit.json"
    res = CliRunner().invoke(
        command,
        [
            "--shards",
            str(tmp_path / "none"),
            "--pools",
            str(tmp_path / "nopools"),
            "--out",
            str(out),
            "--table",
            str(tmp_path / "a.md"),
            "--plot",
            str(tmp_path / "a.png"),
        ],
    )
    assert res.exit_code == 2 and f"{tmp_path / 'none'}/manifest.json" in res.output + (res.stderr or "")
    assert not list(tmp_path.glob("a.*")) and not out.exists()


@pytest.fixture(scope="module")
def default_data(tmp_path_factory):
    """The default data's shards and pools (8 clients of 108 images), made by the CLI in a scratch folder."""
    import subprocess
    import sys
    from pathlib import Path

    ws = tmp_path_factory.mktemp("audit-data")
    repo, fedccrl = Path(__file__).resolve().parents[1], Path(sys.executable).parent / "fedccrl"
    (ws / "params.yaml").write_text((repo / "params.yaml").read_text())
    for args in (
        ["download", "--out", "data/raw", "--report", "data/download.json"],
        ["partition", "--raw", "data/raw", "--out", "data/shards"],
        ["pools", "--shards", "data/shards", "--out", "data/pools"],
    ):
        p = subprocess.run([str(fedccrl), *args], cwd=ws, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-3000:]
    return ws / "data"


def _dp_params(tmp_path, privacy: dict):
    from pathlib import Path

    import yaml

    d = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    d["train"]["rounds"], d["train"]["privacy"] = 3, privacy
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(d, sort_keys=False))
    return tmp_path / "params.yaml"


# ---------------------------------------------------------------- the one-run canary audit (`fedccrl audit`)
def test_one_run_p_value_is_the_binomial_tail_plus_the_delta_term():
    """delta = 0: P[Bin(r, e^eps / (1 + e^eps)) >= v] (r = v: p^r in closed form); delta > 0 adds
    2 m delta max_i P[v > Bin >= v - i] / i; the p-value grows with eps; the lower bound is where it crosses 0.05."""
    from scipy.stats import binom

    from fedccrl_core.privacy.canary_audit import epsilon_lower_bound, one_run_p_value

    p = 1 / (1 + math.exp(-2.0))
    assert one_run_p_value(500, 100, 100, 2.0, 0.0) == pytest.approx(p**100)
    assert one_run_p_value(500, 100, 80, 2.0, 0.0) == pytest.approx(binom.sf(79, 100, p))
    extra = max(sum(binom.pmf(80 - j, 100, p) for j in range(1, i + 1)) / i for i in range(1, 81))
    assert one_run_p_value(500, 100, 80, 2.0, 1e-4) == pytest.approx(binom.sf(79, 100, p) + 2 * 500 * 1e-4 * extra)
    ps = [one_run_p_value(864, 426, 426, e, 1e-5) for e in (3.0, 4.0, 4.64, 6.0)]
    assert ps == sorted(ps) and ps[2] < 0.05 < ps[3]  # 426 of 426 refute the default run's 4.64, not 6
    # docs/privacy.md's p-value with the noise removed, at the default run's eps 4.644097 (the accountant's)
    assert one_run_p_value(864, 426, 426, 4.644097, 1e-5) == pytest.approx(0.0196, abs=5e-5)
    lb = epsilon_lower_bound(864, 426, 426, 1e-5)
    assert 4.64 < lb < 6.0 and one_run_p_value(864, 426, 426, lb, 1e-5) == pytest.approx(0.05, abs=1e-4)
    assert epsilon_lower_bound(864, 426, 213, 1e-5) == 0.0  # a coin's accuracy refutes nothing
    # docs/privacy.md's contrast: 288 non-members, no false positive, FPR_hi 0.0127: e^eps FPR_hi >= 1 from 4.36
    fpr_hi = clopper_pearson(0, 288)[1]
    assert fpr_hi == pytest.approx(0.0127, abs=5e-5) and -math.log(fpr_hi) == pytest.approx(4.36, abs=0.005)
    assert bound(4.37, fpr_hi, 1e-5) == 1.0 and bound(4.35, fpr_hi, 1e-5) < 1.0
    assert one_run_p_value(10, 5, 5, float("inf"), 1e-5) == 1.0
    with pytest.raises(ValueError, match="correct"):
        one_run_p_value(10, 5, 6, 1.0, 0.0)


def test_canaries_lie_outside_the_box_each_corner_once_per_client():
    """Every row a client holds is a corner of the clipping box pushed OUTSIDE it (sigma's low side on its face):
    the clip moves every one. Slot j's rows are complements with C bits set each; the fillers are corner 0; within a
    client every corner, and every corner's mu part, is distinct; the coins are fair."""
    from fedccrl_core.foundation.seeding import numpy_rng
    from fedccrl_core.privacy.canary_audit import OUTSIDE, box, make_canaries, slot_patterns
    from fedccrl_core.privacy.dp import clip_rows

    s = PrivacySettings()
    lo, hi = box(s, 3)
    c = make_canaries({"a": 108, "b": 50}, 3, s, numpy_rng(0, "t"))
    pats = slot_patterns(3)
    assert (pats[:, 0] == ~pats[:, 1]).all() and (pats.sum(axis=2) == 3).all()
    assert len({tuple(p[:3]) for p in pats.reshape(-1, 6)} | {(False,) * 3}) == 7  # mu parts and the fillers'
    rows = c.rows_of("a")
    assert rows.shape == (108, 6) and len(c.rows_of("b")) == 50
    d = OUTSIDE * float(np.linalg.norm(hi - lo))
    assert np.allclose(np.abs(rows[:, :3] - (lo[:3] + hi[:3]) / 2), (hi[:3] - lo[:3]) / 2 + d)  # beyond mu's faces
    assert ((rows[:, 3:] == lo[3:]) | np.isclose(rows[:, 3:], hi[3:] + d)).all()
    cmu, _ = clip_rows(rows[:, :3], rows[:, 3:], s)
    assert not np.isclose(cmu, rows[:, :3]).any() and (np.isin(cmu, [lo[0], hi[0]])).all()
    assert len(np.unique(rows[:3], axis=0)) == 3 and (rows[3:] == rows[-1]).all()  # slots, then one filler corner
    held = np.where(c.coin[:3, None], pats[:, 0], pats[:, 1])
    assert np.array_equal(rows[:3] > (lo + hi) / 2, held)
    many = make_canaries({f"c{i}": 20 for i in range(300)}, 3, s, numpy_rng(1, "t"))
    assert 400 < many.coin.sum() < 500
    with pytest.raises(ValueError, match="clients b hold 3 images or fewer"):
        make_canaries({"a": 10, "b": 3}, 3, s, numpy_rng(0, "t"))


def test_the_attacks_read_corners_and_spreads():
    """rows: a row is read as the mu corner whose faces (or beyond) each mu coordinate lies within TAU widths of,
    weighted 1 on the faces, falling to 0 at the band's edge; moments: the coordinates on which a round's rows
    differ."""
    from fedccrl_core.privacy.canary_audit import box, mu_corner, spread_pattern

    lo, hi = box(PrivacySettings(), 3)  # mu [-2.2, 2.7] (width 4.9), sigma [0, 1.5]
    rows = np.array(
        [
            [-9.0, 2.7, -2.2, 0.5, 0.5, 0.5],  # beyond lo, on hi, on lo: corner 0b010, weight 1
            [-2.2 + 0.49, 2.7, 2.7, 0, 0, 0],  # half the band inside lo: corner 0b110, weight 0.5
            [0.0, 2.7, 2.7, 0, 0, 0],  # mu_0 in the middle: no corner
        ]
    )
    code, weight = mu_corner(rows, lo, hi)
    assert code.tolist() == [2, 6, -1] and weight[0] == 1.0 and weight[1] == pytest.approx(0.5) and weight[2] == 0
    same = np.tile([2.7, -2.2, 2.7, 1.5, 0.0, 0.0], (11, 1))
    assert not spread_pattern(same, lo, hi).any()
    same[:, [0, 4]] += np.linspace(-0.5, 0.0, 11)[:, None]
    assert spread_pattern(same, lo, hi).tolist() == [True, False, False, False, True, False]


def _default_sized_clients(n_clients=8, n=108):
    """The default data's federation in memory: 8 clients of 108 images (tiny ones: the audit reads only their
    number and size)."""
    from fedccrl_core.learning.clients import ClientData

    x = np.zeros((n, 8, 8, 3), np.uint8)
    y = np.zeros(n, np.int64)
    stats = np.zeros((n, 3), np.float32)
    return [ClientData.from_numpy(f"c{i}", "d", x, y, x[:2], y[:2], "cpu", stats, stats) for i in range(n_clients)]


@pytest.mark.parametrize(
    "fault, stats_release",
    [
        (None, "rows"),
        ("noise/10", "rows"),
        ("skipped clip", "rows"),
        (None, "moments"),
        ("moments exact", "moments"),
    ],
)
def test_the_audit_catches_each_fault_at_the_default_settings(monkeypatch, fault, stats_release):
    """At the defaults (8 clients of 108 images, r = 0.1, 10 rounds, z_s = 1: eps 4.64, noise from the OS) with the
    audit's 100 copies: the intact mechanism (rows or moments) passes, its guesses a coin's; with the rows' noise
    cut to 1/10 (true eps about 655), with the first clip skipped, or with the moment sums released without noise
    (tests/audit_faults.py, monkeypatched into privacy/dp.py), every guess is right and the eps lower bound, about
    5.7 (the reach), exceeds 4.64: `violated`."""
    from audit_faults import inject

    from fedccrl_core.algorithm_params.train import LocalConfig
    from fedccrl_core.algorithms.fedccrl import FedCCRL
    from fedccrl_pipeline.audit import audit_clients

    if fault is not None:
        inject(monkeypatch, fault)
    on = PrivacySettings(enabled=True, stats_release=stats_release)
    res = audit_clients(FedCCRL(LocalConfig(privacy=on), {"r": 0.1}), _default_sized_clients(), 0, 10)
    assert res.epsilon_statistics == pytest.approx(4.644, abs=0.01) and res.slots == 2400
    assert res.guesses == math.floor(0.6 * 2400 * (1 - (1 - 11 / 108) ** 10)) and res.testable
    assert res.epsilon_reach == pytest.approx(5.69, abs=0.01) and res.attack == stats_release
    if fault is None:
        assert not res.violated and res.epsilon_lower_bound < 1.0 and res.precision_lo < 0.6
    else:
        assert res.violated and res.guesses - res.correct <= 1 and res.epsilon_lower_bound > 5.2


def test_without_dp_every_guess_is_right_and_nothing_is_claimed():
    """No train.privacy: the rows leave as they are held, every guess is right, the reach is reached, and no eps is
    claimed, so nothing is violated."""
    from fedccrl_core.algorithm_params.train import LocalConfig
    from fedccrl_core.algorithms.fedccrl import FedCCRL
    from fedccrl_pipeline.audit import audit_clients

    res = audit_clients(FedCCRL(LocalConfig(), {"r": 0.1}), _default_sized_clients(), 0, 10, copies=20)
    assert res.correct == res.guesses and res.epsilon_lower_bound == res.epsilon_reach > 4
    assert math.isinf(res.epsilon_statistics) and not res.violated and res.privacy is None


def _tiny_clients(n=40):
    from fedccrl_core.learning.clients import ClientData

    rng = np.random.default_rng(0)
    out = []
    for i in range(3):
        x = rng.integers(0, 255, (n, 8, 8, 3), dtype=np.uint8)
        y = rng.integers(0, 2, n)
        mu = rng.normal(0, 0.5, (n, 3)).astype(np.float32)
        sigma = np.abs(rng.normal(0.6, 0.2, (n, 3))).astype(np.float32)
        out.append(ClientData.from_numpy(f"c{i}", "d", x, y, x[:2], y[:2], "cpu", mu, sigma))
    return out


def test_capture_records_the_engines_uploads_and_the_loops_epsilon():
    """capture_statistics runs the engine's uploads phase: without DP its rows are those FedCCRL.client_upload
    sends from the run seed's generator (the same draws, replayed here); with DP its epsilon is the accountant's
    over the uploads' sizes, and the uploads are noised (no row equals a held one)."""
    from fedccrl_core.algorithm_params.train import LocalConfig
    from fedccrl_core.algorithms.fedccrl import FedCCRL
    from fedccrl_core.data.pools import sample_statistics
    from fedccrl_core.federation.capture import capture_statistics
    from fedccrl_core.foundation.seeding import numpy_rng
    from fedccrl_core.privacy import accountant as A

    clients = _tiny_clients()
    cap = capture_statistics(FedCCRL(LocalConfig(), {"r": 0.1}), clients, 7, 3)
    assert math.isinf(cap.epsilon) and sorted(cap.per_round) == [1, 2, 3] and cap.sizes["c0"] == (40, 4)
    for c in clients:
        want = [
            np.concatenate(sample_statistics(c.stats_mu, c.stats_sigma, 0.1, numpy_rng(7, "upload", t, c.client_id)), 1)
            for t in (1, 2, 3)
        ]
        assert np.array_equal(cap.rows[c.client_id], np.concatenate(want).astype(np.float64))
    on = PrivacySettings(enabled=True)
    dp = capture_statistics(FedCCRL(LocalConfig(privacy=on), {"r": 0.1}), clients, 7, 3)
    assert dp.epsilon == pytest.approx(A.epsilon_of([A.statistics_event(on, dp.sizes)] * 3, on.delta))
    held = np.concatenate([clients[0].stats_mu, clients[0].stats_sigma], 1).astype(np.float64)
    assert not (dp.rows["c0"][:, None, :] == held[None]).all(axis=2).any()


@pytest.mark.full("two real DP training runs (small_cnn, 3 rounds, 16 clients of 12 images), about 20 s")
@pytest.mark.parametrize("noise_removed", [False, True])
def test_a_training_run_records_its_uploads_and_the_audit_reads_them(monkeypatch, noise_removed):
    """A real DP training run (toy clients, small_cnn, 3 rounds, z_s = 5) on CapturingEngine, its clients holding
    canaries: the captured uploads are what the round loop charged (its logged statistics eps is the accountant's
    over the captured sizes), and the canary audit of them at that eps is consistent, or, with the noise removed
    inside the mechanism, refutes it with every guess right."""
    from fixtures import held_out_run
    from test_round_loop import toy_clients

    import fedccrl_core.privacy.dp as dp
    from fedccrl_core.algorithm_params.train import LocalConfig
    from fedccrl_core.algorithms import build_algorithm
    from fedccrl_core.federation.capture import CapturingEngine
    from fedccrl_core.federation.driver import build_seeded_model
    from fedccrl_core.foundation import contract
    from fedccrl_core.foundation.seeding import numpy_rng
    from fedccrl_core.privacy import accountant as A
    from fedccrl_core.privacy.canary_audit import canary_scores, make_canaries, one_run_audit, planned_guesses

    if noise_removed:
        monkeypatch.setattr(dp, "stats_noise_std", lambda s, channels: 0.0)
    on = PrivacySettings(enabled=True, stats_noise_multiplier=5.0)
    clients = toy_clients(16, 12)
    c = make_canaries({x.client_id: x.n_train for x in clients}, 3, on, numpy_rng(0, "canaries"))
    for x in clients:
        held = c.rows_of(x.client_id)
        x.stats_mu, x.stats_sigma = held[:, :3], held[:, 3:]
    alg = build_algorithm("fedccrl", LocalConfig(rounds=3, local_epochs=1, batch_size=8, privacy=on), {"r": 0.2})
    model = build_seeded_model(alg, "small_cnn", 6, "none", 0)
    run = held_out_run(alg, model, clients, (clients[0].train_x, clients[0].train_y), 3)
    engine = CapturingEngine(
        run.algorithm, run.model, run.clients, run.evalsets, run.rounds, run.seed, log=lambda m: None
    )
    history = engine.run().history
    captured = engine.transport.captured
    assert sorted(captured) == [1, 2, 3]
    sizes = {cid: (12, len(u["mu"])) for cid, u in captured[3].items()}
    eps = history[-1].metric(contract.DP_EPSILON_STATISTICS)
    assert eps == pytest.approx(A.epsilon_of([A.statistics_event(on, sizes)] * 3, on.delta)) and eps < 1.0
    released = {
        cid: [
            np.concatenate([captured[t][cid]["mu"], captured[t][cid]["sigma"]], 1).astype(np.float64) for t in captured
        ]
        for cid in sizes
    }
    scores = canary_scores(c, released, "rows")
    res = one_run_audit(c.coin, scores, planned_guesses(sizes, dict.fromkeys(sizes, 3), 3), eps, on.delta)
    assert res.testable and res.violated is noise_removed
    assert (res.correct == res.guesses) is noise_removed


@pytest.mark.full("four runs of fedccrl audit on the default data (10 rounds each), about 15 s with the data")
@pytest.mark.parametrize("fault", [None, "noise/10", "skipped clip", "upload broken"])
def test_audit_command_exits_1_when_the_engine_releases_more_than_epsilon_allows(
    default_data, tmp_path, monkeypatch, fault
):
    """`fedccrl audit` on the default DP run (train.privacy at its defaults, 10 rounds, eps 4.64) exits 0. With the
    rows' noise cut to 1/10 or the first clip skipped inside the mechanism (tests/audit_faults.py), or with the
    engine's upload broken so that FedCCRL sends its exact rows, the audit sees it in what the engine uploaded: the
    outputs are written, the failure is printed, the exit status is 1."""
    import yaml
    from audit_faults import inject
    from click.testing import CliRunner

    from fedccrl_core.algorithms.fedccrl import StatisticsExchange
    from fedccrl_pipeline.audit import command

    if fault == "upload broken":
        monkeypatch.setattr(StatisticsExchange, "released", lambda self, upload, rng: upload)
    elif fault is not None:
        inject(monkeypatch, fault)
    params = _dp_params(tmp_path, {"enabled": True})
    d = yaml.safe_load(params.read_text())
    d["train"]["rounds"] = 10
    params.write_text(yaml.safe_dump(d, sort_keys=False))
    out = tmp_path / "audit.json"
    res = CliRunner().invoke(
        command,
        [
            "--shards",
            str(default_data / "shards"),
            "--pools",
            str(default_data / "pools"),
            "--out",
            str(out),
            "--table",
            str(tmp_path / "a.md"),
            "--plot",
            str(tmp_path / "a.png"),
            "--params",
            str(params),
        ],
    )
    text = res.output + (res.stderr or "")
    broken = fault is not None
    got = json.loads(out.read_text())
    assert "OS entropy: private, not bit-reproducible" in (tmp_path / "a.md").read_text()
    assert got["epsilon_statistics"] == pytest.approx(4.644, abs=0.01) and got["slots"] == 2400 and got["testable"]
    assert got["violated"] is broken and (got["epsilon_lower_bound"] > got["epsilon_statistics"]) is broken
    assert res.exit_code == (1 if broken else 0), text
    assert ("error: the canary audit's guesses refute epsilon" in text) is broken
