"""Invariants stated as properties (hypothesis; the profile is tests/conftest.py's): Eq. 2's aggregation, the
partition stage's split, Eq. 8's upload size, DP-FedAvg's clipping, the privacy accountant's monotonicity, the
shard and model files read back as written, and the dotted-key setter of `dvc exp run -S`.

Each expected value is computed here, independently of the code under test (float64 sums, Fraction arithmetic,
PIL's own decoding, plain dict walks)."""

from __future__ import annotations

import copy
import math
import re
import tempfile
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fedccrl_core.data.pools import upload_size
from fedccrl_core.data.splits import MIN_CLIENT_SAMPLES, assign_clients, client_splits, split_train_val
from fedccrl_core.foundation.errors import DataError, ParamError
from fedccrl_core.learning.aggregation import WeightedSum, weighted_average
from fedccrl_core.privacy.accountant import epsilon_of, sampled_gaussian
from fedccrl_core.privacy.dp import clip_update

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# ---- Eq. 2: theta = sum_i n_i / N theta_i ------------------------------------------------------------------------
SHAPES = {"w": (3, 2), "b": (2,), "bn.running_mean": (2,), "bn.running_var": (2,)}


@st.composite
def client_states(draw, min_clients=1, max_clients=6):
    """U clients' float32 states of SHAPES plus an integer buffer, and their n_i >= 1."""
    u = draw(st.integers(min_clients, max_clients))
    seed = draw(st.integers(0, 2**32 - 1))
    gen = np.random.default_rng(seed)
    states = []
    for _ in range(u):
        s = {k: torch.tensor(gen.normal(size=shape) * 10, dtype=torch.float32) for k, shape in SHAPES.items()}
        s["bn.num_batches_tracked"] = torch.tensor(int(gen.integers(0, 1000)))
        states.append(s)
    n = draw(st.lists(st.integers(1, 10_000), min_size=u, max_size=u))
    return states, n


def eq2_float64(states: list[dict], n: list[int]) -> dict[str, np.ndarray]:
    """Eq. 2 as a float64 loop over the clients; integer buffers: the largest (the code's stated rule)."""
    total = float(sum(n))
    out = {}
    for k, v in states[0].items():
        if v.is_floating_point():
            out[k] = sum(ni / total * s[k].numpy().astype(np.float64) for s, ni in zip(states, n))
        else:
            out[k] = max(int(s[k]) for s in states)
    return out


def assert_close_to(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, int):
            assert int(got[k]) == v, k
        else:  # the float64 sum rounded once to float32: within one float32 ulp of the float64 value
            ulp = np.spacing(np.abs(v).astype(np.float32)).astype(np.float64)
            assert np.all(np.abs(got[k].numpy().astype(np.float64) - v) <= ulp), k


@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=8))
def test_eq2_weights_are_n_over_N_and_sum_to_one(n):
    """Client i's state is the i-th unit vector, so the average is the weight vector itself: n_i / N, summing to 1,
    streamed (total unknown) and over a list (total known)."""
    u = len(n)
    states = [{"x": torch.eye(u, dtype=torch.float64)[i]} for i in range(u)]
    streamed = WeightedSum()
    for s, ni in zip(states, n):
        streamed.add(s, ni)
    for got in (weighted_average(states, n)["x"], streamed.result()["x"]):
        want = [Fraction(ni, sum(n)) for ni in n]
        assert all(abs(Fraction(float(g)) - w) <= Fraction(1, 2**50) for g, w in zip(got.tolist(), want))
        assert math.isclose(float(got.sum()), 1.0, rel_tol=1e-14)


@given(client_states(), st.randoms(use_true_random=False))
def test_eq2_equals_a_float64_loop_and_ignores_the_client_order(data, rnd):
    states, n = data
    want = eq2_float64(states, n)
    order = list(range(len(states)))
    rnd.shuffle(order)
    assert_close_to(weighted_average(states, n), want)
    assert_close_to(weighted_average([states[i] for i in order], [n[i] for i in order]), want)
    streamed = WeightedSum()  # total unknown: n_i theta_i summed, divided by N at the end
    for i in order:
        streamed.add(states[i], n[i])
    assert_close_to(streamed.result(), want)


