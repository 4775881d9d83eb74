"""What the tests share, as plain functions: conftest.py wraps them in fixtures; a module-level helper (a
module-scoped workspace, a Case's setup) calls them directly. Not a test module: nothing here is collected.

- `write_params(folder, overrides)`: the repository's params.yaml with dotted-key overrides, written to
  <folder>/params.yaml (the one writer of a test's params.yaml; the `params` fixture wraps it).
- `build_tiny(base)`: the one tiny dataset (raw synthetic images, shards, pools); the session fixture `tiny`.
- `train_tiny(ws, tiny)`: one tiny fedavg run trained and evaluated by the stage CLIs; the session fixture `trained`.
- `dvc_env(ws)`, `dvc_run(args, ws)`: a command in a scratch DVC workspace.
- `tiny_onnx(path)`: a fedccrl-format ONNX file without torch. `temps(folder)`: the temporary files left there.
- `bare_manifest()`: a shard manifest of the synthetic domains without clients (what planning a run reads).
- `held_out_run(alg, model, clients, target, rounds, ...)`: one held-out training on in-memory clients, for the
  training driver (fedccrl_core/federation/driver.py `train`): the one way a test sets up a run;
  `evalsets_for(clients, target)`: its evaluation sets alone (the engine's own tests build the engine by hand).
- `write_run_history(folder, meta, **round_fields)`: a one-round history.json beside a model file written by hand
  (what `fedccrl export` reads for the model card).
- `params_group_problems(name, params_cls, train_groups)`: how params.yaml's train.<name> differs from the
  algorithm's declaration (tests/test_params_registry.py, tests/test_add_an_algorithm.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

DELETE = object()  # an override's value that deletes the key (a test of a missing key)
ONE_ROUND = {"train.rounds": 1, "train.local_epochs": 1, "train.device": "cpu"}  # the overrides of a training test
TINY_IMAGES_PER_CLASS = 8  # the tiny dataset: synthetic, 4 domains x 6 classes x 8 images, 32 px, 2 clients a domain


def bare_manifest():
    from fedccrl_core.data.manifest import FORMAT_VERSION, ShardManifest

    return ShardManifest(
        format_version=FORMAT_VERSION,
        dataset="synthetic",
        domains=["photo", "art", "cartoon", "sketch"],
        classes=["a", "b"],
        num_classes=2,
        image_size=32,
        layout="uint8 NHWC",
        seed=0,
        params={},
        domain_sizes={},
        clients=[],
        skipped=[],
    )


# ------------------------------------------------------------------ params.yaml
def write_params(folder: Path, overrides: dict | None = None, *, new_keys: dict | None = None) -> Path:
    """<folder>/params.yaml: the repository's params.yaml with `overrides` ({"train.fedccrl.r": 0.5}; a key that
    does not exist is an error, as in `dvc exp run -S`; the value DELETE removes the key) and `new_keys`, keys
    params.yaml does not have (a test of an unknown key: {"train.fedfoo": {"x": 1}}; its parent must exist)."""
    from fedccrl_pipeline.params_yaml import read_yaml, set_key

    p = read_yaml(REPO / "params.yaml")
    for dotted, value in (overrides or {}).items():
        set_key(p, dotted, value)  # the key must exist, also to delete it
        if value is DELETE:
            *head, last = dotted.split(".")
            del _node(p, head)[last]
    for dotted, value in (new_keys or {}).items():
        *head, last = dotted.split(".")
        node = _node(p, head)
        assert last not in node, f"{dotted} is in params.yaml: set it through overrides"
        node[last] = value
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(p, sort_keys=False))
    return path


def _node(p: dict, head: list[str]) -> dict:
    for h in head:
        p = p[h]
    return p


# ------------------------------------------------------------------ the tiny dataset and one run trained on it
def build_tiny(base: Path) -> Path:
    """<base>/raw, <base>/data/shards and <base>/data/pools of the embedded synthetic dataset, TINY_IMAGES_PER_CLASS
    images per class, partitioned and pooled with params.yaml's settings (the library's own writers)."""
    from fedccrl_core.data.partition import PartitionSettings, partition
    from fedccrl_core.data.pools import build_pools
    from fedccrl_core.data.registry import get_dataset
    from fedccrl_core.data.synthetic import generate
    from fedccrl_pipeline.params_yaml import read_yaml

    p = read_yaml(REPO / "params.yaml")
    assert p["dataset"]["name"] == "synthetic", "the embedded default is the synthetic dataset"
    generate(base / "raw", seed=p["dataset"]["seed"], images_per_class=TINY_IMAGES_PER_CLASS, progress=False)
    partition(
        base / "raw",
        base / "data" / "shards",
        get_dataset("synthetic"),
        PartitionSettings(
            32,
            clients_per_domain=p["partition"]["clients_per_domain"],
            val_fraction=p["partition"]["val_fraction"],
            seed=p["partition"]["seed"],
        ),
        workers=1,
        progress=False,
    )
    build_pools(
        base / "data" / "shards",
        base / "data" / "pools",
        p["preprocess"]["mean"],
        p["preprocess"]["std"],
        progress=False,
    )
    return base


def train_tiny(ws: Path, tiny: Path) -> Path:
    """One fedavg run (seed 0, held-out domain 0) trained and evaluated on `tiny` by the stage CLIs in `ws`, with
    its own MLflow store there: models/, runs/, ck/, mlflow.db."""
    import pytest
    from click.testing import CliRunner

    from fedccrl_pipeline.cli import main

    write_params(ws, {**ONE_ROUND, "train.algorithms": ["fedavg"], "train.seeds": [0], "train.held_out": [0]})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{ws / 'mlflow.db'}")
        mp.setenv("FEDCCRL_MLFLOW_ARTIFACTS", str(ws / "mlartifacts"))
        mp.chdir(ws)
        data = tiny / "data"
        for args in (
            [
                "train",
                "--shards",
                data / "shards",
                "--pools",
                data / "pools",
                "--algorithm",
                "fedavg",
                "--seed",
                "0",
                "--held-out",
                "0",
                "--out",
                "models/fedavg/s0",
                "--checkpoints",
                "ck",
            ],
            ["evaluate", "--shards", data / "shards", "--models", "models", "--out", "runs"],
        ):
            res = CliRunner().invoke(main, [*map(str, args), "--params", "params.yaml"])
            assert res.exit_code == 0, res.output[-3000:]
    return ws


# ------------------------------------------------------------------ a DVC workspace
def dvc_env(ws: Path) -> dict:
    """The environment of a command in a scratch DVC workspace `ws`: this interpreter's scripts first (its
    installed packages), the MLflow store ws/mlflow.db."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{ws / 'mlflow.db'}"
    env["DVC_NO_ANALYTICS"] = "1"
    return env


