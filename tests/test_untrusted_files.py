"""A model file or checkpoint is data, never code: every torch file is read with torch's weights-only
unpickler (fedccrl_core/learning/model_file.py `torch_load`), a client state's pickle may name only an explicit
allowlist (fedccrl_core/federation/checkpoints.py), and a crafted file is refused with an error naming it.

The crafted files here hold an object whose `__reduce__` calls os.system to create a marker file; the first
test shows that a full unpickler does run it, so the marker's absence elsewhere means something. The stage
CLI tests share one tiny trained run (about 20 s): full tier.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fedccrl_core.federation.checkpoints import RoundCheckpoints, RoundState
from fedccrl_core.foundation.errors import UntrustedFileError
from fedccrl_core.learning.model_file import FORMAT, load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Payload:
    """Unpickled by a full unpickler, it runs `touch <marker>`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


EMPTY_ROUND = RoundState(
    global_weights={},
    best={},
    best_round=0,
    best_val=-1.0,
    history=[],
    run_info={},
    server_state={},
    engine="inprocess",
)


def crafted_model(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": FORMAT, "state_dict": {}, "meta": {"backbone": Payload(marker)}}, path)
    return path


def crafted_checkpoint(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"round": 1, "global": {}, "history": [Payload(marker)]}, path)
    return path


# ------------------------------------------------------------------ the library
def test_the_payload_is_live_under_a_full_unpickler(tmp_path):
    marker = tmp_path / "MARKER"
    path = crafted_model(tmp_path / "model.pt", marker)
    torch.load(path, weights_only=False)  # what the project did before: the payload runs
    assert marker.exists()


def test_load_model_refuses_a_crafted_file_naming_it(tmp_path):
    marker = tmp_path / "MARKER"
    path = crafted_model(tmp_path / "model.pt", marker)
    with pytest.raises(UntrustedFileError) as e:
        load_model(path)
    assert str(e.value).startswith(f"{path}: refused") and "posix.system" in str(e.value)
    assert not marker.exists()


def test_a_torn_model_file_is_still_an_unreadable_one(tmp_path):
    from fedccrl_core.foundation.errors import FedCCRLError

    path = tmp_path / "model.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(FedCCRLError, match="not a readable fedccrl model file") as e:
        load_model(path)
    assert not isinstance(e.value, UntrustedFileError)


def test_a_crafted_round_checkpoint_stops_the_resume_naming_it(tmp_path):
    """Not a torn write to fall back from (that still falls back: tests/test_round_loop.py): refused."""
    marker = tmp_path / "MARKER"
    ck = crafted_checkpoint(tmp_path / "ck.pt", marker)
    logs = []
    with pytest.raises(UntrustedFileError, match=f"^{ck}: refused"):
        RoundCheckpoints(ck, "cpu", logs.append).load(lambda c: None)
    assert not marker.exists() and ck.exists()