@given(client_states(max_clients=1), st.lists(st.integers(1, 10_000), min_size=1, max_size=8))
def test_eq2_of_identical_models_is_that_model(data, n):
    """Bit for bit: sum_i n_i / N theta is theta within float64 rounding, which float32 cannot see."""
    (state,), _ = data
    out = weighted_average([state] * len(n), n)
    assert out.keys() == state.keys()
    for k, v in state.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k


# ---- the partition stage's split (FedCCRL Sec. 3.1; fedccrl_core/data/splits.py) ----------------------------------
labels_st = st.lists(st.integers(0, 4), min_size=1, max_size=120).map(lambda v: np.array(v, dtype=np.int64))


@given(labels_st, st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_even_split_is_disjoint_complete_stratified_and_seed_stable(labels, k, seed):
    """The default split (no Dirichlet): every index in exactly one client; each class's n_c samples dealt so that a
    client holds floor(n_c / K) or ceil(n_c / K) of them; client sizes differ by at most one; the same seed, the
    same split."""
    parts = assign_clients(labels, k, np.random.default_rng(seed))
    assert len(parts) == k
    together = np.concatenate(parts)
    assert np.array_equal(np.sort(together), np.arange(len(labels)))  # disjoint and complete
    for c in np.unique(labels):
        n_c = int((labels == c).sum())
        for part in parts:
            assert (labels[part] == c).sum() in (n_c // k, -(-n_c // k))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    again = assign_clients(labels, k, np.random.default_rng(seed))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


@given(
    labels_st,
    st.integers(1, 4),
    st.sampled_from([0.0, 0.1, 0.25, 0.5]),
    st.sampled_from([None, 0.3, 5.0]),
    st.integers(0, 2**32 - 1),
)
def test_client_splits_are_disjoint_complete_and_seed_stable(labels, k, val_fraction, alpha, seed):
    """The partition stage's (train, val) per client, per_domain scheme, even or Dirichlet: every sample of the
    domain in exactly one client's train or val; Dirichlet clients hold at least MIN_CLIENT_SAMPLES (or the split is
    refused as documented)."""
    if alpha is not None:
        assume(len(labels) >= MIN_CLIENT_SAMPLES * k)
    try:
        splits = client_splits(labels, k, val_fraction, np.random.default_rng(seed), alpha)
    except DataError as e:  # the documented outcome when 1000 Dirichlet draws leave a client too small
        assert alpha is not None and "no Dirichlet" in str(e)
        return
    together = np.concatenate([np.concatenate([tr, va]) for tr, va in splits])
    assert np.array_equal(np.sort(together), np.arange(len(labels)))
    if alpha is not None:
        assert all(len(tr) + len(va) >= MIN_CLIENT_SAMPLES for tr, va in splits)
    again = client_splits(labels, k, val_fraction, np.random.default_rng(seed), alpha)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(splits, again))


@given(labels_st, st.floats(0.01, 0.9), st.integers(0, 2**32 - 1))
def test_train_val_split_is_stratified_as_documented(labels, f, seed):
    """split_train_val's docstring: class c gets within one sample of f n_c in val, never its whole train side; the
    val size is round(f n) whenever no class had to keep its last sample (every class of 2+ samples and f <= 1/2)."""
    idx = np.arange(len(labels))
    train, val = split_train_val(idx, labels, f, np.random.default_rng(seed))
    assert np.array_equal(np.sort(np.concatenate([train, val])), idx) and not set(train) & set(val)
    for c in np.unique(labels):
        n_c, v_c = int((labels == c).sum()), int((labels[val] == c).sum())
        assert abs(v_c - f * n_c) <= 1 and (labels[train] == c).sum() >= 1
    if f <= 0.5 and np.bincount(labels)[np.unique(labels)].min() >= 2:
        assert len(val) == round(f * len(labels))


# ---- Eq. 8's upload size: ceil(r n_i) -----------------------------------------------------------------------------
@given(st.integers(1, 100_000), st.floats(0.0, 1.0, exclude_min=True))
def test_eq8_upload_size_is_ceil_r_n_within_its_bounds(n, r):
    """1 <= k <= n and k = ceil(r n) of the exact product, read through float noise at integers (|r n - k| < 1e-9
    counts as k)."""
    k = upload_size(n, r)
    exact = Fraction(r) * n  # the float r's exact value times n
    assert 1 <= k <= n
    assert k >= exact - Fraction(1, 10**9) and k - 1 < exact


@given(st.integers(1, 100_000).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))))
def test_eq8_upload_size_of_m_over_n_is_m(nm):
    """r = m / n (a float, rounding error included, 0.07 * 100 = 7.000000000000001) gives exactly m rows."""
    n, m = nm
    assert upload_size(n, m / n) == m