def dvc_run(args, ws: Path, check=True, **kw) -> subprocess.CompletedProcess:
    """`args` run in `ws` with dvc_env(ws); with check, a failure is an AssertionError with its output's tail."""
    p = subprocess.run(args, cwd=ws, env=dvc_env(ws), capture_output=True, text=True, **kw)
    if check and p.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, args))} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
        )
    return p


# ------------------------------------------------------------------ serving and files
def tiny_onnx(
    path: Path,
    *,
    size: int = 4,
    classes=("a", "b", "c", "d"),
    graph_size: int | None = None,
    logits: int | str | None = None,
    nan: bool = False,
    **props,
) -> Path:
    """A fedccrl-format ONNX file without torch: logits = the first K values of the flattened input
    (or NaN with nan=True). `graph_size` / `logits` make the graph disagree with the metadata."""
    import onnx
    from onnx import TensorProto, helper

    from fedccrl_core.data.images import RESIZE_POLICY

    gs = graph_size or size
    k = len(classes) if logits is None else logits
    nodes = [
        helper.make_node("Flatten", ["images"], ["flat"]),
        helper.make_node("Slice", ["flat", "s", "e", "ax"], ["sl"]),
    ]
    nodes += (
        [helper.make_node("Sub", ["sl", "sl"], ["z"]), helper.make_node("Div", ["z", "z"], ["logits"])]
        if nan
        else [helper.make_node("Identity", ["sl"], ["logits"])]
    )
    kk = k if isinstance(k, int) else len(classes)
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, gs, gs])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", k])],
        [helper.make_tensor(n, TensorProto.INT64, [1], [v]) for n, v in (("s", 0), ("e", kk), ("ax", 1))],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    meta = {
        "fedccrl_format": "1",
        "classes": json.dumps(list(classes)),
        "num_classes": str(len(classes)),
        "image_size": str(size),
        "mean": "[0.5, 0.5, 0.5]",
        "std": "[0.25, 0.25, 0.25]",
        "resize": RESIZE_POLICY,
    }
    meta.update({key: str(v) for key, v in props.items()})
    helper.set_model_props(m, meta)
    onnx.save(m, path)
    return path


