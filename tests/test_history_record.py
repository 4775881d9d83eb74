"""history.json, typed (fedccrl_core/federation/history.py): written from the round loop's records as the train
stage always wrote it, read back once as a RunHistory, a bad file refused naming the file and the key, and the
figures' per-round series computed from the typed records."""

from __future__ import annotations

import csv
import json

import pytest

from fedccrl_core.federation.history import RunHistory, load_history, write_history
from fedccrl_core.federation.round_record import RoundRecord
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.errors import DataError
from fedccrl_core.learning.model_file import ModelMeta
from fedccrl_core.outcomes.results import round_series


def _meta(algorithm: str = "fedccrl", seed: int = 0) -> ModelMeta:
    return ModelMeta(
        backbone="small_cnn",
        num_classes=4,
        classes=["a", "b", "c", "d"],
        image_size=16,
        mean=[0.5, 0.5, 0.5],
        std=[0.25, 0.25, 0.25],
        dataset="synthetic",
        held_out_domain="sketch",
        algorithm=algorithm,
        seed=seed,
    )


def _round(rnd: int, target: float, loss: float, **more) -> dict:
    """A record as RoundLoop writes it (federation/loop.py): the fixed fields first, then the metrics."""
    return {
        contract.ROUND: rnd,
        contract.VAL_ACC: 0.5 + rnd / 100,
        contract.TARGET_ACC: target,
        contract.VAL_PRED_CLASSES: 4,
        contract.SECONDS: 1.5,
        contract.BYTES_UP: 1000,
        contract.BYTES_DOWN: 2000,
        "l_cls": loss,
        contract.LOSS: loss,
        contract.LR: 0.001,
        contract.TRAIN_ACC: 0.5,
        contract.client_train_acc("c0"): 0.25,
        **more,
    }


def test_written_as_before_and_read_back_typed(tmp_path):
    rounds = [
        _round(1, 0.25, 1.2),
        _round(
            2,
            0.5,
            0.9,
            dropped_clients=[{"client": "c1", "node": 3, "phase": "train", "reason": "timeout", "detail": "30 s"}],
        ),
    ]
    history = write_history(tmp_path, _meta(), 2, rounds)
    text = (tmp_path / contract.HISTORY_FILE).read_text()
    assert text == json.dumps({"meta": _meta().to_dict(), "best_round": 2, "rounds": rounds}, indent=1)
    back = load_history(tmp_path)
    assert back == history and back.to_dict()["rounds"] == rounds  # every key kept, in its order
    assert back.at(2).target_acc == 0.5 and back.rounds[0].metric("l_cls") == 1.2
    assert back.rounds[0].metric("missing") is None and back.rounds[1].metric("dropped_clients") is None
    assert back.rounds[0].loss_terms() == ["l_cls"] and back.meta.algorithm == "fedccrl"
    with open(tmp_path / contract.HISTORY_CSV, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [*contract.HISTORY_CSV_FIELDS, "l_cls"] and rows[1]["target_acc"] == "0.5"


def test_the_record_fields_are_contracts_names():
    fields = [name for name, f in RoundRecord.model_fields.items() if f.is_required()]
    assert fields == [
        contract.ROUND,
        contract.VAL_ACC,
        contract.TARGET_ACC,
        contract.VAL_PRED_CLASSES,
        contract.SECONDS,
        contract.BYTES_UP,
        contract.BYTES_DOWN,
    ]
    assert list(RunHistory.model_fields) == ["meta", contract.BEST_ROUND, "rounds", contract.HISTORY_PRIVACY]


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda d: d["rounds"][0].pop("target_acc"), "rounds[0].target_acc"),
        (lambda d: d["rounds"][1].update(bytes_up="many"), "rounds[1].bytes_up"),
        (lambda d: d.update(best_round=7), "best_round 7 is none of the rounds"),
        (lambda d: d.update(rounds=[]), "rounds"),
        (lambda d: d["meta"].pop("num_classes"), "meta.num_classes"),
    ],
)
def test_a_bad_history_is_refused_naming_the_file_and_key(tmp_path, change, needle):
    write_history(tmp_path, _meta(), 1, [_round(1, 0.25, 1.2), _round(2, 0.5, 0.9)])
    path = tmp_path / contract.HISTORY_FILE
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(DataError) as e:
        load_history(tmp_path)
    assert str(path) in str(e.value) and needle in str(e.value), str(e.value)


def test_a_missing_history_says_which_and_why(tmp_path):
    with pytest.raises(FileNotFoundError, match="history.json: missing"):
        load_history(tmp_path)


def test_round_series_means_over_seeds_from_typed_histories(tmp_path):
    runs = []
    for seed, (t1, t2) in enumerate([(0.2, 0.4), (0.4, 0.8)]):
        folder = tmp_path / f"s{seed}"
        folder.mkdir()
        write_history(folder, _meta(seed=seed), 2, [_round(1, t1, 1.0 + seed), _round(2, t2, 0.5)])
        runs.append(load_history(folder))
    write_history(tmp_path, _meta("fedavg"), 1, [_round(1, 0.1, 2.0)])
    runs.append(load_history(tmp_path))
    series = round_series(runs)
    assert series[contract.TARGET_ACC]["fedccrl"] == [(1, pytest.approx(0.3)), (2, pytest.approx(0.6))]
    assert series[contract.TARGET_ACC]["fedavg"] == [(1, 0.1)]
    assert series["l_cls"]["fedccrl"] == [(1, 1.5), (2, 0.5)]