@given(st.integers(1, 10_000), st.floats(0.0, 1.0, exclude_min=True), st.floats(0.0, 1.0, exclude_min=True))
def test_eq8_upload_size_is_monotone_in_r(n, r1, r2):
    lo, hi = sorted((r1, r2))
    assert upload_size(n, lo) <= upload_size(n, hi)


@given(st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True)))
def test_eq8_r_outside_0_1_is_refused_by_the_schema(r):
    """upload_size trusts r: train.fedccrl.r's bound (0, 1] is params.yaml's schema's (FedCCRLParams)."""
    from fedccrl_core.algorithm_params.fedccrl import FedCCRLParams
    from fedccrl_core.foundation.hparams import validate

    assume(not math.isnan(r))
    with pytest.raises(ParamError, match=r"key 'train\.fedccrl\.r'"):
        validate(FedCCRLParams, {"r": r}, prefix="train.fedccrl")


# ---- DP-FedAvg's clipping: update * min(1, S / ||update||), one norm over parameters and BatchNorm buffers --------
@given(client_states(max_clients=1), st.floats(1e-3, 1e3), st.floats(1e-4, 1e2))
def test_clipped_update_norm_is_at_most_s_and_unchanged_within_s(data, clip, scale):
    """The norm over every floating-point entry together (weights and BatchNorm statistics, as DP-FedAvg clips) is
    at most S after clipping, the direction is kept, and an update already within S is returned unchanged."""
    (state,), _ = data
    update = {k: v * scale for k, v in state.items() if v.is_floating_point()}
    flat = np.concatenate([v.numpy().astype(np.float64).ravel() for v in update.values()])
    norm = float(np.sqrt(np.sum(flat**2)))
    clipped, before = clip_update(update, clip)
    assert math.isclose(before, norm, rel_tol=1e-12)
    out = np.concatenate([clipped[k].numpy().ravel() for k in update])
    assert np.linalg.norm(out) <= clip * (1 + 1e-12)
    if norm <= clip:
        assert np.array_equal(out, flat)
    else:
        assert math.isclose(np.linalg.norm(out), clip, rel_tol=1e-12)
        assert np.allclose(out, flat * (clip / norm), rtol=1e-12, atol=0)


# ---- the accountant: epsilon of the composed rounds --------------------------------------------------------------
DELTA = 1e-5
noise_st = st.floats(0.5, 5.0)


def eps(population, sample, z, rounds):
    return epsilon_of([sampled_gaussian(population, sample, z)] * rounds, DELTA)


def population_and_samples(count):
    """N in [2, 200] and `count` sample sizes in [1, N]."""
    return st.integers(2, 200).flatmap(lambda n: st.tuples(st.just(n), *[st.integers(1, n) for _ in range(count)]))


# Each epsilon costs dp_accounting's RDP over its default orders (about 0.5 s here): few examples.
@settings(max_examples=8)
@given(population_and_samples(1), noise_st, st.integers(1, 50), st.integers(1, 50))
def test_epsilon_does_not_decrease_with_rounds(nm, z, t1, t2):
    (population, sample), (lo, hi) = nm, sorted((t1, t2))
    assert eps(population, sample, z, lo) <= eps(population, sample, z, hi) * (1 + 1e-12)


