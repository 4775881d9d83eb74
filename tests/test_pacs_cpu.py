"""The PACS-on-CPU recipe (`make pacs-cpu`, docs/experiments.md "PACS on a CPU") end to end at a tiny scale:
the Makefile's own command in a scratch clone, from the local PACS zip, cut to one round of one local epoch and
one held-out domain (sketch) by the recipe's PACS_CPU_EXTRA hook; everything else is the recipe's setting
(64 px, the small CNN from scratch, FedAvg and FedCCRL, seed 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedccrl_core.foundation import contract

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent.parent
TINY = "-S train.rounds=1 -S train.local_epochs=1 -S 'train.held_out=[3]'"


@pytest.mark.full("trains FedAvg and FedCCRL one round on three PACS domains at 64 px through dvc exp run (~4 min)")
@pytest.mark.timeout(1500)
def test_make_pacs_cpu_runs_end_to_end_from_the_local_zip(pacs128, tmp_path):
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    for f in ("Makefile", "dvc.yaml", "params.yaml"):  # this working tree's recipe, committed or not
        (repo / f).write_bytes((ROOT / f).read_bytes())
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "recipe"], cwd=repo, check=False
    )
    env = {
        **os.environ,
        "DVC_NO_ANALYTICS": "1",
        "MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}",
        "FEDCCRL_MLFLOW_ARTIFACTS": str(repo / "mlruns"),
    }
    # this test's virtual environment stands in for the clone's .venv (-o: make does not rebuild it)
    r = subprocess.run(
        [
            "make",
            f"VENV={VENV}",
            "-o",
            f"{VENV}/.installed",
            "pacs-cpu",
            f"PACS_ZIP={pacs128}",
            f"PACS_CPU_EXTRA={TINY}",
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=1400,
    )
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"

    table = (repo / "results" / "table.md").read_text()
    assert "| fedavg |" in table and "| fedccrl |" in table and "sketch" in table, table
    assert table in r.stdout  # the recipe prints its table
    for alg in ("fedavg", "fedccrl"):
        run = contract.run_dir(repo / "models", alg, 0, 3)
        doc = json.loads((run / contract.HISTORY_FILE).read_text())
        meta = doc["meta"]
        assert meta["held_out_domain"] == "sketch" and meta["algorithm"] == alg
        (rec,) = doc["rounds"]  # PACS_CPU_EXTRA's one round overrides the recipe's ten
        assert 0 <= rec[contract.TARGET_ACC] <= 1
        assert any((repo / "exports" / alg).rglob("*.onnx")), f"no ONNX export of {alg}"
    shards = json.loads((repo / "data" / "shards" / "manifest.json").read_text())
    assert shards["image_size"] == 64 and sorted(shards["domains"]) == ["art_painting", "cartoon", "photo", "sketch"]
    params = (repo / "params.yaml").read_text()  # the experiment's params, as DVC applied them
    assert "backbone: small_cnn" in params and "name: pacs" in params
