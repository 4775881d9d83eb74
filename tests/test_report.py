"""The report stage's table from known inputs (mean ± std over seeds, Avg., both selections)."""

from __future__ import annotations

import csv
import json

import pytest

from fedccrl_pipeline.report import report


def _run(tmp, alg, seed, idx, dom, final, best, up=2e6, down=3e6):
    doc = {
        "dataset": "toy",
        "algorithm": alg,
        "seed": seed,
        "held_out_domain": dom,
        "held_out_index": idx,
        "final_target_acc": final,
        "best_val_target_acc": best,
        "best_round": 1,
        "per_round": [
            {"round": 1, "target_acc": final / 2, "val_acc": 0.5},
            {"round": 2, "target_acc": final, "val_acc": 0.6},
        ],
        "bytes_up_per_round": up,
        "bytes_down_per_round": down,
        "classes": ["x", "y"],
        "platform": "cpu x86_64 AVX2, torch 2.14.1",
        "n_test": 10,
        "mlflow_run_id": None,
        "final_val_acc": 0.5,
        "detail": {"final": {"target_acc": final, "round": 2}, "best_val": {"target_acc": final, "round": 1}},
    }
    p = tmp / "runs" / alg / f"s{seed}" / f"d{idx}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc))


def test_table_from_known_inputs(tmp_path):
    # fedccrl: domain a seeds 0.8/0.6 (mean 0.7, pstd 0.1), domain b 0.5/0.5; fedavg: one seed each
    _run(tmp_path, "fedccrl", 0, 0, "a", 0.8, 0.7)
    _run(tmp_path, "fedccrl", 1, 0, "a", 0.6, 0.5)
    _run(tmp_path, "fedccrl", 0, 1, "b", 0.5, 0.4)
    _run(tmp_path, "fedccrl", 1, 1, "b", 0.5, 0.6)
    _run(tmp_path, "fedavg", 0, 0, "a", 0.4, 0.4, up=1e6)
    _run(tmp_path, "fedavg", 0, 1, "b", 0.2, 0.3, up=1e6)
    m = report(
        tmp_path / "runs",
        tmp_path / "metrics.json",
        tmp_path / "table.md",
        tmp_path / "curves.csv",
        summary_out=tmp_path / "summary.json",
    )
    a = m["fedccrl"].domains["a"]
    assert (a.accuracy["final_target_acc"].mean, a.accuracy["final_target_acc"].std) == pytest.approx((0.7, 0.1))
    assert a.accuracy["final_target_acc"].n == 2 and a.seeds == [0, 1]
    assert m["fedavg"].avg == pytest.approx({"final_target_acc": 0.3, "best_val_target_acc": 0.35})
    written = json.loads((tmp_path / "metrics.json").read_text())  # the typed results as results/metrics.json
    assert written["fedccrl"]["a"] == {
        "final_target_acc": {"mean": pytest.approx(0.7), "std": pytest.approx(0.1), "n": 2},
        "best_val_target_acc": {"mean": pytest.approx(0.6), "std": pytest.approx(0.1), "n": 2},
        "seeds": [0, 1],
    }
    assert list(written["fedccrl"]) == ["a", "b", "comm_mb_per_round", "avg"]
    assert written["fedccrl"]["avg"]["final_target_acc"] == pytest.approx(0.6)
    assert written["fedccrl"]["avg"]["best_val_target_acc"] == pytest.approx((0.6 + 0.5) / 2)
    assert written["fedavg"]["avg"]["final_target_acc"] == pytest.approx(0.3)
    assert written["fedavg"]["comm_mb_per_round"] == {"up": pytest.approx(1.0), "down": pytest.approx(3.0)}
    table = (tmp_path / "table.md").read_text().splitlines()
    assert "| Algorithm | a | b | Avg. |" in table
    rows = [line for line in table if line.startswith("| fed")]
    assert rows[0] == "| fedavg | 40.00 | 20.00 | 30.00 |"  # Table 1's order: FedAvg first
    assert rows[1] == "| fedccrl | 70.00 ± 10.00 | 50.00 ± 0.00 | 60.00 |"
    assert rows[3] == "| fedccrl | 60.00 ± 10.00 | 50.00 ± 10.00 | 55.00 |"  # selected by source validation
    with open(tmp_path / "table.csv") as f:
        rec = list(csv.DictReader(f))
    assert rec[1]["algorithm"] == "fedccrl" and float(rec[1]["a_mean"]) == pytest.approx(0.7)
    with open(tmp_path / "curves.csv") as f:
        curves = list(csv.DictReader(f))
    # long form: one row per (run, held-out domain, round), `series` names the line in `dvc plots show`
    series = {}
    for r in curves:
        series.setdefault(r["series"], {})[int(r["round"])] = float(r["target_acc"])
    assert len(series) == 6 and series["fedccrl/s1/a"][2] == pytest.approx(0.6)
    assert all(sorted(v) == [1, 2] for v in series.values())
    assert {(r["algorithm"], r["seed"], r["held_out"]) for r in curves if r["series"] == "fedavg/s0/b"} == {
        ("fedavg", "0", "b")
    }
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == {"fedavg": {"a": 0.4, "b": 0.2, "avg": 0.3}, "fedccrl": {"a": 0.7, "b": 0.5, "avg": 0.6}}
    assert written == json.loads(json.dumps({alg: r.to_dict() for alg, r in m.items()}))


def test_no_results_is_a_clear_error(tmp_path):
    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match="no evaluation results"):
        report(tmp_path / "runs", tmp_path / "m.json", tmp_path / "t.md", tmp_path / "c.csv")
