"""Everything spelled outside an algorithm's declaration (`Algorithm.Params`) is tested against it: the
registry of classes (ALGORITHMS) against the torch-free PARAMS, params.yaml's `train.<algorithm>` groups (every registered algorithm has one, FedAvg's is empty, so dvc.yaml's
`train.${item.algorithm}` resolves; exactly the declared keys and defaults), the docs' hyperparameters page, and dvc.yaml's
params lists against the typed model of params.yaml (pipeline/fedccrl_pipeline/params.py)."""

from pathlib import Path

import pytest
import yaml
from fixtures import bare_manifest, params_group_problems, registry_problems

from fedccrl_core.algorithm_params import PARAMS as REGISTERED_PARAMS
from fedccrl_core.algorithms import ALGORITHMS

ROOT = Path(__file__).resolve().parents[1]
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())


def test_the_classes_and_their_params_are_registered_alike():
    """ALGORITHMS (the classes, imported by name) and PARAMS (their hyperparameters, without torch, which params.yaml's
    validation reads) list the same algorithms in the same order, each class with the Params registered under its
    name."""
    assert len(ALGORITHMS) == len(REGISTERED_PARAMS) >= 15
    assert registry_problems(REGISTERED_PARAMS, ALGORITHMS) == []


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_params_group_matches_declaration(name):
    assert params_group_problems(name, ALGORITHMS[name].Params, PARAMS["train"]) == []


