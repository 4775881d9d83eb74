"""The typed records that cross layers (fedccrl_core/foundation/records.py): the shard and pool manifests, a
model file's meta, the round checkpoint and the Flower specs. Each written one is read back equal (same keys, same
order, same values), and a malformed one is refused where it is read, naming the file (or message) and the key,
before anything else is done with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.data.manifest import client_ids, load_manifest
from fedccrl_core.data.pools import load_pool, load_pool_manifest
from fedccrl_core.data.shards import load_client
from fedccrl_core.federation.checkpoints import RoundCheckpoints, RoundState
from fedccrl_core.foundation.errors import DataError
from fedccrl_core.learning.model_file import FORMAT, ModelMeta, load_meta, load_model, save_model
from fedccrl_core.learning.models import build_model
from fedccrl_flower.spec import ClientSpec, ServerSpec


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _same(got: dict, want: dict) -> None:
    """Equal, keys in the same order at every level of mappings."""
    assert got == want
    assert json.dumps(got) == json.dumps(want)


# ---- the shard and pool manifests ----------------------------------------------------------------------------
def test_the_manifests_read_back_as_written(tiny):
    shards, pools = tiny / "data" / "shards", tiny / "data" / "pools"
    _same(load_manifest(shards).to_dict(), _json(shards / "manifest.json"))
    _same(load_pool_manifest(pools).to_dict(), _json(pools / "manifest.json"))
    assert "warnings" not in load_manifest(shards).to_dict()  # absent when none, as written


def _manifest_copy(src: Path, dest: Path, change) -> Path:
    dest.mkdir()
    m = _json(src / "manifest.json")
    change(m)
    (dest / "manifest.json").write_text(json.dumps(m))
    return dest / "manifest.json"


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (lambda m: m["clients"][1].update(n_train="12"), "clients[1].n_train"),
        (lambda m: m.pop("classes"), "classes"),
        (lambda m: m.update(image_size=True), "image_size"),
        (lambda m: m["clients"][0].update(owner="me"), "clients[0].owner"),
        (lambda m: m.update(domains="photo"), "domains"),
    ],
)
def test_a_malformed_shard_manifest_is_refused_naming_the_file_and_the_key(tiny, tmp_path, change, key):
    path = _manifest_copy(tiny / "data" / "shards", tmp_path / "shards", change)  # no shard file: none is read
    for read in (
        lambda: load_manifest(path.parent),
        lambda: load_client(path.parent, "photo_c0"),
        lambda: client_ids(load_manifest(path.parent)),
    ):
        with pytest.raises(DataError) as e:
            read()
        assert str(e.value).startswith(f"{path}: key '{key}'"), str(e.value)


def test_a_malformed_pool_manifest_is_refused_naming_the_file_and_the_key(tiny, tmp_path):
    path = _manifest_copy(tiny / "data" / "pools", tmp_path / "pools", lambda m: m["clients"][2].update(n=-0.5))
    with pytest.raises(DataError, match=rf"^{path}: key 'clients\[2\]\.n': got -0\.5; must be an integer"):
        load_pool(path.parent, "photo_c0")


def test_an_old_format_version_names_the_stage_to_rerun(tiny, tmp_path):
    path = _manifest_copy(tiny / "data" / "shards", tmp_path / "shards", lambda m: m.update(format_version=0))
    with pytest.raises(DataError, match=rf"^{path}: shard format_version 0 is not 1; rerun the partition stage$"):
        load_manifest(path.parent)


# ---- a model file's meta -------------------------------------------------------------------------------------
META = dict(
    backbone="small_cnn",
    num_classes=3,
    classes=["a", "b", "c"],
    image_size=8,
    mean=[0.5, 0.5, 0.5],
    std=[0.25, 0.25, 0.25],
    held_out_domain="sketch",
    seed=0,
    mlflow_run_id=None,  # given as None: written as None
    round=2,
)


def test_a_model_meta_reads_back_as_written(tmp_path):
    meta = ModelMeta(**META)
    save_model(tmp_path / "m.pt", build_model("small_cnn", 3), meta)
    assert load_meta(tmp_path / "m.pt") == meta
    _same(torch.load(tmp_path / "m.pt", weights_only=True)["meta"], META)  # the keys given, no others
    _model, again = load_model(tmp_path / "m.pt")
    assert again == meta and again.to_dict() == META


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"num_classes": "3"}, "num_classes"),
        ({"classes": None}, "classes"),
        ({"mean": "imagenet"}, "mean"),
        ({"owner": "me"}, "owner"),
    ],
)
def test_a_malformed_model_meta_is_refused_naming_the_file_and_the_key(tmp_path, change, key):
    path = tmp_path / "m.pt"
    state = dict(build_model("small_cnn", 3).state_dict())
    torch.save({"format": FORMAT, "state_dict": state, "meta": {**META, **change}}, path)
    for read in (load_meta, load_model):
        with pytest.raises(DataError) as e:
            read(path)
        assert str(e.value).startswith(f"{path}: meta: key '{key}'"), str(e.value)


def test_a_reader_that_needs_a_field_names_it(tmp_path):
    meta = ModelMeta(**{k: v for k, v in META.items() if k != "held_out_domain"})
    with pytest.raises(DataError, match=r"^m\.pt: the model meta lacks 'held_out_domain'$"):
        meta.require("m.pt", "held_out_domain", "seed")


# ---- the round checkpoint ------------------------------------------------------------------------------------
def _state(**over) -> RoundState:
    w = {"w": torch.arange(3.0)}
    return RoundState(
        **{
            "global_weights": w,
            "best": w,
            "best_round": 1,
            "best_val": 0.5,
            "history": [
                {"round": 1, "val_acc": 0.5, "target_acc": 0.25, "val_pred_classes": 2, "seconds": 1.0}
                | {"bytes_up": 10, "bytes_down": 20}
            ],
            "run_info": {"run_key": "k"},
            "server_state": {},
            "engine": "inprocess",
            **over,
        }
    )


def test_a_round_checkpoint_reads_back_as_written(tmp_path):
    cks = RoundCheckpoints(tmp_path / "ck.pt", "cpu", lambda m: None)
    cks.save(1, _state(), {"c0": {"extra": {"bank": torch.ones(2)}}})
    raw = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert list(raw) == [
        "global",
        "best",
        "best_round",
        "best_val",
        "history",
        "run_info",
        "server_state",
        "engine",
        "round",
        "client_records",
    ]  # no privacy key when off
    ck = RoundCheckpoints(tmp_path / "ck.pt", "cpu", lambda m: None).load(lambda c: None)
    assert ck is not None and ck.round == 1 and ck.best_round == 1
    assert [r.to_dict() for r in ck.history] == [r.to_dict() for r in _state().history]
    assert torch.equal(ck.global_weights["w"], torch.arange(3.0)) and list(ck.client_records) == ["c0"]
    assert list(ck.to_dict()) == list(raw)
    private = RoundCheckpoints(tmp_path / "p.pt", "cpu", lambda m: None)
    private.save(1, _state(privacy=[["weights", 1, 4, 2, 1.1]]), {})
    assert torch.load(tmp_path / "p.pt", weights_only=True)["privacy"] == [["weights", 1, 4, 2, 1.1]]


def test_a_malformed_round_checkpoint_is_refused_naming_the_file_and_the_key(tmp_path):
    cks = RoundCheckpoints(tmp_path / "ck.pt", "cpu", lambda m: None)
    cks.save(1, _state(), {})
    raw = torch.load(tmp_path / "ck.pt", weights_only=True)
    torch.save({**raw, "best_round": "1"}, tmp_path / "ck.pt")
    logs: list[str] = []
    assert RoundCheckpoints(tmp_path / "ck.pt", "cpu", logs.append).load(lambda c: None) is None  # round 1 again
    assert any(f"checkpoint {tmp_path / 'ck.pt'} unreadable" in m and "ck.pt: key 'best_round'" in m for m in logs)


# ---- the Flower specs ----------------------------------------------------------------------------------------
def _server_spec() -> ServerSpec:
    local = LocalConfig(rounds=2, local_epochs=1)
    return ServerSpec(
        algorithm="fedccrl",
        local=local,
        hparams=build_algorithm("fedccrl", local).hp,
        backbone="small_cnn",
        num_classes=6,
        seed=0,
        held_out="sketch",
        sources=["art_c0", "cartoon_c0", "photo_c0"],
        evaluators=["sketch_c0"],
        work_dir="/work",
        run_info={"run_key": "k"},
    )


def test_the_specs_read_back_as_sent():
    spec = _server_spec()
    assert ServerSpec.from_json(spec.to_json(), "run config") == spec
    client = spec.client_spec()
    again = ClientSpec.from_json(client.to_json(), "CONFIG record")
    assert again == client and again.hparams == spec.hparams and type(again.hparams) is type(spec.hparams)
    assert again.local == spec.local and again.state_key == client.state_key


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (lambda d: d.update(seed="0"), "seed"),
        (lambda d: d["local"].update(lr="fast"), "local.lr"),
        (lambda d: d["hparams"].update(lambda1=-1.0), "hparams.lambda1"),
        (lambda d: d["hparams"].update(lamda1=0.1), "hparams.lamda1"),
        (lambda d: d.update(algorithm="fedbest"), "algorithm"),
        (lambda d: d.pop("state_key"), "state_key"),
    ],
)
def test_a_malformed_client_spec_is_refused_naming_the_message_and_the_key(change, key):
    d = json.loads(_server_spec().client_spec().to_json())
    change(d)
    with pytest.raises(ValueError) as e:
        ClientSpec.from_json(json.dumps(d), "CONFIG record 'spec'")
    assert str(e.value).startswith(f"CONFIG record 'spec': key '{key}'"), str(e.value)


def test_a_malformed_server_spec_is_refused_naming_the_run_config_and_the_key():
    d = json.loads(_server_spec().to_json())
    d["min_clients"] = 2.5
    with pytest.raises(ValueError, match=r"^Flower run config 'spec': key 'min_clients': got 2\.5; must be an integer"):
        ServerSpec.from_json(json.dumps(d), "Flower run config 'spec'")
    with pytest.raises(ValueError, match=r"^Flower run config 'spec': not JSON"):
        ServerSpec.from_json("{oops", "Flower run config 'spec'")


def test_a_local_tracking_store_travels_as_an_absolute_path(tmp_path, monkeypatch):
    """ReportTo, made in the operator's folder, names a relative local store absolutely: the ServerApp reads it from
    a folder of its own, where `sqlite:///mlflow.db` would be another store. A server's URI stays as it is."""
    from fedccrl_flower.spec import ReportTo

    monkeypatch.chdir(tmp_path)
    made = ReportTo(tracking_uri="sqlite:///mlflow.db", run_id="r")
    assert made.tracking_uri == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert ReportTo(tracking_uri="mlruns", run_id="r").tracking_uri == str(tmp_path.resolve() / "mlruns")
    monkeypatch.chdir("/")  # the ServerApp's folder: the spec read back names the same store
    assert ReportTo.model_validate_json(made.model_dump_json()) == made
    for kept in ("http://mlflow.example.org:5000", f"sqlite:///{tmp_path}/x.db", "sqlite:///:memory:"):
        assert ReportTo(tracking_uri=kept, run_id="r").tracking_uri == kept
