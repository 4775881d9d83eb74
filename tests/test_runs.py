"""fedccrl_core/outcomes/runs.py: a saved run re-evaluated on its held-out domain. When the best source-validation round is
the last one (best.pt holds the final model's weights), its predictions are not computed a second time, and the
result is the one both predictions would give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedccrl_core.data.images import RESIZE_POLICY
from fedccrl_core.federation.history import write_history
from fedccrl_core.foundation import contract
from fedccrl_core.learning import accuracy as evaluation
from fedccrl_core.learning.model_file import ModelMeta, save_model
from fedccrl_core.learning.models import build_model
from fedccrl_core.outcomes import runs

HELD_OUT = "sketch"


@pytest.fixture(scope="module")
def shards(tiny) -> Path:
    return tiny / "data" / "shards"  # the session's tiny dataset (conftest.py), read-only


def _meta(shards: Path) -> ModelMeta:
    """The run's meta, without `round` (what history.json holds)."""
    manifest = json.loads((shards / "manifest.json").read_text())
    return ModelMeta(
        backbone="small_cnn",
        num_classes=manifest["num_classes"],
        classes=manifest["classes"],
        image_size=32,
        mean=[0.485, 0.456, 0.406],
        std=[0.229, 0.224, 0.225],
        resize=RESIZE_POLICY,
        dataset="synthetic",
        domains=manifest["domains"],
        held_out_domain=HELD_OUT,
        held_out_index=3,
        algorithm="fedavg",
        seed=0,
    )


def _save(path: Path, shards: Path, weights_seed: int, rnd: int) -> None:
    meta = _meta(shards)
    torch.manual_seed(weights_seed)
    save_model(path, build_model("small_cnn", meta.num_classes), meta.model_copy(update={"round": rnd}))


def _run(tmp_path: Path, shards: Path, best_seed: int, best_round: int) -> Path:
    run = tmp_path / "fedavg" / "s0" / "d3"
    run.mkdir(parents=True)
    _save(run / contract.MODEL_FILE, shards, 1, 3)
    _save(run / contract.BEST_FILE, shards, best_seed, best_round)
    rounds = [
        {
            contract.ROUND: r,
            contract.TARGET_ACC: 0.0,
            contract.VAL_ACC: 0.5,
            contract.VAL_PRED_CLASSES: 2,
            contract.SECONDS: 1.0,
            contract.BYTES_UP: 10,
            contract.BYTES_DOWN: 20,
        }
        for r in (1, 2, 3)
    ]
    write_history(run, _meta(shards), best_round, rounds)
    return run


@pytest.mark.parametrize(
    "best_seed, best_round, predictions", [(1, 3, 1), (2, 2, 2)], ids=["best-is-final", "best-is-earlier"]
)
def test_the_best_rounds_model_is_evaluated_only_when_it_differs(
    tmp_path, shards, monkeypatch, best_seed, best_round, predictions
):
    run = _run(tmp_path, shards, best_seed, best_round)
    calls = []
    real = evaluation.predict
    monkeypatch.setattr(evaluation, "predict", lambda *a, **k: calls.append(1) or real(*a, **k))
    doc = runs.evaluate_run(shards, run, 64, "cpu")
    assert len(calls) == predictions
    assert doc.best_round == best_round and doc.detail.final.round == 3

    # the same document as predicting with both models
    monkeypatch.setattr(runs, "_same_weights", lambda a, b: False)
    calls.clear()
    assert runs.evaluate_run(shards, run, 64, "cpu") == doc and len(calls) == 2
