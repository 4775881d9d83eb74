"""params.yaml is validated whole, at the start of every stage, before any data is read and before any MLflow run
is opened, so that a bad key costs no work. One test per class of bad parameter: each asserts exit code 2, one `error:` line per
problem that names the key, no traceback, and an MLflow store without runs. Then `held_out` by domain name through
the train and evaluate stages on tiny synthetic data."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fixtures import DELETE, ONE_ROUND

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


STAGE_ARGS = {  # inputs that do not exist: a stage that read anything before validating would fail differently
    "download": ["--out", "out/raw", "--report", "out/report.json"],
    "partition": ["--raw", "nowhere/raw", "--out", "out/shards"],
    "pools": ["--shards", "nowhere/shards", "--out", "out/pools"],
    "train": [
        "--shards",
        "nowhere/shards",
        "--pools",
        "nowhere/pools",
        "--algorithm",
        "fedccrl",
        "--seed",
        "0",
        "--held-out",
        "0",
        "--out",
        "out/model",
        "--checkpoints",
        "out/ck",
    ],
    "evaluate": ["--shards", "nowhere/shards", "--models", "nowhere/models", "--out", "out/runs"],
    "export": [
        "--models",
        "nowhere/models",
        "--shards",
        "nowhere/shards",
        "--out",
        "out/exports",
        "--summary",
        "out/parity.json",
    ],
    "report": ["--runs", "nowhere/runs", "--metrics", "out/m.json", "--table", "out/t.md", "--curves", "out/c.csv"],
    "figures": [
        "--shards",
        "nowhere/shards",
        "--pools",
        "nowhere/pools",
        "--models",
        "nowhere/models",
        "--runs",
        "nowhere/runs",
        "--out",
        "out/plots",
    ],
}


def _stage(cwd: Path, stage: str, args: list[str], monkeypatch):
    from click.testing import CliRunner

    from fedccrl_pipeline.cli import main

    monkeypatch.chdir(cwd)
    res = CliRunner().invoke(main, [stage, *args, "--params", "params.yaml"])
    return res


def _assert_refused(res, cwd: Path, tmp_path: Path, *needles: str) -> list[str]:
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert res.exit_code == 2, res.stderr[-2000:]
    assert isinstance(res.exception, SystemExit)  # no exception escaped: no traceback
    assert "Traceback" not in res.stderr and errors and len(errors) == len(res.stderr.strip().splitlines())
    for needle in needles:
        assert any(needle in e for e in errors), (needle, errors)
    assert not (cwd / "out").exists()  # nothing written
    _assert_no_mlflow_run(tmp_path)
    return errors


def _assert_no_mlflow_run(tmp_path: Path) -> None:
    store = tmp_path / "mlflow.db"  # tests/conftest.py points MLFLOW_TRACKING_URI here
    if not store.exists():
        return
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{store}")
    exps = [e.experiment_id for e in client.search_experiments()]
    assert not client.search_runs(exps), "an MLflow run was opened before validation"


@pytest.mark.parametrize("stage", sorted(STAGE_ARGS))
def test_every_stage_validates_the_whole_file_first(stage, params, tmp_path, monkeypatch):
    """A typo in an algorithm group that the stage does not even read stops every stage, before its inputs."""
    params(new_keys={"train.fedccrl.lamda1": 0.1})
    res = _stage(tmp_path, stage, STAGE_ARGS[stage], monkeypatch)
    (err,) = _assert_refused(res, tmp_path, tmp_path, "key 'train.fedccrl.lamda1': unknown key")
    assert "lambda1" in err  # what is allowed is listed


@pytest.mark.parametrize(
    "new_keys,needles",
    [
        ({"train.fedccrl.lamda1": 0.1}, ["key 'train.fedccrl.lamda1': unknown key (value 0.1); allowed keys here: "]),
        ({"trian": {}}, ["key 'trian': unknown key"]),
        ({"train.flower.min_client": 2}, ["key 'train.flower.min_client': unknown key"]),
    ],
    ids=["typo-in-algorithm-group", "unknown-group", "typo-in-flower"],
)
def test_unknown_keys(new_keys, needles, params, tiny, tmp_path, monkeypatch):
    params(new_keys=new_keys)
    _assert_refused(_train(tiny, tmp_path, monkeypatch), tmp_path, tmp_path, *needles)


@pytest.mark.parametrize(
    "overrides,needles",
    [
        ({"train.rounds": "ten"}, ["key 'train.rounds': got 'ten'; must be an integer"]),
        ({"train.lr": "0.001"}, ["key 'train.lr': got '0.001'; must be a number"]),
        ({"train.fast": "yes"}, ["key 'train.fast': got 'yes'; must be true or false"]),
        ({"train.fedccrl.severity": 3.5}, ["key 'train.fedccrl.severity': got 3.5; must be an integer"]),
        ({"train.held_out": "3"}, ["key 'train.held_out': got '3'; must be a list"]),
        ({"train.seeds": [True]}, ["key 'train.seeds[0]': got True; must be an integer"]),
        ({"preprocess.mean": [0.5, 0.5]}, ["key 'preprocess.mean': got [0.5, 0.5]; must have exactly 3 entries"]),
        ({"train.engine": DELETE}, ["key 'train.engine': missing"]),  # rounds, lr, ... take their declared defaults
    ],
    ids=["int", "number", "bool", "algorithm-int", "held_out-not-a-list", "bool-is-not-int", "length", "missing"],
)
def test_wrong_types(overrides, needles, params, tiny, tmp_path, monkeypatch):
    params(overrides)
    _assert_refused(_train(tiny, tmp_path, monkeypatch), tmp_path, tmp_path, *needles)


@pytest.mark.parametrize(
    "overrides,needles",
    [
        ({"train.lr": -0.001}, ["key 'train.lr': got -0.001; must be a number > 0"]),
        ({"train.fedccrl.r": 0.0}, ["key 'train.fedccrl.r': got 0.0; must be a number in (0, 1]"]),
        ({"train.fedalign.r": 1.5}, ["key 'train.fedalign.r': got 1.5; must be a number in (0, 1]"]),
        ({"train.client_fraction": 0}, ["key 'train.client_fraction': got 0; must be a number in (0, 1]"]),
        ({"partition.val_fraction": 1.0}, ["key 'partition.val_fraction': got 1.0; must be a number in (0, 1)"]),
        ({"partition.val_fraction": 0.0}, ["key 'partition.val_fraction': got 0.0; must be a number in (0, 1)"]),
        (
            {"train.lr": -1, "train.rounds": 0},
            ["key 'train.lr': got -1", "key 'train.rounds': got 0; must be an integer >= 1"],
        ),
        ({"train.algorithms": ["nope"]}, ["key 'train.algorithms[0]': got 'nope'; must be one of fedccrl, fedavg"]),
        (
            {"train.fedfd.u_low": 0.8, "train.fedfd.u_high": 0.2},
            ["key 'train.fedfd.u_high': got 0.2; must be >= u_low"],
        ),
    ],
    ids=[
        "negative-lr",
        "r-zero",
        "fedalign-r",
        "client-fraction",
        "val-fraction-1",
        "val-fraction-0",
        "two-problems-two-lines",
        "unknown-algorithm",
        "cross-field",
    ],
)
def test_out_of_range(overrides, needles, params, tiny, tmp_path, monkeypatch):
    params(overrides)
    errors = _assert_refused(_train(tiny, tmp_path, monkeypatch), tmp_path, tmp_path, *needles)
    assert len(errors) == len(needles)


@pytest.mark.parametrize(
    "held_out,needle",
    [
        ([1, 1], "key 'train.held_out': got [1, 1]; 1 listed more than once"),
        ([3, "sketch"], "key 'train.held_out[1]': got 'sketch'; names domain sketch as 3 does"),
        ([4], "key 'train.held_out[0]': got 4; synthetic has 4 domains, indices 0=photo, 1=art, 2=cartoon, 3=sketch"),
        (["skech"], "key 'train.held_out[0]': got 'skech'; must be a domain of synthetic: photo, art, cartoon, sketch"),
        ([-1], "key 'train.held_out[0]': got -1; must be an integer >= 0"),
    ],
)
def test_held_out_entries(held_out, needle, params, tiny, tmp_path, monkeypatch):
    params({"train.held_out": held_out})
    _assert_refused(_train(tiny, tmp_path, monkeypatch), tmp_path, tmp_path, needle)


def test_backbone_and_pretrained_that_do_not_fit(params, tiny, tmp_path, monkeypatch):
    params({"model.backbone": "small_cnn", "model.pretrained": "imagenet"})
    _assert_refused(
        _train(tiny, tmp_path, monkeypatch),
        tmp_path,
        tmp_path,
        "key 'model.pretrained': got 'imagenet'; small_cnn (model.backbone 'small_cnn') has no pretrained",
    )


def test_batch_of_one_for_a_batchnorm_model(params, tiny, tmp_path, monkeypatch):
    """batch_size 1 trains nothing with BatchNorm (the local loop skips batches of one): refused before MLflow.
    FedBN replaces train.batch_size with its own (64), so the same params train it."""
    params({"train.batch_size": 1})
    _assert_refused(
        _train(tiny, tmp_path, monkeypatch),
        tmp_path,
        tmp_path,
        "key 'train.batch_size': got 1; must be >= 2 for a BatchNorm model",
    )
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_core.foundation.errors import ParamError
    from fedccrl_pipeline.params import validate_params
    from fedccrl_pipeline.params_yaml import read_yaml
    from fedccrl_pipeline.sweep import check_train

    data, manifest = read_yaml(tmp_path / "params.yaml"), load_manifest(tiny / "data" / "shards")
    cfg = validate_params(data, ("fedbn",))
    assert cfg.train.fedbn.batch_size == 64  # fedfd-a.txt section 4.1
    assert check_train(cfg, manifest, "fedbn", ["sketch", 0]) == ["sketch", "photo"]
    data["train"]["fedbn"]["batch_size"] = 1
    with pytest.raises(ParamError, match=r"key 'train.fedbn.batch_size': got 1; must be an integer >= 2"):
        validate_params(data, ("fedbn",))


@pytest.mark.parametrize(
    "client,target,ok",
    [
        ({"id": "c0", "domain": "art", "n_train": 1}, "sketch", False),  # one sample: no batch BatchNorm can train on
        ({"id": "c0", "domain": "art", "n_train": 2}, "sketch", True),
        (
            {"id": "c0", "domain": "sketch", "n_train": 1},
            "sketch",
            True,
        ),  # the held-out domain's own client is not trained
        (
            {"id": "c0", "domain": "mixed", "n_train": 9, "train_domain_counts": {"art": 1, "sketch": 8}},
            "sketch",
            False,
        ),
        ({"id": "c0", "domain": "mixed", "n_train": 9, "train_domain_counts": {"art": 3, "sketch": 6}}, "sketch", True),
    ],
    ids=["one-sample", "two-samples", "held-out-client", "mixed-one-source-sample", "mixed-enough"],
)
def test_a_client_without_a_batchnorm_batch(client, target, ok):
    """From the manifest's counts (a feddg_bench client counts only its samples outside the held-out domain)."""
    from fixtures import bare_manifest

    from fedccrl_core.data.manifest import ClientEntry
    from fedccrl_core.foundation.errors import ParamError
    from fedccrl_pipeline.sweep import check_batches

    sizes = {"domain_index": 0, "k": 0, "file": "c.npz", "n_val": 0, "train_class_hist": [], "val_class_hist": []}
    clients = [ClientEntry(**sizes, **c) for c in ({"id": "c9", "domain": "photo", "n_train": 50}, client)]
    manifest = bare_manifest().model_copy(update={"clients": clients})
    if ok:
        check_batches(manifest, target, 32, "train.batch_size")
    else:
        with pytest.raises(ParamError, match=r"client c0 has 1 training sample .*partition.clients_per_domain"):
            check_batches(manifest, target, 32, "train.batch_size")