@pytest.mark.full("dvc's own resolution of params.yaml")
def test_every_algorithm_resolves_in_dvc(tmp_path):
    """`dvc repro --dry` of one train stage per algorithm, in a scratch clone: no 'Parameters train.<alg> are
    missing' (the PACS recipe, the sweeps and `make bench-table1` all list fedavg)."""
    import shutil
    import subprocess
    import sys

    dvc = shutil.which("dvc", path=str(Path(sys.executable).parent)) or shutil.which("dvc")
    if dvc is None:
        pytest.skip("dvc is not installed")
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    shutil.copy(ROOT / "params.yaml", repo / "params.yaml")  # the working tree's params, committed or not
    shutil.copy(ROOT / "dvc.yaml", repo / "dvc.yaml")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"]["algorithms"] = sorted(ALGORITHMS)
    params["train"]["held_out"] = [0]
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    for d in ("data/shards", "data/pools"):
        (repo / d).mkdir(parents=True)
    for name in sorted(ALGORITHMS):
        r = subprocess.run(
            [dvc, "repro", "--dry", "--single-item", f"train@{name}-0"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, f"{name}: {r.stdout[-500:]} {r.stderr[-500:]}"
        assert f"--algorithm {name} " in r.stdout


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_hyperparameter_has_a_source(name):
    """hp(default, source, ...): the paper's equation or table, a reference implementation, or our reason."""
    params = ALGORITHMS[name].Params
    missing = [k for k, src in params.sources().items() if len(src.strip()) < 10]
    assert not missing, f"train.{name}: declare a source for {missing} (fedccrl_core/foundation/hparams.py hp())"


def test_repository_params_validate():
    from fedccrl_pipeline.params import load_config

    cfg = load_config(ROOT / "params.yaml")
    for name in ALGORITHMS:  # each group as the typed declaration reads it: the declared defaults
        assert getattr(cfg.train, name).model_dump() == ALGORITHMS[name].Params().model_dump()


def test_hyperparameter_doc_is_generated_from_the_declarations():
    import importlib.util

    from fedccrl_core.foundation.hparams import markdown

    want = markdown({name: cls.Params for name, cls in ALGORITHMS.items()})
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert hooks.hyperparameters_markdown() == want  # the page mkdocs builds is the declarations' text
    assert not (ROOT / "docs" / "hyperparameters.md").exists(), (
        "docs/hyperparameters.md is generated when the site is built: delete the copy, it would go stale"
    )
    for name, cls in ALGORITHMS.items():  # and it can fail: every key, default and bound is in it
        for key, _f in cls.Params.model_fields.items():
            assert f"| `{key}` |" in want.split(f"## `train.{name}`")[1].split("\n## ")[0]


def _dvc_params() -> dict[str, list[str]]:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    return {name: [p for p in st.get("params", []) if isinstance(p, str)] for name, st in stages.items()}


def _model_at(key: str):
    """The pydantic field or model that a dotted params.yaml key names in pipeline/fedccrl_pipeline/params.py's ParamsFile."""
    from pydantic import BaseModel

    from fedccrl_pipeline.params import ParamsFile

    node = ParamsFile
    for part in key.split("."):
        assert isinstance(node, type) and issubclass(node, BaseModel), f"{key}: {part} is inside a value"
        fields = {(f.alias or n): f for n, f in node.model_fields.items()}
        assert part in fields, f"dvc.yaml names params key {key!r}, which params.yaml's model has not"
        node = fields[part].annotation
    return node


def test_dvc_params_name_keys_of_the_typed_model():
    """A dvc.yaml params entry that names no key of the typed model is a stage that never reruns when it should."""
    for _stage, keys in _dvc_params().items():
        for key in keys:
            if "${" in key:
                continue
            _model_at(key)


def test_train_stage_depends_on_every_shared_train_setting():
    """dvc.yaml's train stage lists every train.* setting of the typed model but its matrix (a change retrains), its algorithm's
    own group through train.${item.algorithm}, and no other algorithm's group (changing FedProx's mu must not
    retrain FedCCRL)."""
    from fedccrl_pipeline.params_groups import TrainSweep

    keys = set(_dvc_params()["train"])
    matrix = {"algorithms", "seeds"}  # the stage's matrix: each (algorithm, seed) is its own stage
    shared = {f"train.{k}" for k in TrainSweep.model_fields} - {f"train.{k}" for k in matrix}
    assert "train.held_out" in keys  # one stage trains every held-out domain: a change to the list retrains
    assert shared <= keys, f"dvc.yaml train stage misses {sorted(shared - keys)}"
    assert "train.${item.algorithm}" in keys
    assert not {f"train.{name}" for name in ALGORITHMS} & keys
    assert not {f"train.{k}" for k in matrix} & keys


def _defaults(model, prefix: str = "") -> dict:
    """{dotted key: declared default} of every field with a default in `model` and its nested models."""
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    out = {}
    for name, f in model.model_fields.items():
        key = f"{prefix}{f.alias or name}"
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(_defaults(ann, key + "."))
        elif f.default is not PydanticUndefined:
            out[key] = f.default
    return out


def test_every_registry_default_is_params_yaml_value():
    """A default is written once, in the typed registry (pipeline/fedccrl_pipeline/params.py's groups, the library's TrainSettings
    and LocalConfig, each algorithm's Params, fedccrl_flower/settings.py), and params.yaml's value is the same:
    the run a missing key gives is the run the committed file describes."""
    from fedccrl_core.algorithm_params.train import LocalConfig, TrainSettings
    from fedccrl_core.learning.statistics import IMAGENET_MEAN, IMAGENET_STD
    from fedccrl_flower.settings import FlowerSettings
    from fedccrl_flower.spec import ServerSpec
    from fedccrl_pipeline.params import ParamsFile
    from fedccrl_pipeline.params_yaml import read_yaml

    data = read_yaml(ROOT / "params.yaml")  # as the stages read it (YAML 1.2 numbers)

    def at(key):
        node = data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return KeyError
            node = node[part]
        return node

    defaults = _defaults(ParamsFile)
    assert {"train.lr", "train.local_epochs", "train.flower.query_timeout_s", "train.fedccrl.r"} <= set(defaults)
    compared = 0
    for key, default in defaults.items():
        value = at(key)
        if value is KeyError:
            continue
        compared += 1
        assert (value == default and type(value) is type(default)) or (
            isinstance(default, float) and isinstance(value, int) and float(value) == default
        ), f"{key}: params.yaml {value!r}, declared default {default!r}"
    assert compared > 100
    for key in TrainSettings.model_fields:  # the library's LocalConfig takes the same defaults
        assert getattr(LocalConfig(), key) == data["train"][key], key
    assert (LocalConfig().mean, LocalConfig().std) == (IMAGENET_MEAN, IMAGENET_STD)
    assert tuple(data["preprocess"]["mean"]) == IMAGENET_MEAN and tuple(data["preprocess"]["std"]) == IMAGENET_STD
    for key in ServerSpec.FROM_SETTINGS:  # the Flower server's waits: FlowerSettings' defaults
        assert ServerSpec.model_fields[key].default == FlowerSettings.model_fields[key].default


def test_lr_written_1e_3_is_the_float_0_001_in_validation_and_training(tmp_path):
    """`lr: 1e-3` (YAML 1.2 reads a number, PyYAML's 1.1 a string) is 0.001 in the typed model, in the
    LocalConfig every algorithm trains with, in the training job, and in the values the run key hashes."""
    import re

    from fedccrl_core.algorithms import build_algorithm
    from fedccrl_core.federation.plan import plan_runs
    from fedccrl_pipeline.params import load_config
    from fedccrl_pipeline.training import run_settings

    path = tmp_path / "params.yaml"
    path.write_text(re.sub(r"(?m)^  lr: .*$", "  lr: 1e-3", (ROOT / "params.yaml").read_text()))
    cfg = load_config(path)
    assert cfg.train.lr == 0.001 and type(cfg.train.lr) is float
    assert cfg.as_written()["train"]["lr"] == 0.001
    settings = run_settings(cfg)
    assert settings.local.lr == 0.001 and type(settings.local.lr) is float
    assert build_algorithm("fedavg", settings.local).local.lr == 0.001
    manifest = bare_manifest()
    (job,) = plan_runs(
        settings,
        cfg.partition.model_dump(by_alias=True),
        manifest,
        "fedavg",
        0,
        [3],
        ["sketch"],
        tmp_path / "models",
        tmp_path / "ck",
        cfg.train.fedavg,
    )
    assert job.settings.local.lr == 0.001
    import pickle

    assert pickle.loads(pickle.dumps(job)) == job  # a worker receives it whole
    other = load_config(ROOT / "params.yaml")
    (job2,) = plan_runs(
        run_settings(other),
        other.partition.model_dump(by_alias=True),
        manifest,
        "fedavg",
        0,
        [3],
        ["sketch"],
        tmp_path / "models",
        tmp_path / "ck",
        other.train.fedavg,
    )
    assert job2.run_key != job.run_key  # the key hashes the learning rate as a number
