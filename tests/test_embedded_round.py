"""One round of every registered algorithm on the embedded default dataset.

The data path is the pipeline's own (synthetic generator -> partition -> pools -> load_clients),
with fewer images per class so the module stays fast; each algorithm runs with the
hyperparameters params.yaml gives it (CCST with seeded random AdaIN weights: the released VGG
weights cannot be downloaded here). Parametrized over the registry, so an algorithm added later
is covered without touching this file.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from fixtures import held_out_run

from fedccrl_core.algorithms import ALGORITHMS, build_algorithm
from fedccrl_core.data.manifest import load_manifest
from fedccrl_core.data.shards import load_domain_test
from fedccrl_core.federation.driver import build_seeded_model, load_clients, train
from fedccrl_pipeline.params import validate_params
from fedccrl_pipeline.params_yaml import read_yaml
from fedccrl_pipeline.training import run_settings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def embedded(tiny):
    """The session's tiny dataset (conftest.py: the embedded default, 8 images per class; read-only) and params.yaml."""
    return tiny / "data", read_yaml(ROOT / "params.yaml")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_one_round_on_embedded_default(embedded, algorithm):
    base, params = embedded
    params = {
        **params,
        "train": {
            **params["train"],
            "rounds": 1,
            "local_epochs": 1,
            "device": "cpu",
            "ccst": {**params["train"]["ccst"], "adain_weights": "random"},
        },
    }
    cfg = validate_params(params, (algorithm,))  # validates CCST's group when CCST is the one trained
    settings = run_settings(cfg)
    manifest = load_manifest(base / "shards")
    domains = list(manifest.domains)
    target, sources = domains[3], domains[:3]
    clients = load_clients(base / "shards", base / "pools", sources, "cpu")
    assert len(clients) == 3 * params["partition"]["clients_per_domain"]
    alg = build_algorithm(algorithm, settings.local, getattr(cfg.train, algorithm).model_dump())
    backbone, pretrained = settings.backbone, settings.pretrained
    assert backbone == "small_cnn"
    model = build_seeded_model(alg, backbone, len(manifest.classes), pretrained, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run = held_out_run(alg, model, clients, load_domain_test(base / "shards", target), 1, batch_size=256)
    res = train(run, log=lambda m: None)

    (rec,) = res.history
    assert math.isfinite(rec.to_dict()["loss"]), rec
    assert 0.0 <= rec.to_dict()["val_acc"] <= 1.0 and 0.0 <= rec.to_dict()["target_acc"] <= 1.0
    assert len([k for k in rec.to_dict() if k.startswith("train_acc/")]) == len(clients)
    # every client sent its weights up and got them down: at least the parameter bytes each way
    n_param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert (
        rec.to_dict()["bytes_up"] >= len(clients) * n_param_bytes
        and rec.to_dict()["bytes_down"] >= len(clients) * n_param_bytes
    )
    if algorithm in ("fedccrl", "fedalign", "ccst"):  # these exchange statistics besides weights
        w_bytes = sum(v.numel() * v.element_size() for v in res.final_weights.values())
        assert rec.to_dict()["bytes_up"] > len(clients) * w_bytes
    changed = [
        k
        for k, v in res.final_weights.items()
        if k in before and v.is_floating_point() and not torch.equal(v, before[k])
    ]
    assert any(k.startswith("g.") for k in changed), "the classifier g did not move in one round"