def temps(folder: Path) -> list[str]:
    """The names of the temporary files an atomic write left in `folder`."""
    from fedccrl_core.foundation import temp_paths

    return sorted(p.name for p in folder.iterdir() if temp_paths.TEMP_RE.match(p.name))


# ------------------------------------------------------------------ one held-out training on in-memory clients
def evalsets_for(clients, target, batch_size: int = 64):
    """The evaluation sets every run builds (EvalSets.for_target): the val splits of `clients` and `target`, the
    held-out (images, labels): uint8 NHWC arrays as the shards hold them, or a toy client's NCHW uint8 tensors."""
    import torch

    from fedccrl_core.federation.loop import EvalSets

    x, y = target
    if isinstance(x, torch.Tensor):  # a toy client's split, NCHW, back to the shards' NHWC
        x, y = x.permute(0, 2, 3, 1).numpy(), y.numpy()
    return EvalSets.for_target(clients, x, y, batch_size, "cpu")


def held_out_run(
    alg, model, clients, target, rounds: int, *, seed: int = 0, batch_size: int = 64, val_clients=None, **settings
):
    """fedccrl_core/federation/driver.py's HeldOutRun of `alg` and `model` on `clients`, evaluated on the val splits
    of `val_clients` (default: `clients`) and on `target` (`evalsets_for`). `settings`: HeldOutRun's other fields
    (client_fraction, checkpoint_path, run_info, ...)."""
    from fedccrl_core.federation.driver import HeldOutRun

    evalsets = evalsets_for(clients if val_clients is None else val_clients, target, batch_size)
    return HeldOutRun(alg, model, clients, evalsets, rounds, seed, **settings)


def params_group_problems(name: str, params_cls, train_groups: dict) -> list[str]:
    """How params.yaml's `train.<name>` group (in `train_groups`, params.yaml's `train` mapping) differs from the
    algorithm's declaration `params_cls`: it must exist (dvc.yaml's train.${item.algorithm} resolves it) and hold
    exactly the declared keys with their declared defaults. [] when it matches."""
    if name not in train_groups:
        return [f"params.yaml has no train.{name} group (DVC runs listing {name} would fail)"]
    group = train_groups[name] or {}
    declared = params_cls().model_dump()
    if set(group) != set(declared):
        return [f"train.{name}: params.yaml keys {sorted(group)} != declared {sorted(declared)}"]
    return [
        f"train.{name}.{key}: params.yaml {group[key]!r} != declared default {value!r}"
        for key, value in declared.items()
        if group[key] != value
    ]


def registry_problems(params: dict, algorithms: dict) -> list[str]:
    """How the torch-free list of hyperparameters (`params`, fedccrl_core/algorithm_params' PARAMS) and the registry
    of classes (`algorithms`, fedccrl_core/algorithms' ALGORITHMS) disagree: the same names in the same order, each
    class named as it is registered, its `Params` the one registered under its name. [] when they agree."""
    if list(params) != list(algorithms):
        return [f"PARAMS lists {list(params)}, ALGORITHMS {list(algorithms)}"]
    out = []
    for name, cls in algorithms.items():
        if cls.name != name:
            out.append(f"ALGORITHMS[{name!r}] is {cls.__name__}, whose name is {cls.name!r}")
        if cls.Params is not params[name]:
            out.append(
                f"{name}: {cls.__name__}.Params is {cls.Params.__name__}, PARAMS[{name!r}] is {params[name].__name__}"
            )
    return out


def write_run_history(folder: Path, meta, privacy=None, **round_fields):
    """A one-round history.json (and history.csv) of the run whose model meta is `meta`, into `folder`; `round_fields`
    add to or replace the round's record fields, `privacy` is its RunPrivacySummary."""
    from fedccrl_core.federation.history import write_history
    from fedccrl_core.federation.round_record import RoundRecord
    from fedccrl_core.foundation import contract

    record = {
        contract.ROUND: 1,
        contract.VAL_ACC: 0.5,
        contract.TARGET_ACC: 0.25,
        contract.VAL_PRED_CLASSES: 2,
        contract.SECONDS: 1.0,
        contract.BYTES_UP: 10,
        contract.BYTES_DOWN: 20,
        **round_fields,
    }
    fields = {k: v for k, v in meta.to_dict().items() if k != "round"}  # a history's meta has no round
    return write_history(folder, type(meta)(**fields), 1, [RoundRecord(**record)], privacy)
