"""docs/contributing.md's "Add an algorithm", followed step by step with a toy algorithm: its class
(tests/toy_algorithm.py) naming its Params (tests/toy_params.py, without torch), registered in both lists (its
Params in PARAMS, its class in the registry's REGISTERED, which ALGORITHMS is built from), its params.yaml group
checked against the class, its hyperparameter table generated, and one round trained by the training driver on tiny
in-memory clients. `monkeypatch.setitem` stands for the two lines a real algorithm adds (and takes them out again
after the test). params.yaml's typed model (pipeline/fedccrl_pipeline/params.py) is built from PARAMS when it is
imported, as a real line is there before any import: its test registers the toy's Params in a fresh interpreter
before that import, and that validation imports no torch (the class side of step 2 is checked in this process)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import held_out_run, params_group_problems, registry_problems
from toy_algorithm import Toy  # step 1: the algorithm, naming its Params
from toy_params import ToyParams  # step 1: its hyperparameters, without torch

from fedccrl_core.algorithm_params import PARAMS
from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import ALGORITHMS, algorithm_class, build_algorithm
from fedccrl_core.data.pools import compute_statistics
from fedccrl_core.federation.driver import build_seeded_model, train
from fedccrl_core.foundation.errors import ParamError
from fedccrl_core.learning.clients import ClientData
from fedccrl_core.learning.statistics import IMAGENET_MEAN, IMAGENET_STD

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def registered(monkeypatch):
    """Step 2: the algorithm's line in PARAMS and its class in the registry's REGISTERED (ALGORITHMS)."""
    monkeypatch.setitem(PARAMS, "toy", ToyParams)
    monkeypatch.setitem(ALGORITHMS, "toy", Toy)


def _clients(n_clients=3, n=12, size=16):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n_clients):
        x = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
        y = rng.integers(0, 4, n)
        stats = compute_statistics(x, IMAGENET_MEAN, IMAGENET_STD)
        out.append(ClientData.from_numpy(f"c{i}", f"d{i}", x, y, x[:3], y[:3], "cpu", *stats))
    return out


def _train_one_round(name: str, hparams: dict | None = None):
    clients = _clients()
    alg = build_algorithm(name, LocalConfig(rounds=1, local_epochs=1, batch_size=5), hparams)
    model = build_seeded_model(alg, "small_cnn", 4, "none", seed=0)
    target = (clients[2].val_x, clients[2].val_y)
    return train(held_out_run(alg, model, clients[:2], target, 1), log=lambda m: None)


def test_an_unregistered_algorithm_is_not_found():
    assert "toy" not in PARAMS and "toy" not in ALGORITHMS
    with pytest.raises(ValueError, match="unknown algorithm 'toy'"):
        build_algorithm("toy", LocalConfig())


def test_the_two_registry_lines_agree(registered):
    assert algorithm_class("toy") is Toy
    assert registry_problems(PARAMS, ALGORITHMS) == []


def test_a_registry_line_that_disagrees_is_found(monkeypatch):
    """The class registered without its Params, or with another class's Params, fails the registry's test
    (tests/test_params_registry.py)."""
    monkeypatch.setitem(ALGORITHMS, "toy", Toy)
    assert registry_problems(PARAMS, ALGORITHMS) == [f"PARAMS lists {list(PARAMS)}, ALGORITHMS {list(ALGORITHMS)}"]

    class Stray(ToyParams):
        """Not Toy's Params."""

    monkeypatch.setitem(PARAMS, "toy", Stray)
    assert registry_problems(PARAMS, ALGORITHMS) == ["toy: Toy.Params is ToyParams, PARAMS['toy'] is Stray"]


