"""`fedccrl audit` (fedccrl_core/audit.py, pipeline/audit.py): the membership attack on the released statistics
finds what was released when nothing protects it, and no more than chance under strong noise."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fedccrl_core.audit import Client, audit, release, tpr_at_fpr
from fedccrl_core.data.pools import upload_size
from fedccrl_core.privacy.settings import PrivacySettings


def clients(n_each=300, seed=0) -> list[Client]:
    rng = np.random.default_rng(seed)
    out = []
    for i, dom in enumerate(["a", "a", "b", "b"]):
        shift = 0.0 if dom == "a" else 0.8
        out.append(Client(f"{dom}{i}", dom, rng.normal(shift, 0.5, (n_each, 3)).astype(np.float32),
                          np.abs(rng.normal(0.6 + shift / 4, 0.2, (n_each, 3))).astype(np.float32)))
    return out


def test_without_noise_tpr_at_low_fpr_is_the_released_share():
    res = audit(clients(), 0.1, 3, seed=0, privacy=PrivacySettings())
    for rec in res["rounds"]:
        assert rec["tpr_at_fpr_0.01"] >= rec["released_share"] - 0.01
        assert rec["tpr_at_fpr_0.001"] >= rec["released_share"] - 0.01
    shares = [r["released_share"] for r in res["rounds"]]
    assert shares == sorted(shares) and shares[-1] == pytest.approx(1 - 0.9 ** 3, abs=0.05)
    assert res["attribution"]["domain_accuracy"] > res["attribution"]["domain_chance"] + 0.2


@pytest.mark.parametrize("release", ["rows", "moments"])
def test_with_strong_noise_tpr_is_near_the_fpr(release):
    strong = PrivacySettings(enabled=True, stats_noise_multiplier=5.0, stats_release=release)
    res = audit(clients(), 0.1, 3, seed=0, privacy=strong)
    for rec in res["rounds"]:
        assert rec["tpr_at_fpr_0.01"] <= 0.01 + 0.03
        assert abs(rec["auc"] - 0.5) < 0.06


def test_release_replays_the_engines_draw():
    """The rows the audit replays are those StatisticsExchange.client_upload sends: the same generator."""
    from fedccrl_core.data.pools import sample_statistics
    from fedccrl_core.seeding import numpy_rng

    c = clients()[0]
    rows, chosen = release(c, 0.1, 7, 3, PrivacySettings())
    mu, sigma = sample_statistics(c.mu, c.sigma, 0.1, numpy_rng(7, "upload", 3, c.client_id))
    assert np.array_equal(rows, np.concatenate([mu, sigma], 1).astype(np.float64))
    assert len(chosen) == upload_size(300, 0.1) and np.array_equal(c.rows[chosen], rows)


def test_tpr_at_fpr_reads_the_roc():
    assert tpr_at_fpr(np.array([3.0, 2.0, 0.5]), np.linspace(0, 1, 100), 0.01) == pytest.approx(2 / 3)


def test_audit_stage_writes_table_plot_and_json(tmp_path):
    from pipeline.audit import plot, table

    res = audit(clients(60), 0.2, 2, seed=0, privacy=PrivacySettings())
    lines = table(res)
    assert lines[0].startswith("| round |") and len([x for x in lines if x.startswith("| 2 |")]) == 1
    plot(res, tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    json.dumps(res)  # plain numbers only


def test_one_client_per_domain_is_refused_naming_the_setting():
    """Without a second client of the same domain there are no non-members: a clear error, not a table."""
    one_each = [c for c in clients() if c.client_id in ("a0", "b2")]
    with pytest.raises(ValueError, match="clients_per_domain >= 2"):
        audit(one_each, 0.1, 2, seed=0, privacy=PrivacySettings())


def test_audit_command_names_a_missing_shard_manifest_and_writes_nothing(tmp_path):
    from click.testing import CliRunner

    from pipeline.audit import command

    out = tmp_path / "audit.json"
    res = CliRunner().invoke(command, ["--shards", str(tmp_path / "none"), "--pools", str(tmp_path / "nopools"),
                                       "--out", str(out), "--table", str(tmp_path / "a.md"),
                                       "--plot", str(tmp_path / "a.png")])
    assert res.exit_code == 2 and f"{tmp_path / 'none'}/manifest.json" in res.output + (res.stderr or "")
    assert not list(tmp_path.glob("a.*")) and not out.exists()