@pytest.mark.parametrize("listed", [["fedccrl", "ccst"], ["fedccrl"]], ids=["listed", "only-as---algorithm"])
def test_ccst_trained_without_adain_weights(listed, params, tiny, tmp_path, monkeypatch):
    """The default `adain_weights: null` is fine while CCST is not trained, and an error naming it when it is:
    listed in train.algorithms, or named by `fedccrl train --algorithm ccst` alone."""
    from fedccrl_pipeline.params import load_config

    params({"train.algorithms": listed})
    if listed == ["fedccrl"]:
        load_config(tmp_path / "params.yaml")  # the file itself is fine: CCST is not in the sweep
    res = _train(tiny, tmp_path, monkeypatch, algorithm="ccst")
    _assert_refused(res, tmp_path, tmp_path, "key 'train.ccst.adain_weights': got None; CCST needs the AdaIN weights")


def _train(tiny: Path, ws: Path, monkeypatch, algorithm: str = "fedccrl", held_out: str = "0", out: str = "out/model"):
    from click.testing import CliRunner

    from fedccrl_pipeline.train import command

    monkeypatch.chdir(ws)
    return CliRunner().invoke(
        command,
        [
            "--shards",
            str(tiny / "data" / "shards"),
            "--pools",
            str(tiny / "data" / "pools"),
            "--algorithm",
            algorithm,
            "--seed",
            "0",
            "--held-out",
            held_out,
            "--out",
            out,
            "--params",
            "params.yaml",
            "--checkpoints",
            "ck",
        ],
    )


