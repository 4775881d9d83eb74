"""Partition invariants, the shard format and loaders, and the statistics pools (Eq. 6-8)."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from fixtures import TINY_IMAGES_PER_CLASS

from fedccrl_core.data import registry, synthetic
from fedccrl_core.data.images import decode_resized
from fedccrl_core.data.manifest import client_ids, load_manifest
from fedccrl_core.data.partition import PartitionSettings, partition
from fedccrl_core.data.pools import build_pools, load_pool, sample_statistics, upload_size
from fedccrl_core.data.shards import load_client, load_domain_test
from fedccrl_core.data.splits import assign_clients, split_train_val
from fedccrl_core.foundation.errors import DataError

SPEC = registry.get_dataset("synthetic")
PER_CLASS = TINY_IMAGES_PER_CLASS
SIZE = 16


@pytest.fixture(scope="module")
def raw(tiny) -> Path:
    return tiny / "raw"  # the session's tiny dataset (conftest.py), read-only: partitioned here at 16 px


def _partition(raw, out, **kw):
    kw.setdefault("clients_per_domain", 2)
    kw.setdefault("val_fraction", 0.1)
    kw.setdefault("seed", 0)
    return partition(raw, out, SPEC, PartitionSettings(SIZE, **kw), workers=1, progress=False).to_dict()


@pytest.fixture(scope="module")
def shards(raw, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("s") / "shards"
    _partition(raw, out, clients_per_domain=3)
    return out


def _assignment(shards_dir: Path) -> dict[str, str]:
    """relative path -> '<client>/<train|val>' for every stored sample."""
    m = load_manifest(shards_dir).to_dict()
    where = {}
    for c in m["clients"]:
        s = load_client(shards_dir, c["id"])
        for part, paths in (("train", s.train_paths), ("val", s.val_paths)):
            for p in paths.tolist():
                assert p not in where, f"{p} stored twice"
                where[p] = f"{c['id']}/{part}"
    return where


def test_partition_is_disjoint_complete_and_stratified(raw, shards):
    m = load_manifest(shards).to_dict()
    assert m["domains"] == list(synthetic.DOMAINS) and m["classes"] == sorted(synthetic.CLASSES)
    assert m["image_size"] == SIZE and "bilinear" in m["resize_policy"] and m["skipped"] == []
    assert [c["id"] for c in m["clients"]] == [f"{d}_c{k}" for d in synthetic.DOMAINS for k in range(3)]
    where = _assignment(shards)  # disjoint (asserted inside)
    on_disk = {p.relative_to(raw).as_posix() for p in raw.rglob("*.png")}
    assert set(where) == on_disk  # complete
    for c in m["clients"]:
        s = load_client(shards, c["id"])
        assert all(p.startswith(c["domain"] + "/") for p in s.train_paths.tolist() + s.val_paths.tolist())
        hist = np.array(c["train_class_hist"]) + np.array(c["val_class_hist"])
        assert hist.max() - hist.min() <= 1 and abs(hist.mean() - PER_CLASS / 3) < 1  # even per class
        n = c["n_train"] + c["n_val"]
        assert c["n_val"] == round(0.1 * n)  # val fraction per client
        assert np.all(np.abs(np.array(c["val_class_hist"]) - 0.1 * hist) < 1)  # stratified val
        assert c["train_class_hist"] == np.bincount(s.train_y, minlength=6).tolist()
        # labels follow the class folder
        assert all(m["classes"][y] == p.split("/")[1] for y, p in zip(s.train_y, s.train_paths.tolist()))


def test_shard_pixels_are_the_resize_policy(raw, shards):
    s = load_client(shards, "sketch_c1")
    assert s.train_x.dtype == np.uint8 and s.train_x.shape[1:] == (SIZE, SIZE, 3)
    assert s.train_y.dtype == np.int64
    for j in (0, len(s.train_paths) - 1):
        np.testing.assert_array_equal(s.train_x[j], decode_resized(raw / s.train_paths[j], SIZE))


def test_partition_is_reproducible_and_seed_dependent(raw, shards, tmp_path):
    _partition(raw, tmp_path / "again", clients_per_domain=3)
    _partition(raw, tmp_path / "other", clients_per_domain=3, seed=1)
    assert _assignment(tmp_path / "again") == _assignment(shards)
    a = load_client(shards, "photo_c0")
    b = load_client(tmp_path / "again", "photo_c0")
    np.testing.assert_array_equal(a.train_x, b.train_x)
    other = _assignment(tmp_path / "other")
    assert set(other) == set(_assignment(shards))
    moved = sum(other[p] != w for p, w in _assignment(shards).items())
    assert moved > len(other) / 2


def test_dirichlet_label_skew_skews(raw, tmp_path):
    def skew(manifest):
        """Mean over domains/classes of the largest client's share of that class."""
        shares = []
        for d in manifest["domains"]:
            h = np.array(
                [np.add(c["train_class_hist"], c["val_class_hist"]) for c in manifest["clients"] if c["domain"] == d]
            )
            shares.extend(h.max(0) / h.sum(0))
        return float(np.mean(shares))

    even = _partition(raw, tmp_path / "even")
    skewed = _partition(raw, tmp_path / "skew", dirichlet_alpha=0.1)
    assert skew(even) < 0.56 and skew(skewed) > 0.8
    assert set(_assignment(tmp_path / "skew")) == set(_assignment(tmp_path / "even"))  # still complete
    assert all(c["n_train"] + c["n_val"] >= 2 for c in skewed["clients"])


