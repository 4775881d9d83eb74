"""Every stage's code path in one pass, without DVC: each `cmd` of dvc.yaml, in its order and with its matrix
expanded from params.yaml, runs as the `fedccrl` command it names, in a scratch workspace at a tiny scale
(1 round of 1 local epoch, 16 px, one held-out domain, FedAvg and FedCCRL). The full tier runs the same stages
through `dvc repro` (tests/test_pipeline.py, tests/test_default_experiment.py)."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TINY = {
    "train.rounds": 1,
    "train.local_epochs": 1,
    "train.held_out": [3],
    "train.algorithms": ["fedavg", "fedccrl"],
    "preprocess.image_size": 16,
    "figures.tsne_points": 20,
    "figures.gradcam_images": 1,
    "figures.preview_images": 1,
}


def _lookup(doc: dict, dotted: str):
    for key in dotted.split("."):
        doc = doc[key]
    return doc


def stage_commands(dvc: dict, params: dict) -> list[tuple[str, str]]:
    """(stage name, shell command) of every stage, matrix items expanded in order, ${...} from params."""
    out = []
    for name, stage in dvc["stages"].items():
        matrix = stage.get("matrix") or {}
        axes = {k: _lookup(params, v[2:-1]) if isinstance(v, str) else v for k, v in matrix.items()}
        for combo in itertools.product(*axes.values()) if axes else [()]:
            item = dict(zip(axes, combo))

            def value(m, item=item):
                key = m[1]
                return str(item[key[5:]] if key.startswith("item.") else _lookup(params, key))

            out.append(
                (
                    name + (f"@{'-'.join(map(str, combo))}" if combo else ""),
                    re.sub(r"\$\{([\w.]+)\}", value, " ".join(stage["cmd"].split())),
                )
            )
    return out


@pytest.mark.timeout(900)  # about a minute on an idle 2-core machine; three on a busy one
def test_every_stage_runs_as_dvc_yaml_says_without_dvc(params, tmp_path):
    from fedccrl_pipeline.params_yaml import read_yaml

    tiny_params = read_yaml(params(TINY))
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    commands = stage_commands(yaml.safe_load((REPO / "dvc.yaml").read_text()), tiny_params)
    assert [n.split("@")[0] for n, _ in commands] == [
        "download",
        "partition",
        "pools",
        "train",
        "train",
        "evaluate",
        "export",
        "report",
        "figures",
    ]
    for name, cmd in commands:
        assert cmd.startswith("fedccrl "), f"dvc.yaml stage {name}: {cmd!r} is not a fedccrl command"
        t0 = time.monotonic()
        p = subprocess.run(cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        print(f"stage {name}: {time.monotonic() - t0:.1f}s", file=sys.stderr)
        assert p.returncode == 0, f"stage {name}: {cmd}\n{p.stderr[-3000:]}"
    metrics = json.loads((tmp_path / "results" / "metrics.json").read_text())
    assert set(metrics) == {"fedavg", "fedccrl"}
    for alg in metrics:
        (dom,) = [d for d in metrics[alg] if d not in ("avg", "comm_mb_per_round")]
        assert dom == "sketch" and 0 <= metrics[alg][dom]["final_target_acc"]["mean"] <= 1
    table = (tmp_path / "results" / "table.md").read_text()
    assert re.search(r"^Platform: cpu \S+ \S+.*, torch \d", table, re.M), table[:500]
    onnx = sorted((tmp_path / "exports").rglob("*.onnx"))
    assert onnx
    assert any((tmp_path / "plots").glob("*.png"))
    # the export stage logs each exported model to its training run and registers it: one version per model,
    # tagged with its weights, under its alias
    import mlflow

    client = mlflow.MlflowClient()
    for path in onnx:
        algorithm = path.relative_to(tmp_path / "exports").parts[0]
        version = client.get_model_version_by_alias(f"fedccrl-synthetic-{algorithm}", "s0-heldout-sketch")
        assert version.tags["algorithm"] == algorithm and len(version.tags["weights_sha256"]) == 64
        run = client.get_run(version.run_id)
        assert run.data.metrics["export_top1_agreement"] >= 0.999 and run.info.status == "FINISHED"
        # its model card, beside it and as the version's description, from the evaluate stage's result
        card = (path.parent / "MODEL_CARD.md").read_text()
        assert version.description == card
        result = path.relative_to(tmp_path / "exports").parent.with_suffix(".json")
        assert f"From the evaluate stage's result `results/runs/{result.as_posix()}`." in card
    # a stage that fails (here: the export's --out lies under a file, which only the export finds out) fails alone,
    # with its own error, and leaves the others' outputs as they were
    export = next(cmd for name, cmd in commands if name == "export")
    (tmp_path / "exports.txt").write_text("not a folder")
    failing = export.replace("--out exports", "--out exports.txt/sub")
    assert failing != export
    before = (tmp_path / "results" / "metrics.json").read_bytes()
    p = subprocess.run(failing, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode != 0 and "exports.txt" in p.stderr, p.stderr[-3000:]
    assert (tmp_path / "exports.txt").read_text() == "not a folder"
    assert (tmp_path / "results" / "metrics.json").read_bytes() == before