def test_held_out_by_name_through_train_and_evaluate(params, tiny, tmp_path, monkeypatch):
    """`held_out: [sketch]`: train (--out models/<alg>/s0) writes the run to models/<alg>/s0/dsketch; the
    evaluate stage finds it there. The child run's MLflow params are the algorithm's declared hyperparameters."""
    from click.testing import CliRunner

    from fedccrl_core.algorithm_params.fedccrl import resolve_variant
    from fedccrl_core.algorithms import ALGORITHMS
    from fedccrl_pipeline.evaluate import command as evaluate

    params({**ONE_ROUND, "train.held_out": ["sketch"], "train.algorithms": ["fedccrl"]})
    res = _train(tiny, tmp_path, monkeypatch, held_out="sketch", out="models/fedccrl/s0")
    assert res.exit_code == 0, res.stderr[-3000:]
    meta = json.loads((tmp_path / "models/fedccrl/s0/dsketch/history.json").read_text())["meta"]
    assert (meta["held_out_domain"], meta["held_out_index"]) == ("sketch", 3)

    import mlflow

    client = mlflow.MlflowClient()
    (child,) = [
        r
        for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
        if r.data.tags.get("fedccrl.role") == "child"
    ]
    logged = {
        k.removeprefix("train.fedccrl."): v for k, v in child.data.params.items() if k.startswith("train.fedccrl.")
    }
    declared = resolve_variant(ALGORITHMS["fedccrl"].Params())  # the variant's switches logged as read
    assert logged == {k: str(v) for k, v in declared.model_dump().items()}
    assert child.data.params["train.held_out"] == "sketch"

    res = CliRunner().invoke(
        evaluate,
        [
            "--shards",
            str(tiny / "data" / "shards"),
            "--models",
            "models",
            "--out",
            "results/runs",
            "--params",
            "params.yaml",
        ],
    )
    assert res.exit_code == 0, res.stderr[-3000:]
    doc = json.loads((tmp_path / "results/runs/fedccrl/s0/dsketch.json").read_text())
    assert (doc["held_out_domain"], doc["held_out_index"]) == ("sketch", 3)


