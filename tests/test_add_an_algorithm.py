"""docs/contributing.md's "Add an algorithm", followed step by step with a toy algorithm defined here: its Params
naming the class, the class naming its Params, one line in the registry (PARAMS), its params.yaml group checked
against the class, its hyperparameter table generated, and one round trained by the training driver on tiny
in-memory clients. `monkeypatch.setitem` stands for the line a real algorithm adds to
fedccrl_core/algorithm_params/__init__.py (and takes it out again after the test)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from fixtures import held_out_run, params_group_problems

from fedccrl_core.algorithm_params import PARAMS
from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import ALGORITHMS, algorithm_class, build_algorithm
from fedccrl_core.algorithms.base import Algorithm, cross_entropy_step
from fedccrl_core.data.pools import compute_statistics
from fedccrl_core.federation.driver import build_seeded_model, train
from fedccrl_core.foundation.errors import ParamError
from fedccrl_core.foundation.hparams import HParams, hp
from fedccrl_core.learning.clients import ClientData
from fedccrl_core.learning.statistics import IMAGENET_MEAN, IMAGENET_STD

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# Step 1: the hyperparameters (in a real algorithm: a module of fedccrl_core/algorithm_params, no torch), naming the class
class ToyParams(HParams):
    """train.toy."""

    algorithm: ClassVar[str] = f"{__name__}:Toy"

    scale: float = hp(1.0, "the weight of the cross-entropy (Eq. 1 times scale): a test's choice", gt=0)


# Step 1: the algorithm (in a real one: a module of fedccrl_core/algorithms), naming its Params
class Toy(Algorithm):
    name = "toy"
    Params = ToyParams
    hp: ToyParams

    def train_step(self, model, x, y, ctx):
        loss, terms, logits = cross_entropy_step(model, x, y, ctx.real_rows)
        return self.hp.scale * loss, terms, logits


@pytest.fixture
def registered(monkeypatch):
    """Step 2: the algorithm's line in PARAMS."""
    monkeypatch.setitem(PARAMS, "toy", ToyParams)


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


def test_the_registry_line_finds_the_class_its_params_name(registered):
    assert algorithm_class("toy") is Toy


def test_a_params_that_names_another_class_is_refused(monkeypatch):
    class Stray(ToyParams):
        algorithm: ClassVar[str] = f"{__name__}:Toy"  # Toy's Params is ToyParams, not Stray

    monkeypatch.setitem(PARAMS, "toy", Stray)
    with pytest.raises(ImportError, match="Params ToyParams; registered as 'toy' with .*Stray"):
        algorithm_class("toy")


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
