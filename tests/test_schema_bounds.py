"""Bounds live in params.yaml's schema (pipeline/fedccrl_pipeline/params.py and the typed configs it holds), not in the
library: each bound the library used to re-check is refused here, by `validate_params`, naming the key, before any
stage reads data. The library functions take the validated values and check only what depends on the data."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from fedccrl_core.foundation.errors import ParamError
from fedccrl_pipeline.params import validate_params
from fedccrl_pipeline.params_yaml import read_yaml, set_key

REPO = Path(__file__).resolve().parents[1]
PARAMS = read_yaml(REPO / "params.yaml")


def refused(overrides: dict) -> str:
    data = copy.deepcopy(PARAMS)
    for key, value in overrides.items():
        set_key(data, key, value)
    with pytest.raises(ParamError) as e:
        validate_params(data)
    return str(e.value)


def test_the_repository_params_pass():
    validate_params(copy.deepcopy(PARAMS))


@pytest.mark.parametrize(
    "key,value",
    [
        # once re-checked by federation/loop.py sampled_count and federation/engine.py
        ("train.client_fraction", 0.0),
        ("train.client_fraction", 1.5),
        ("train.concurrent_clients", 0),
        ("train.concurrent_clients", "many"),
        ("train.client_state", "sticky"),
        # once re-checked by data/shards.py (_check_split_params, the scheme, the image size)
        ("partition.clients_per_domain", 0),
        ("partition.clients_per_domain", True),
        ("partition.val_fraction", 0.0),
        ("partition.val_fraction", 1.0),
        ("partition.dirichlet_alpha", 0.0),
        ("partition.seed", "zero"),
        ("partition.scheme", "bogus"),
        ("preprocess.image_size", 4),
        ("preprocess.image_size", "big"),
        # once re-checked by data/feddg_bench.py
        ("partition.num_clients", 0),
        ("partition.num_clients", True),
        ("partition.lambda", -0.1),
        ("partition.lambda", 1.5),
        ("partition.lambda", "x"),
        # once re-checked by data/pools.py (_check_mean_std, upload_size's r)
        ("preprocess.mean", [0.5, 0.5]),
        ("preprocess.mean", "imagenet"),
        ("preprocess.std", [0.2, 0.0, 0.2]),
        ("preprocess.std", [0.2, -0.2, 0.2]),
        ("train.fedccrl.r", 0.0),
        ("train.fedccrl.r", 1.01),
        # once re-checked by data/registry.py, data/sources.py and data/checksums.py
        ("dataset.name", "nope"),
        ("model.backbone", ""),
        ("model.pretrained", ""),
        ("dataset.source", ""),
        ("dataset.sha256", "abc"),
        ("dataset.sha256", {"pacs.zip": "g" * 64}),
        ("dataset.sha256", 7),
        # once re-checked by algorithms/fedsr.py l2r
        ("train.fedsr.l2r", "cube"),
    ],
)
def test_a_bound_the_library_trusts_is_the_schemas(key, value):
    message = refused({key: value})
    assert f"key '{key}" in message, message


def test_a_sha256_is_read_lower_case():
    data = copy.deepcopy(PARAMS)
    set_key(data, "dataset.source", "https://example.org/pacs.zip")  # a source a sha256 applies to
    set_key(data, "dataset.sha256", " " + "AB" * 32 + " ")
    assert validate_params(data).dataset.sha256 == "ab" * 32
    set_key(data, "dataset.sha256", {"pacs.zip": "CD" * 32})
    assert validate_params(data).dataset.sha256 == {"pacs.zip": "cd" * 32}


@pytest.mark.parametrize(
    "overrides,needle",
    [
        # once checked by data/sources.py when the download stage ran
        (
            {"dataset.sha256": "ab" * 32},
            "key 'dataset.sha256': got '" + "ab" * 32 + "'; does not apply to the generated",
        ),
        ({"dataset.name": "imagefolder", "train.held_out": [0]}, "key 'dataset.source': got 'registry'; the registry"),
    ],
)
def test_what_the_registry_has_is_checked_with_the_file(overrides, needle):
    assert needle in refused(overrides)


def test_a_registered_download_takes_its_sha256():
    data = copy.deepcopy(PARAMS)
    set_key(data, "dataset.name", "pacs")
    set_key(data, "train.held_out", [0])
    set_key(data, "model.pretrained", "none")
    set_key(data, "dataset.sha256", "ab" * 32)
    assert validate_params(data).dataset.sha256 == "ab" * 32
