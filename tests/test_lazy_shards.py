"""Lazy shards, so memory stays flat in the client count: a client's training images are memory-mapped from its shard file and read
only when the client is sampled; the shards on disk stay within 1.5x the decoded uint8 pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import held_out_run

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.data import registry
from fedccrl_core.data.manifest import client_ids, load_manifest
from fedccrl_core.data.partition import PartitionSettings, partition
from fedccrl_core.data.shards import load_client
from fedccrl_core.federation.driver import build_seeded_model, train
from fedccrl_core.learning.clients import ClientData

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SIZE = 16


@pytest.fixture(scope="module")
def raw(tiny) -> Path:
    return tiny / "raw"  # the session's tiny dataset (conftest.py), read-only; partitioned here at 16 px, 3 clients


@pytest.fixture(scope="module")
def shards(raw, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("s") / "shards"
    partition(
        raw,
        out,
        registry.get_dataset("synthetic"),
        PartitionSettings(SIZE, clients_per_domain=3),
        workers=1,
        progress=False,
    )
    return out


def decoded_pixels(shards: Path) -> int:
    m = load_manifest(shards).to_dict()
    return sum((c["n_train"] + c["n_val"]) * m["image_size"] ** 2 * 3 for c in m["clients"])


def test_memory_mapped_shards_equal_the_loaded_ones(shards, raw, tmp_path):
    fdb = tmp_path / "fdb"
    partition(
        raw,
        fdb,
        registry.get_dataset("synthetic"),
        PartitionSettings(SIZE, scheme="feddg_bench", num_clients=5, lam=0.5),
        workers=1,
        progress=False,
    )
    cases = [(shards, cid, None) for cid in client_ids(load_manifest(shards))]
    held = load_manifest(fdb).to_dict()["domains"][0]
    cases += [(fdb, cid, ex) for cid in client_ids(load_manifest(fdb), held) for ex in (None, held)]
    for folder, cid, ex in cases:
        lazy, eager = load_client(folder, cid, ex, mmap=True), load_client(folder, cid, ex)
        stored = next(c["n_train"] for c in load_manifest(folder).to_dict()["clients"] if c["id"] == cid)
        # memory-mapped unless the held-out domain's rows had to be dropped (then the kept rows are copied)
        assert isinstance(lazy.train_x, np.memmap) == (lazy.n_train == stored), (folder.name, cid, ex)
        assert not isinstance(eager.train_x, np.memmap)
        for k in ("train_x", "train_y", "val_x", "val_y", "train_paths"):
            a, b = getattr(lazy, k), getattr(eager, k)
            assert a.dtype == b.dtype and np.array_equal(a, b), (folder.name, cid, k)


def test_shards_on_disk_within_one_and_a_half_times_the_decoded_pixels(shards):
    disk = sum(f.stat().st_size for f in shards.iterdir())
    assert disk <= 1.5 * decoded_pixels(shards), (disk, decoded_pixels(shards))


def train_lazy(clients, fraction):
    alg = build_algorithm("fedavg", LocalConfig(rounds=3, local_epochs=1, batch_size=8))
    model = build_seeded_model(alg, "small_cnn", 6, "none", 0)
    run = held_out_run(alg, model, clients, (clients[0].val_x, clients[0].val_y), 3, client_fraction=fraction)
    return train(run, log=lambda m: None)


def test_lazy_clients_read_only_the_sampled_shards_and_train_identically(shards, monkeypatch):
    ids = client_ids(load_manifest(shards))

    def clients(lazy):
        out = []
        for cid in ids:
            s = load_client(shards, cid, mmap=lazy)
            out.append(ClientData.from_numpy(cid, s.domain, s.train_x, s.train_y, s.val_x, s.val_y, "cpu", lazy=lazy))
        return out

    eager = train_lazy(clients(False), 0.34)
    lazy_clients = clients(True)
    assert all(c.train_x is None and isinstance(c.train_source, np.memmap) for c in lazy_clients)
    read = []
    real = ClientData.resident

    def resident(self):
        if self.train_x is None:
            read.append(self.client_id)
        return real(self)

    monkeypatch.setattr(ClientData, "resident", resident)
    lazy = train_lazy(lazy_clients, 0.34)
    sampled = [sorted(k[len("train_acc/") :] for k in r.to_dict() if k.startswith("train_acc/")) for r in lazy.history]
    assert read == [c for s in sampled for c in s]  # each sampled client's images, once a round, nobody else's
    assert len(set(read)) < len(ids)
    assert all(c.train_x is None for c in lazy_clients)  # nothing stays resident between rounds
    assert [{k: v for k, v in r.to_dict().items() if k != "seconds"} for r in lazy.history] == [
        {k: v for k, v in r.to_dict().items() if k != "seconds"} for r in eager.history
    ]
    for k, v in eager.final_weights.items():
        assert torch.equal(v, lazy.final_weights[k]), k