def test_split_functions_on_labels():
    labels = np.repeat(np.arange(4), [10, 7, 3, 1])
    parts = assign_clients(labels, 3, np.random.default_rng(0))
    assert sorted(np.concatenate(parts).tolist()) == list(range(labels.size))
    assert max(p.size for p in parts) - min(p.size for p in parts) <= 1
    tr, va = split_train_val(np.arange(labels.size), labels, 0.2, np.random.default_rng(0))
    assert va.size == round(0.2 * labels.size) and set(tr) | set(va) == set(range(labels.size))
    assert Counter(labels[va].tolist())[0] == 2 and 3 in labels[tr]  # the 1-sample class stays in train


def test_domain_test_set_is_union_of_its_clients(raw, shards):
    x, y = load_domain_test(shards, "art")
    _x1, y1 = load_domain_test(shards, 1)  # held-out index, registry order
    assert x.shape == (6 * PER_CLASS, SIZE, SIZE, 3) and y.dtype == np.int64
    np.testing.assert_array_equal(y, y1)
    assert np.bincount(y).tolist() == [PER_CLASS] * 6
    assert client_ids(load_manifest(shards), exclude_domain=1) == [
        f"{d}_c{k}" for d in ("photo", "cartoon", "sketch") for k in range(3)
    ]
    with pytest.raises(DataError, match="held-out index 4 is out of range"):
        load_domain_test(shards, 4)


def test_unreadable_raw_files_are_skipped_and_listed(raw, tmp_path):
    copy = tmp_path / "raw"
    shutil.copytree(raw, copy)
    (copy / "photo" / "ring" / "0003.png").write_bytes(b"garbage")
    m = _partition(copy, tmp_path / "shards")
    assert m["skipped"] == [{"path": "photo/ring/0003.png", "reason": "not an image (format not recognized)"}]
    assert "photo/ring/0003.png" not in _assignment(tmp_path / "shards")
    assert m["domain_sizes"]["photo"] == 6 * PER_CLASS - 1