def test_held_out_index_and_name_reach_the_same_domain(tiny, tmp_path, monkeypatch):
    """Indices follow the manifest's domain order, which is the registry's (synthetic: photo, art, cartoon, sketch)."""
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_core.data.registry import get_dataset
    from fedccrl_pipeline.sweep import manifest_held_out

    manifest = load_manifest(tiny / "data" / "shards")
    assert manifest.domains == list(get_dataset("synthetic").domains)
    assert manifest_held_out(manifest, [3, "photo"]) == ["sketch", "photo"]
    with pytest.raises(ValueError, match=r"train.held_out\[1\]'.*names domain sketch as 3 does"):
        manifest_held_out(manifest, [3, "sketch"])


def test_yaml_exponent_floats_are_numbers(params):
    """DVC writes `-S train.lr=1e-3` as 1e-3, which YAML 1.1 (PyYAML) would read as a string."""
    from fedccrl_pipeline.params import load_config

    path = params()
    path.write_text(re.sub(r"(?m)^  lr: .*$", "  lr: 1e-3", path.read_text()))
    assert load_config(path).train.lr == 0.001


def test_params_yaml_is_read_as_dvc_reads_it(tmp_path):
    """One YAML reader, ruamel's safe loader as DVC's: YAML 1.2 scalars (`1e-3` the float 0.001, `yes` a string,
    as DVC passes them on), and a repeated key or a tag that builds an object is an error naming the file and line,
    before any validation."""
    from fedccrl_core.foundation.errors import ParamError
    from fedccrl_pipeline.params_yaml import parse_yaml, read_yaml

    assert parse_yaml("a: 1e-3\nb: yes\nc: 1_000\nd: [1, .5]") == {"a": 0.001, "b": "yes", "c": 1000, "d": [1, 0.5]}
    bad = tmp_path / "params.yaml"
    bad.write_text("train:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ParamError, match=rf"{re.escape(str(bad))}: not valid YAML \(DuplicateKeyError at line 3\)"):
        read_yaml(bad)
    bad.write_text("train: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ParamError, match=r"not valid YAML \(ConstructorError at line 1\)"):
        read_yaml(bad)


# Records validated more than once from the same data in the run below (fedccrl_core/foundation/records.py promises
# once): record -> why. The table is exact: a new repeat fails the test, and so does one that no longer happens until
# it leaves the table.
KNOWN_REPEATS = {
    "RoundCheckpoint": "the round checkpoint, read back from its temporary file before it replaces the last one "
    "(fedccrl_core/foundation/fsio.py atomic_file's `verify`): a check of the bytes written, on purpose",
}


def test_a_training_process_validates_the_config_once(tiny, tmp_path, monkeypatch, params, not_private):
    """`fedccrl train` of one algorithm, in this process, with train.privacy on: the params file is validated once
    (ParamsFile); the train settings, the algorithm's Params and the privacy settings travel typed from there (no
    second validation of train.*, train.<algorithm> or train.privacy by the stage, the algorithm, the round loop or
    the job). The records (fedccrl_core/foundation/records.py: the manifests, the round checkpoints, the model's
    meta, the history) are validated once each where they are read or built, and handed on typed: no record is
    validated twice from the same data, but for KNOWN_REPEATS. Every way a pydantic model is validated is counted:
    `Model(**data)`, `model_validate`, `model_validate_json` and `model_validate_strings`."""
    import fedccrl_core.data.manifest as manifest_mod
    from fedccrl_core.foundation.hparams import Declared
    from fedccrl_core.foundation.records import Record
    from fedccrl_pipeline.params import ParamsFile

    monkeypatch.setattr(manifest_mod, "_PARSED", {})  # manifests this process parsed before the run: parsed again
    seen: list[tuple[type, object]] = []
    built = count_validations(monkeypatch, seen)
    params(
        {**ONE_ROUND, "train.privacy.enabled": True}, new_keys={"train.privacy.noise_seed": 0}
    )  # test-only: a seeded noise
    res = _train(tiny, tmp_path, monkeypatch)
    assert res.exit_code == 0, res.stderr[-3000:]
    assert (tmp_path / "out/model/d0/model.pt").is_file()
    ours = [c for c in built if issubclass(c, Declared)]
    assert ours == [ParamsFile], [c.__name__ for c in ours]
    records = [(c, data) for c, data in seen if issubclass(c, Record)]
    kinds = {c.__name__ for c, _ in records}
    assert {"ShardManifest", "PoolManifest", "RoundCheckpoint", "ModelMeta", "RunHistory"} <= kinds, kinds
    keys = [(c.__name__, json.dumps(data, sort_keys=True, default=repr)) for c, data in records]  # a tuple as a list
    repeated = {name for name, data in keys if keys.count((name, data)) > 1}
    assert repeated == set(KNOWN_REPEATS), f"validated twice from the same data: {sorted(repeated)}"


def count_validations(monkeypatch, data: list | None = None) -> list[type]:
    """The classes of the pydantic models validated from now on (until the test ends), one entry per model a caller
    builds from data: each of BaseModel's validating constructors is wrapped on BaseModel itself, which every model
    inherits them from. A model nested in one being validated is part of that validation, not one of its own;
    `model_construct` validates nothing (a model built from values validated already) and is not counted. `data`,
    when given, receives (class, the data validated) for each."""
    import functools

    from pydantic import BaseModel

    built: list[type] = []
    init = BaseModel.__init__

    def count(cls: type, given: object) -> None:
        built.append(cls)
        if data is not None:
            data.append((cls, given))

    @functools.wraps(init)  # keeps __pydantic_base_init__: a model class defined meanwhile is not a custom-init one
    def counting_init(self, /, **kwargs):
        count(type(self), kwargs)
        init(self, **kwargs)

    monkeypatch.setattr(BaseModel, "__init__", counting_init)
    for name in ("model_validate", "model_validate_json", "model_validate_strings"):
        constructor = BaseModel.__dict__[name].__func__

        def counting(cls, obj, *args, _constructor=constructor, **kwargs):
            count(cls, obj)
            return _constructor(cls, obj, *args, **kwargs)

        monkeypatch.setattr(BaseModel, name, classmethod(counting))
    return built


def test_every_way_of_validating_a_model_is_counted(monkeypatch):
    """The counter above sees a model validated from keywords, from a mapping, from JSON and from strings, and
    neither the models nested in it nor one built from validated values."""
    from fedccrl_core.algorithm_params.train import LocalConfig
    from fedccrl_core.privacy.settings import PrivacySettings

    built = count_validations(monkeypatch)
    LocalConfig(rounds=2, privacy={"enabled": True})
    LocalConfig.model_validate({"rounds": 2})
    LocalConfig.model_validate_json('{"rounds": 2}')
    LocalConfig.model_validate_strings({"rounds": "2"})
    PrivacySettings.model_construct()
    assert built == [LocalConfig, LocalConfig, LocalConfig, LocalConfig]
