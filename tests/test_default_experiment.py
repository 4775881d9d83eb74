"""The main job (`make repro`): `dvc repro` of the embedded default, end to end, shows the method working
(issue 15 point 2): FedCCRL at least 55 % on average over the four held-out domains (final round, seed 0)
and at least 10 points above FedAvg. Training is deterministic on the CPU (one torch thread per run,
pipeline/train.py), so the README's table is this run's table, number for number."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def default_ws(tmp_path_factory):
    if shutil.which("dvc", path=str(BIN)) is None and shutil.which("dvc") is None:
        pytest.skip("dvc is not installed")
    ws = tmp_path_factory.mktemp("default")
    for f in ("dvc.yaml", "params.yaml"):
        shutil.copy(REPO / f, ws / f)
    for code in ("fedccrl_core", "fedccrl_flower", "flower_app", "serving", "pipeline"):
        (ws / code).symlink_to(REPO / code)
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "MLFLOW_TRACKING_URI": f"sqlite:///{ws / 'mlflow.db'}"}
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=ws, env=env, check=True)
    p = subprocess.run(["dvc", "repro"], cwd=ws, env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-4000:]
    return ws


def _final_table(text: str) -> dict[str, list[str]]:
    """{algorithm: [cell, ...]} of the first markdown table after the 'final round' heading."""
    block = text[text.index("final round"):]
    rows = {}
    for line in block.splitlines()[1:]:
        if line.startswith("| ") and not line.startswith("| Algorithm"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
        elif rows and not line.startswith("|"):
            break
    return rows


def test_default_runs_fedccrl_and_fedavg_and_fedccrl_wins(default_ws):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    assert {"fedccrl", "fedavg"} <= set(params["train"]["algorithms"]) and 0 in params["train"]["seeds"]
    metrics = json.loads((default_ws / "results" / "metrics.json").read_text())
    avg = {alg: metrics[alg]["avg"]["final_target_acc"] for alg in ("fedccrl", "fedavg")}
    domains = [d for d in metrics["fedccrl"] if d not in ("avg", "comm_mb_per_round")]
    assert len(domains) == 4 and set(domains) == {d for d in metrics["fedavg"] if d not in ("avg", "comm_mb_per_round")}
    assert avg["fedccrl"] >= 0.55, avg
    assert avg["fedccrl"] >= avg["fedavg"] + 0.10, avg


def test_readme_default_table_is_this_runs_table(default_ws):
    """The README's numbers are tested numbers: its default-experiment table equals results/table.md's."""
    readme = (REPO / "README.md").read_text()
    m = re.search(r"<!-- default-table -->\n(.*?)<!-- /default-table -->", readme, re.S)
    assert m, "README.md: no <!-- default-table --> block"
    shown = _final_table("final round\n" + m.group(1))
    measured = _final_table((default_ws / "results" / "table.md").read_text())
    assert set(shown) == {"fedavg", "fedccrl"} and shown == {k: measured[k] for k in shown}, (shown, measured)