def test_loader_errors_name_the_shard_file(shards, tmp_path):
    bad = tmp_path / "shards"
    shutil.copytree(shards, bad)
    (bad / "art_c0.npz").unlink()
    with pytest.raises(DataError, match=r"art_c0\.npz: shard file missing"):
        load_client(bad, "art_c0")
    (bad / "art_c1.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match=r"art_c1\.npz: corrupt shard"):
        load_client(bad, "art_c1")
    np.savez(bad / "art_c2.npz", train_x=np.zeros((1, SIZE, SIZE, 3), np.uint8))
    with pytest.raises(DataError, match=r"art_c2\.npz: shard lacks key\(s\) train_y"):
        load_client(bad, "art_c2")
    good = load_client(shards, "photo_c0")
    np.savez(
        bad / "photo_c0.npz",
        train_x=good.train_x[:, :8],
        train_y=good.train_y,
        train_paths=good.train_paths,
        val_x=good.val_x,
        val_y=good.val_y,
        val_paths=good.val_paths,
    )
    with pytest.raises(DataError, match=r"photo_c0\.npz: train_x is uint8 \(\d+, 8, 16, 3\), expected"):
        load_client(bad, "photo_c0")
    with pytest.raises(DataError, match="no client 'nope_c0'"):
        load_client(bad, "nope_c0")
    (bad / "manifest.json").unlink()
    with pytest.raises(DataError, match=r"manifest\.json: shard manifest not found"):
        load_manifest(bad)


# ------------------------------------------------------------------ pools (Eq. 6-8)
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


@pytest.fixture(scope="module")
def pools(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("p") / "pools"
    build_pools(shards, out, MEAN, STD, progress=False)
    return out


def test_pool_values_equal_a_direct_computation(shards, pools):
    m = json.loads((pools / "manifest.json").read_text())
    assert [c["id"] for c in m["clients"]] == [c["id"] for c in load_manifest(shards).to_dict()["clients"]]
    assert sorted(p.name for p in pools.iterdir()) == sorted([c["file"] for c in m["clients"]] + ["manifest.json"])
    for cid in ("photo_c0", "sketch_c2"):
        shard = load_client(shards, cid)
        mu, sigma = load_pool(pools, cid)
        assert mu.dtype == sigma.dtype == np.float32 and mu.shape == (shard.n_train, 3)
        x = (shard.train_x.astype(np.float64) / 255.0 - np.array(MEAN)) / np.array(STD)  # NHWC, independent
        want_mu = x.mean(axis=(1, 2))
        want_sigma = np.sqrt(((x - want_mu[:, None, None, :]) ** 2).mean(axis=(1, 2)))
        np.testing.assert_allclose(mu, want_mu, atol=1e-5)
        np.testing.assert_allclose(sigma, want_sigma, atol=1e-4)  # eps=1e-6 inside the root
    with np.load(pools / "photo_c0.npz") as z:
        assert sorted(z.files) == ["mu", "sigma"]  # statistics only, no images


def test_eq8_subset_size_and_rows(pools):
    mu, sigma = load_pool(pools, "cartoon_c1")
    n = mu.shape[0]
    for r in (0.1, 0.25, 1.0):
        mu_s, sigma_s = sample_statistics(mu, sigma, r, np.random.default_rng(3))
        assert mu_s.shape == sigma_s.shape == (math.ceil(r * n - 1e-9), 3)
        rows = [int(np.flatnonzero((mu == row).all(1) & (sigma == srow).all(1))[0]) for row, srow in zip(mu_s, sigma_s)]
        assert len(set(rows)) == len(rows)  # without replacement, paired rows
    assert upload_size(30, 0.1) == 3 and upload_size(31, 0.1) == 4 and upload_size(5, 0.01) == 1
    # the rounding guard: these products land just above an integer in floating point, so a bare ceil adds a row
    for n, r, k in ((100, 0.07, 7), (100, 0.14, 14), (100, 0.28, 28), (100, 0.56, 56)):
        assert r * n > k and math.ceil(r * n) == k + 1  # the float error the guard exists for
        assert upload_size(n, r) == k
    assert 100 * 0.29 < 29 and upload_size(100, 0.29, "floor") == 28  # the reference's int(n * r), error kept
    a = sample_statistics(mu, sigma, 0.1, np.random.default_rng(5))[0]
    b = sample_statistics(mu, sigma, 0.1, np.random.default_rng(5))[0]
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- the reference FedCCRL split
def test_reference_scheme_is_an_unstratified_pooled_split():
    from fedccrl_core.data.splits import client_splits

    labels = np.repeat(np.arange(4), [50, 30, 15, 5])  # imbalanced classes
    out = client_splits(labels, 3, 0.1, np.random.default_rng(7), scheme="reference")
    trains, vals = [t for t, _ in out], [v for _, v in out]
    allidx = np.concatenate(trains + vals)
    assert np.array_equal(np.sort(allidx), np.arange(labels.size))  # disjoint and complete
    pooled = np.sort(np.concatenate(vals))
    assert pooled.size == 10  # round(0.1 * 100) of the domain
    # unstratified: the pooled val is the first 10 of one permutation of the whole domain, not per class
    assert np.array_equal(pooled, np.sort(np.random.default_rng(7).permutation(labels.size)[:10]))
    assert max(v.size for v in vals) - min(v.size for v in vals) <= 1
    # per_domain (the default) stratifies per client instead: a different split from the same seed
    per = client_splits(labels, 3, 0.1, np.random.default_rng(7), scheme="per_domain")
    assert not np.array_equal(np.sort(np.concatenate([v for _, v in per])), pooled)


def test_reference_scheme_through_the_stage(raw, tmp_path):
    m = _partition(raw, tmp_path / "ref", scheme="reference")
    assert m["params"]["partition.scheme"] == "reference"
    for d, n in m["domain_sizes"].items():
        assert sum(c["n_val"] for c in m["clients"] if c["domain"] == d) == round(0.1 * n)
