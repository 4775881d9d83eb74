"""One round of FedCCRL on a small PACS subset from ../shared (MobileNetV3-Large, the paper's backbone),
through the real stages: download (local folder) -> partition -> pools -> train -> evaluate."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PER_CLASS = 4  # images per class per domain: 4 domains x 7 classes x 4 = 112 images


def _subset(zip_path: Path, dest: Path) -> Path:
    """<domain>/<class>/<file> with PER_CLASS files of each class from the PACS zip."""
    taken: dict = {}
    with zipfile.ZipFile(zip_path) as zf:
        for name in sorted(zf.namelist()):
            parts = name.split("/")
            if len(parts) != 4 or not parts[3]:
                continue
            _, dom, cls, fname = parts
            if taken.setdefault((dom, cls), 0) >= PER_CLASS:
                continue
            taken[(dom, cls)] += 1
            out = dest / dom / cls / fname
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(zf.read(name))
    return dest


def test_one_round_on_a_pacs_subset(pacs128, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from fedccrl_pipeline.cli import main

    src = _subset(pacs128, tmp_path / "pacs_subset")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["dataset"].update(name="imagefolder", source=str(src))
    params["preprocess"]["image_size"] = 64
    params["model"].update(backbone="mobilenet_v3_large", pretrained="none")
    params["partition"]["val_fraction"] = 0.25
    params["train"].update(rounds=1, local_epochs=1, batch_size=8, algorithms=["fedccrl"])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()

    def stage(*args):
        res = runner.invoke(main, list(args), catch_exceptions=False)
        assert res.exit_code == 0, res.stderr[-3000:]
        return res

    stage("download", "--out", "data/raw", "--report", "data/reports/download.json")
    stage("partition", "--raw", "data/raw", "--out", "data/shards")
    stage("pools", "--shards", "data/shards", "--out", "data/pools")
    manifest = json.loads((tmp_path / "data/shards/manifest.json").read_text())
    assert sorted(manifest["domains"]) == ["art_painting", "cartoon", "photo", "sketch"]
    assert len(manifest["classes"]) == 7 and len(manifest["clients"]) == 8
    held = manifest["domains"].index("sketch")
    stage(
        "train",
        "--shards",
        "data/shards",
        "--pools",
        "data/pools",
        "--algorithm",
        "fedccrl",
        "--seed",
        "0",
        "--held-out",
        str(held),
        "--out",
        "models/fedccrl/s0",
    )
    hist = json.loads((tmp_path / f"models/fedccrl/s0/d{held}/history.json").read_text())
    assert hist["meta"]["backbone"] == "mobilenet_v3_large" and hist["meta"]["held_out_domain"] == "sketch"
    rec = hist["rounds"][0]
    assert rec["round"] == 1 and rec["l_ra"] > 0 and rec["l_js"] >= 0 and 0 <= rec["target_acc"] <= 1
    assert rec["bytes_up"] > 6 * 4 * 1e6  # six MobileNetV3-Large uploads (about 17 MB each) plus statistics
    params["train"].update(held_out=[held])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    stage("evaluate", "--shards", "data/shards", "--models", "models", "--out", "results/runs")
    res = json.loads((tmp_path / f"results/runs/fedccrl/s0/d{held}.json").read_text())
    assert res["n_test"] == 7 * PER_CLASS and res["held_out_domain"] == "sketch"