def test_its_params_yaml_group_is_checked_against_the_class(registered):
    """Step 3: train.toy in params.yaml holds exactly the declared keys and defaults, and is validated by them."""
    assert params_group_problems("toy", ToyParams, {"toy": {"scale": 1.0}}) == []
    assert params_group_problems("toy", ToyParams, {"toy": {"scale": 2.0}}) == [
        "train.toy.scale: params.yaml 2.0 != declared default 1.0"
    ]
    assert params_group_problems("toy", ToyParams, {}) != []
    assert build_algorithm("toy", LocalConfig(), {"scale": 0.5}).hp.scale == 0.5
    with pytest.raises(ParamError, match=r"train\.toy\.scale"):
        build_algorithm("toy", LocalConfig(), {"scale": 0})


# In a fresh interpreter: the registry line of PARAMS, then params.yaml's model (built at its import), then the checks
PARAMS_YAML_CHECK = """
import json, sys
from fedccrl_core.algorithm_params import PARAMS

if sys.argv[2] == "registered":  # step 2's line in PARAMS, before params.yaml's model is built from it
    import importlib.util

    spec = importlib.util.spec_from_file_location("toy_params", sys.argv[3])
    toy_params = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy_params)
    PARAMS["toy"] = toy_params.ToyParams
from fedccrl_core.foundation.errors import ParamError
from fedccrl_pipeline.params import validate_params
from fedccrl_pipeline.params_yaml import read_yaml

out = {"torch": "torch" in sys.modules}  # validation reads PARAMS, never the classes: no torch
for scale in (1.0, 0):
    data = read_yaml(sys.argv[1])
    data["train"]["algorithms"] = ["toy"]
    data["train"]["toy"] = {"scale": scale}
    try:
        cfg = validate_params(data)
        out[str(scale)] = [type(cfg.train.toy).__name__, cfg.train.toy.scale]
    except ParamError as e:
        out[str(scale)] = str(e)
print(json.dumps(out))
"""


def _params_yaml_with_toy(registered: bool) -> dict:
    """params.yaml with `train.algorithms: [toy]` and `train.toy.scale` 1.0, then 0, validated in a fresh
    interpreter, with or without the toy's line in PARAMS: what each gave (the typed group, or the ParamError)."""
    arg = "registered" if registered else "unregistered"
    toy_params = Path(__file__).with_name("toy_params.py")  # loaded by its path: nothing put on sys.path
    code = [sys.executable, "-c", PARAMS_YAML_CHECK, str(ROOT / "params.yaml"), arg, str(toy_params)]
    done = subprocess.run(code, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_params_yaml_accepts_it_once_registered():
    """Step 2's promise: with its line in PARAMS, params.yaml's model accepts `train.algorithms: [toy]` and
    validates `train.toy` against ToyParams (scale 0 is refused, naming the key); without it, `toy` is refused."""
    got = _params_yaml_with_toy(registered=True)
    assert got["torch"] is False
    assert got["1.0"] == ["ToyParams", 1.0]
    assert "'train.toy.scale': got 0; must be a number > 0" in got["0"], got["0"]
    refused = _params_yaml_with_toy(registered=False)
    assert "'train.algorithms[0]': got 'toy'; must be one of fedccrl" in refused["1.0"], refused["1.0"]


def test_its_hyperparameter_table_is_generated(registered):
    """Step 4: the docs' table comes from the registry, with no edit of the docs."""
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    table = hooks.hyperparameters_markdown().split("## `train.toy`")[1].split("\n## ")[0]
    assert "| `scale` |" in table and "Eq. 1 times scale" in table


def test_the_driver_trains_it_one_round(registered):
    """The toy's step is what trains: at scale 1 its round is FedAvg's, bit for bit; at another scale its loss is
    not."""
    fedavg, toy, scaled = _train_one_round("fedavg"), _train_one_round("toy"), _train_one_round("toy", {"scale": 3.0})
    assert len(toy.history) == 1 and toy.history[0].metric("round") == 1
    untimed = [{k: v for k, v in r.to_dict().items() if k != "seconds"} for r in (toy.history[0], fedavg.history[0])]
    assert untimed[0] == untimed[1]
    assert all(torch.equal(toy.final_weights[k], v) for k, v in fedavg.final_weights.items())
    assert scaled.history[0].metric("loss") != pytest.approx(toy.history[0].metric("loss"))