@settings(max_examples=8)
@given(population_and_samples(1), noise_st, noise_st, st.integers(1, 20))
def test_epsilon_does_not_increase_with_the_noise_multiplier(nm, z1, z2, rounds):
    (population, sample), (lo, hi) = nm, sorted((z1, z2))
    assert eps(population, sample, hi, rounds) <= eps(population, sample, lo, rounds) * (1 + 1e-12)


@settings(max_examples=8)
@given(population_and_samples(2), noise_st, st.integers(1, 20))
def test_epsilon_does_not_decrease_with_the_sampling_rate(nms, z, rounds):
    """m of N sampled without replacement: a larger sample costs at least as much."""
    population, lo, hi = nms[0], *sorted(nms[1:])
    assert eps(population, lo, z, rounds) <= eps(population, hi, z, rounds) * (1 + 1e-12)


def test_epsilon_does_not_decrease_from_n_minus_1_to_n_sampled():
    """At m = N the event is the Gaussian itself; at m = N - 1 the sampled bound (Wang, Balle, Kasiviswanathan 2019,
    Thm. 27) is loose, above the Gaussian's, so the accountant takes the smaller of the two: epsilon is monotone up to
    the whole population, and equal to the Gaussian's when sampling buys nothing."""
    assert eps(10, 9, 1.0, 5) <= eps(10, 10, 1.0, 5)
    assert eps(10, 9, 1.0, 5) < eps(10, 9, 0.5, 5)


# ---- files read back as written ---------------------------------------------------------------------------------
@settings(max_examples=8)
@given(
    st.lists(st.integers(2, 5), min_size=2, max_size=2),  # images per class (2 classes), each of the 2 domains
    st.integers(1, 2),
    st.sampled_from([0.0, 0.2]),
    st.integers(0, 2**16),
)
def test_shards_read_back_the_images_the_partition_wrote(per_class, clients, val_fraction, seed):
    """Random 8 px PNGs in a <domain>/<class>/<image> tree, partitioned at 8 px (no resize): every client's shard,
    loaded, holds for each path exactly the pixels PIL decodes from that file and the label of its class folder,
    and the clients' paths are all the files."""
    from PIL import Image

    from fedccrl_core.data.manifest import client_ids, load_manifest
    from fedccrl_core.data.partition import PartitionSettings, partition
    from fedccrl_core.data.registry import get_dataset
    from fedccrl_core.data.shards import load_client

    gen = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        raw, out = Path(tmp) / "raw", Path(tmp) / "shards"
        classes = ["cat", "dog"]
        for domain in ("d0", "d1"):
            for c, count in zip(classes, per_class):
                (raw / domain / c).mkdir(parents=True)
                for i in range(count):
                    Image.fromarray(gen.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(raw / domain / c / f"{i}.png")
        partition(
            raw,
            out,
            get_dataset("imagefolder"),
            PartitionSettings(8, clients_per_domain=clients, val_fraction=val_fraction, seed=seed),
            workers=1,
            progress=False,
        )
        seen = []
        for cid in client_ids(load_manifest(out)):
            shard = load_client(out, cid)
            for x, y, paths in (
                (shard.train_x, shard.train_y, shard.train_paths),
                (shard.val_x, shard.val_y, shard.val_paths),
            ):
                for xi, yi, path in zip(x, y, paths.tolist()):
                    with Image.open(raw / path) as im:
                        assert np.array_equal(xi, np.asarray(im.convert("RGB"))), path
                    assert classes[int(yi)] == path.split("/")[1], path
                    seen.append(path)
        files = sorted(str(p.relative_to(raw)) for p in raw.rglob("*.png"))
        assert sorted(seen) == files


meta_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**31), 2**31) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
optional_meta = st.fixed_dictionaries(
    {},
    optional={
        "dataset": st.text(max_size=8),
        "domains": st.lists(st.text(max_size=5), max_size=4),
        "held_out_index": st.integers(0, 9),
        "seed": st.integers(-(2**31), 2**31),
        "hparams": st.dictionaries(st.text(max_size=5), meta_values, max_size=3),
        "round": st.integers(1, 500),
    },
)