def test_a_crafted_client_state_is_refused_naming_its_file(tmp_path):
    marker = tmp_path / "MARKER"
    cks = RoundCheckpoints(tmp_path / "ck.pt", "cpu", lambda m: None)
    good = {
        "optimizer": {"state": {0: {"exp_avg": torch.arange(4.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "scheduler": None,
        "extra": {},
    }
    cks.save(1, EMPTY_ROUND, {"a": good, "b": {**good, "extra": {"x": Payload(marker)}}})
    again = RoundCheckpoints(tmp_path / "ck.pt", "cpu", lambda m: None)
    assert again.load(lambda c: None).round == 1
    assert torch.equal(again.load_client("a")["optimizer"]["state"][0]["exp_avg"], torch.arange(4.0))
    with pytest.raises(UntrustedFileError) as e:
        again.load_client("b")
    assert str(e.value).startswith(f"{cks.round_file(1)}: refused: the state of client b")
    assert "posix.system" in str(e.value)
    assert not marker.exists()


# ------------------------------------------------------------------ the stage CLIs
def _stage(ws: Path, tiny: Path, tmp_path: Path, monkeypatch, *args) -> object:
    from click.testing import CliRunner

    from fedccrl_pipeline.cli import main

    monkeypatch.chdir(ws)
    args = [str(a).replace("{data}", str(tiny / "data")) for a in args]
    return CliRunner().invoke(main, [*args, "--params", "params.yaml"])


def _refused(res, path: Path, marker: Path) -> None:
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output[-3000:]
    assert "Traceback" not in res.output
    assert any(ln.startswith(f"error: {path}: refused") for ln in errors), res.stderr[-2000:]
    assert not marker.exists()


@pytest.fixture
def crafted_run(trained, tmp_path):
    """The trained workspace with its final model replaced by a crafted one: (ws, model path, marker)."""
    model = trained / "models/fedavg/s0/d0/model.pt"
    kept = model.read_bytes()
    marker = tmp_path / "MARKER"
    crafted_model(model, marker)
    yield trained, model.relative_to(trained), marker
    model.write_bytes(kept)


@pytest.mark.full("one tiny run trained and evaluated through the stage CLIs first, about 20 s")
@pytest.mark.parametrize("stage", ["evaluate", "export", "figures"])
def test_a_stage_refuses_a_crafted_model_file(stage, crafted_run, tiny, tmp_path, monkeypatch):
    ws, model, marker = crafted_run
    args = {
        "evaluate": ["evaluate", "--shards", "{data}/shards", "--models", "models", "--out", "out/runs"],
        "export": [
            "export",
            "--models",
            "models",
            "--shards",
            "{data}/shards",
            "--out",
            "out/exports",
            "--summary",
            "out/parity.json",
            "--no-mlflow",
        ],
        "figures": [
            "figures",
            "--shards",
            "{data}/shards",
            "--pools",
            "{data}/pools",
            "--models",
            "models",
            "--runs",
            "runs",
            "--out",
            "out/plots",
        ],
    }[stage]
    res = _stage(ws, tiny, tmp_path, monkeypatch, *args)
    _refused(res, model, marker)
    assert not (ws / "out").exists()


@pytest.mark.full("one tiny run trained and evaluated through the stage CLIs first, about 20 s")
def test_train_refuses_to_resume_from_a_crafted_round_checkpoint(trained, tiny, tmp_path, monkeypatch):
    (ck,) = [p for p in (trained / "ck").rglob("*.pt") if p.parent.suffix != ".clients"]
    kept = ck.read_bytes()
    marker = tmp_path / "MARKER"
    crafted_checkpoint(ck, marker)
    try:
        res = _stage(
            trained,
            tiny,
            tmp_path,
            monkeypatch,
            "train",
            "--shards",
            "{data}/shards",
            "--pools",
            "{data}/pools",
            "--algorithm",
            "fedavg",
            "--seed",
            "0",
            "--held-out",
            "0",
            "--out",
            "out/models/fedavg/s0",
            "--checkpoints",
            "ck",
        )
        _refused(res, ck.relative_to(trained), marker)
        assert not (trained / "out").exists()
    finally:
        ck.write_bytes(kept)


def test_a_client_record_may_name_only_a_torch_dtype(tmp_path):
    """`_tensor_from` is the one project function a record names; its dtype argument comes from the file."""
    import numpy as np

    from fedccrl_core.federation import checkpoints

    class Crafted:
        def __reduce__(self):
            return checkpoints._tensor_from, ("load", (1,), np.zeros(1, np.uint8))

    cks = RoundCheckpoints(tmp_path / "ck.pt", "cpu", lambda m: None)
    cks.save(1, EMPTY_ROUND, {"a": {"extra": {"x": Crafted()}}})
    again = RoundCheckpoints(tmp_path / "ck.pt", "cpu", lambda m: None)
    again.load(lambda c: None)
    with pytest.raises(UntrustedFileError, match="names 'load' as a tensor dtype"):
        again.load_client("a")
