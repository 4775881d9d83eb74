"""The download, partition and pools stages end to end through the CLI, and under
`dvc repro`."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def _env(extra_path: Path | None = None) -> dict:
    env = dict(os.environ)
    path = [str(Path(sys.executable).parent), env.get("PATH", "")]
    if extra_path is not None:
        path.insert(0, str(extra_path))
    env["PATH"] = os.pathsep.join(path)
    return env


def _cli(cwd: Path, *args: str, monkeypatch) -> tuple[int, str]:
    """Run a stage in-process (as `fedccrl <args>` would) from `cwd`; return (exit code, stderr)."""
    from click.testing import CliRunner

    from fedccrl_pipeline.cli import main

    monkeypatch.chdir(cwd)
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res.exit_code, res.stderr


def test_stages_end_to_end_on_synthetic(params, tmp_path, monkeypatch):
    params({"dataset.name": "synthetic", "dataset.source": "registry", "preprocess.image_size": "auto"})
    t0 = time.monotonic()
    code, err = _cli(
        tmp_path, "download", "--out", "data/raw", "--report", "data/reports/download.json", monkeypatch=monkeypatch
    )
    assert code == 0, err
    assert "validate: 960/960" in err  # progress on stderr
    code, err = _cli(tmp_path, "partition", "--raw", "data/raw", "--out", "data/shards", monkeypatch=monkeypatch)
    assert code == 0, err
    code, err = _cli(tmp_path, "pools", "--shards", "data/shards", "--out", "data/pools", monkeypatch=monkeypatch)
    assert code == 0, err
    assert "pools: 8 clients -> data/pools" in err
    elapsed = time.monotonic() - t0
    report = json.loads((tmp_path / "data/reports/download.json").read_text())
    assert report["status"] == "ok" and report["total"] == 960 and report["source"]["kind"] == "generated"
    manifest = json.loads((tmp_path / "data/shards/manifest.json").read_text())
    assert manifest["image_size"] == 32 and len(manifest["clients"]) == 8  # auto -> 32 px
    assert sum(c["n_train"] + c["n_val"] for c in manifest["clients"]) == 960
    pools = json.loads((tmp_path / "data/pools/manifest.json").read_text())
    for c in pools["clients"]:
        with np.load(tmp_path / "data/pools" / c["file"]) as z:
            assert z["mu"].shape == (c["n"], 3)
    assert sorted(os.listdir(tmp_path / "data")) == ["pools", "raw", "reports", "shards"]  # no temp dirs
    print(f"download, partition and pools on synthetic: {elapsed:.1f}s")


def test_cli_errors_are_one_line_exit_2(params, tmp_path, monkeypatch):
    params({"dataset.name": "imagenet"})
    code, err = _cli(tmp_path, "download", "--out", "data/raw", "--report", "data/r.json", monkeypatch=monkeypatch)
    assert code == 2 and err.strip().splitlines() == [err.strip()]
    assert err.startswith("error: params.yaml: key 'dataset.name': got 'imagenet'; must be one of synthetic, pacs")
    params({"dataset.source": str(tmp_path / "missing.zip")})
    code, err = _cli(
        tmp_path,
        "download",
        "--out",
        "data/raw",
        "--report",
        "data/r.json",
        "--params",
        "params.yaml",
        monkeypatch=monkeypatch,
    )
    assert code == 2 and "dataset.source" in err and not (tmp_path / "data" / "raw").exists()
    params({"partition.val_fraction": 1.5})
    code, err = _cli(tmp_path, "partition", "--raw", "nowhere", "--out", "data/shards", monkeypatch=monkeypatch)
    assert code == 2 and "partition.val_fraction" in err
    code, err = _cli(tmp_path, "pools", "--shards", "nowhere", "--out", "data/pools", monkeypatch=monkeypatch)
    assert code == 2 and "partition.val_fraction" in err  # every stage validates the whole params file first
    params()
    code, err = _cli(tmp_path, "pools", "--shards", "nowhere", "--out", "data/pools", monkeypatch=monkeypatch)
    assert code == 2 and "nowhere/manifest.json: shard manifest not found" in err
    for pools in ("data/shards", "data", "data/shards/pools"):  # one folder inside or around the other
        code, err = _cli(tmp_path, "pools", "--shards", "data/shards", "--out", pools, monkeypatch=monkeypatch)
        assert code == 2 and f"--shards data/shards and --out {pools}: the same folder, or one inside" in err, err
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "keep.txt").write_text("a user's file")
    code, err = _cli(tmp_path, "partition", "--raw", "raw", "--out", "raw", monkeypatch=monkeypatch)
    assert code == 2 and "--raw raw and --out raw: the same folder" in err, err
    assert (tmp_path / "raw" / "keep.txt").read_text() == "a user's file"  # refused, nothing replaced
    params({"preprocess.std": [0.2, 0.0, 0.2]})
    code, err = _cli(tmp_path, "pools", "--shards", "nowhere", "--out", "data/pools", monkeypatch=monkeypatch)
    assert code == 2 and "preprocess.std" in err
    assert not (tmp_path / "data").exists()  # refused before any work
    params({"download.retries": -1})
    code, err = _cli(tmp_path, "download", "--out", "data/raw", "--report", "data/r.json", monkeypatch=monkeypatch)
    assert code == 2 and "download.retries" in err


def test_bench_accuracy_trains_only_train_held_out_and_reports_each_round(params, tmp_path, monkeypatch):
    """`fedccrl-bench accuracy` honours `train.held_out` (one column per entry) and prints every round on stderr;
    an entry that is not a domain of the shards is refused naming it, before any training."""
    params({"dataset.name": "synthetic", "dataset.source": "registry", "preprocess.image_size": "auto"})
    for args in (
        ("download", "--out", "data/raw", "--report", "data/r.json"),
        ("partition", "--raw", "data/raw", "--out", "data/shards"),
        ("pools", "--shards", "data/shards", "--out", "data/pools"),
    ):
        code, err = _cli(tmp_path, *args, monkeypatch=monkeypatch)
        assert code == 0, err
    from click.testing import CliRunner

    from fedccrl_benchmarks.cli import main

    bench = [
        "accuracy",
        "--algorithms",
        "fedavg",
        "--seeds",
        "0",
        "--set",
        "train.rounds=2",
        "--set",
        "train.local_epochs=1",
    ]
    res = CliRunner().invoke(main, [*bench, "--set", "train.held_out=[sketch]"], catch_exceptions=False)
    assert res.exit_code == 0, res.stderr
    assert "| Algorithm | sketch | Avg. |" in res.stdout
    rounds = [line for line in res.stderr.splitlines() if line.startswith("bench: fedavg sketch seed 0 round")]
    assert [line.split(" round ")[1].split(":")[0] for line in rounds] == ["1/2", "2/2"]
    res = CliRunner().invoke(main, [*bench, "--set", "train.held_out=[9]"], catch_exceptions=False)
    assert res.exit_code == 2 and "train.held_out[0]" in res.stderr and "bench: " not in res.stderr


def test_folders_apart_refuses_only_overlaps_with_an_output(tmp_path):
    """Two folders a command only reads may overlap (pools kept inside the shards folder); an output may not."""
    import pytest

    from fedccrl_core.foundation.errors import DataError
    from fedccrl_pipeline.stage_runtime import folders_apart

    folders_apart({"shards": tmp_path / "d", "pools": tmp_path / "d/pools"}, {"out": tmp_path / "o", "plots": None})
    with pytest.raises(DataError, match="--shards .* and --out .*: the same folder, or one inside the other"):
        folders_apart({"shards": tmp_path / "d", "pools": tmp_path / "p"}, {"out": tmp_path / "d/out"})