@settings(max_examples=10)
@given(st.integers(2, 5), optional_meta, st.integers(0, 2**16))
def test_model_file_reads_back_the_weights_and_meta_written(num_classes, extra_meta, seed):
    """save_model then load_model: every state entry (weights, BatchNorm statistics, counters) equal bit for bit,
    meta equal to what was written (the optional fields present or absent as written)."""
    from fedccrl_core.learning.model_file import ModelMeta, load_meta, load_model, save_model
    from fedccrl_core.learning.models import build_model

    model = build_model("small_cnn", num_classes, pretrained="none")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for v in model.state_dict().values():
            v.copy_(torch.randn(v.shape, generator=gen) if v.is_floating_point() else torch.randint(0, 99, v.shape))
    want_state = {k: v.clone() for k, v in model.state_dict().items()}
    meta = ModelMeta(
        **copy.deepcopy(extra_meta),
        backbone="small_cnn",
        num_classes=num_classes,
        classes=[f"c{i}" for i in range(num_classes)],
        image_size=32,
        mean=[0.5, 0.25, 0.125],
        std=[1.0, 2.0, 0.5],
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.pt"
        save_model(path, model, meta)
        loaded, got_meta = load_model(path)
        assert got_meta == meta and load_meta(path) == meta
        assert got_meta.to_dict() == meta.to_dict() and list(got_meta.to_dict()) == list(meta.to_dict())
    got_state = loaded.state_dict()
    assert got_state.keys() == want_state.keys()
    for k, v in want_state.items():
        assert got_state[k].dtype == v.dtype and torch.equal(got_state[k], v), k


# ---- the dotted-key setter (`dvc exp run -S key=value`) ---------------------------------------------------------
key_st = st.text("abcxyz_", min_size=1, max_size=4)
params_st = st.recursive(
    st.integers() | st.text(max_size=3) | st.booleans(),
    lambda inner: st.dictionaries(key_st, inner, min_size=1, max_size=4),
    max_leaves=12,
).filter(lambda d: isinstance(d, dict))


def dotted_paths(d: dict, prefix: tuple = ()) -> list[tuple[str, ...]]:
    """Every key of the nested dict, at any depth, as its path."""
    out = []
    for k, v in d.items():
        out.append((*prefix, k))
        if isinstance(v, dict):
            out.extend(dotted_paths(v, (*prefix, k)))
    return out


def get_path(d: dict, path: tuple):
    for k in path:
        d = d[k]
    return d


@given(params_st, st.data(), st.integers() | st.text(max_size=3) | st.lists(st.integers(), max_size=2))
def test_set_key_sets_that_key_and_nothing_else(params, data, value):
    from fedccrl_pipeline.params_yaml import set_key

    path = data.draw(st.sampled_from(dotted_paths(params)))
    before = copy.deepcopy(params)
    set_key(params, ".".join(path), value)
    assert get_path(params, path) == value
    for other in dotted_paths(before):  # every key outside the one set (and what it held) is as it was
        if other[: len(path)] != path and not path[: len(other)] == other:
            assert get_path(params, other) == get_path(before, other), other
    expected = copy.deepcopy(before)  # the whole file, written independently: one assignment
    get_path(expected, path[:-1])[path[-1]] = value
    assert params == expected


@given(params_st, st.data(), st.text("ABCQ", min_size=1, max_size=3))
def test_set_key_refuses_a_missing_key_naming_it(params, data, new):
    """A key that is not in the file (new under an existing group, or below a leaf) is a ParamError naming it, and
    nothing changes."""
    from fedccrl_pipeline.params_yaml import set_key

    parent = data.draw(st.sampled_from([(), *dotted_paths(params)]))
    dotted = ".".join((*parent, new))  # upper-case names never occur in params_st's keys
    before = copy.deepcopy(params)
    with pytest.raises(ParamError, match=re.escape(f"no key '{dotted}'")):
        set_key(params, dotted, 1)
    assert params == before
