"""Properties of FedDG-Bench's lambda partition (fedccrl_core/data/feddg_bench.py) over a grid of
lambda, client counts, domain sizes and seeds."""

import itertools

import numpy as np
import pytest

from fedccrl_core.data import feddg_bench

SIZES = [(37, 120, 55, 64), (500, 21, 90)]  # uneven domains (PACS-like and a lopsided one)
CLIENTS = [2, 3, 4, 7, 30]  # below, at and above the number of domains
LAMBDAS = [0.0, 0.1, 0.5, 1.0]
SEEDS = [0, 1]


def _domain_of(sizes):
    return np.repeat(np.arange(len(sizes)), sizes)


GRID = list(itertools.product(SIZES, CLIENTS, LAMBDAS, SEEDS))


@pytest.mark.parametrize("sizes,C,lam,seed", GRID)
def test_every_example_exactly_once_and_counts_follow_the_formula(sizes, C, lam, seed):
    dom = _domain_of(sizes)
    parts = feddg_bench.assign(dom, len(sizes), C, lam, np.random.default_rng(seed))
    assert len(parts) == C
    allidx = np.concatenate(parts)
    assert np.array_equal(np.sort(allidx), np.arange(dom.size))  # a partition: each once, none lost
    got = np.array([np.bincount(dom[p], minlength=len(sizes)) for p in parts])
    real = feddg_bench.expected_counts(sizes, C, lam)
    assert np.abs(got - real).max() < 1.0 + 1e-9  # within one example of the formula
    assert np.array_equal(got.sum(axis=0), np.asarray(sizes))


@pytest.mark.parametrize("sizes,C", [(s, c) for s, c in itertools.product(SIZES, CLIENTS) if c >= len(s)])
def test_formula_by_hand(sizes, C):
    """The C >= D formula written out independently: n_d[(1-l)1{d=d(c)}/m_d + l/C]."""
    n = np.asarray(sizes, float)
    d_of = feddg_bench.main_domains(sizes, C)
    m = np.bincount(d_of, minlength=len(sizes))
    assert (m >= 1).all() and m.sum() == C
    for lam in LAMBDAS:
        real = feddg_bench.expected_counts(sizes, C, lam)
        for c in range(C):
            for d in range(len(sizes)):
                want = n[d] * ((1 - lam) * (d == d_of[c]) / m[d] + lam / C)
                assert real[c, d] == pytest.approx(want)


def test_extra_clients_go_to_the_domain_with_most_examples_per_main_client():
    # sizes 100, 40, 10 and 5 clients: m=(1,1,1); 100/1 is the most -> m0=2; 50/1 > 40 -> m0=3
    assert feddg_bench.main_domains([100, 40, 10], 5).tolist() == [0, 0, 0, 1, 2]
    # one more client: 100/3 = 33.3 < 40 -> m1=2
    assert feddg_bench.main_domains([100, 40, 10], 6).tolist() == [0, 0, 0, 1, 1, 2]


@pytest.mark.parametrize("sizes,C,seed", list(itertools.product(SIZES, CLIENTS, SEEDS)))
def test_lambda_0_gives_single_domain_clients(sizes, C, seed):
    dom = _domain_of(sizes)
    parts = feddg_bench.assign(dom, len(sizes), C, 0.0, np.random.default_rng(seed))
    if C >= len(sizes):
        assert all(np.unique(dom[p]).size == 1 for p in parts)
    else:  # C < D: each domain whole on one client (the benchmark's greedy rule)
        for d in range(len(sizes)):
            owners = [c for c, p in enumerate(parts) if (dom[p] == d).any()]
            assert len(owners) == 1


@pytest.mark.parametrize("sizes,C,seed", list(itertools.product(SIZES, CLIENTS, SEEDS)))
def test_lambda_1_gives_equal_domain_proportions(sizes, C, seed):
    """Tolerance: each client's share of domain d is within C / N of n_d / N (one example per domain)."""
    dom = _domain_of(sizes)
    parts = feddg_bench.assign(dom, len(sizes), C, 1.0, np.random.default_rng(seed))
    want = np.asarray(sizes) / sum(sizes)
    for p in parts:
        share = np.bincount(dom[p], minlength=len(sizes)) / p.size
        assert np.abs(share - want).max() <= len(sizes) / p.size + 1e-12


def test_same_seed_same_assignment_other_seed_differs():
    dom = _domain_of(SIZES[0])
    a = feddg_bench.assign(dom, 4, 7, 0.1, np.random.default_rng(3))
    b = feddg_bench.assign(dom, 4, 7, 0.1, np.random.default_rng(3))
    c = feddg_bench.assign(dom, 4, 7, 0.1, np.random.default_rng(4))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_stage_writes_mixed_clients_and_a_held_out_run_never_trains_on_the_target(tiny, tmp_path):
    from fedccrl_core.data import registry
    from fedccrl_core.data.manifest import client_ids
    from fedccrl_core.data.partition import PartitionSettings, partition
    from fedccrl_core.data.shards import load_client, load_domain_test

    spec = registry.get_dataset("synthetic")
    m = partition(
        tiny / "raw",
        tmp_path / "sh",
        spec,
        PartitionSettings(16, val_fraction=0.1, seed=0, scheme="feddg_bench", num_clients=6, lam=0.5),
        workers=1,
        progress=False,
    )
    manifest, m = m, m.to_dict()
    assert m["params"]["partition.lambda"] == 0.5 and m["params"]["partition.num_clients"] == 6
    assert [c["domain"] for c in m["clients"]] == ["mixed"] * 6
    sizes = [m["domain_sizes"][d] for d in m["domains"]]
    want = feddg_bench.client_counts(sizes, 6, 0.5)
    got = np.array([[c["domain_counts"].get(d, 0) for d in m["domains"]] for c in m["clients"]])
    assert np.array_equal(got, want)
    for target in m["domains"]:
        seen = []
        for cid in client_ids(manifest, target):
            s = load_client(tmp_path / "sh", cid, exclude_domain=target)
            paths = s.train_paths.tolist() + s.val_paths.tolist()
            assert paths and not any(p.startswith(target + "/") for p in paths)
            seen += paths
        _tx, ty = load_domain_test(tmp_path / "sh", target)
        assert len(ty) == m["domain_sizes"][target]  # the whole target, once
        assert len(seen) + len(ty) == sum(sizes)  # sources + target = everything


# ---- label skew inside the lambda partition (partition.dirichlet_alpha; feddg_bench.py "Label skew") ----------
def _labels(sizes, num_classes, seed):
    """Each domain's labels with its own uneven class mix (so a domain's mix differs from the pooled one)."""
    rng = np.random.default_rng(100 + seed)
    return np.concatenate([rng.choice(num_classes, size=n, p=rng.dirichlet(np.full(num_classes, 3.0))) for n in sizes])


SKEW_GRID = list(itertools.product(SIZES, [2, 4, 7, 30], [0.0, 0.5, 1.0], [0.1, 1.0], [0, 1]))


@pytest.mark.parametrize("sizes,C,lam,alpha,seed", SKEW_GRID)
def test_label_skew_keeps_the_lambda_counts_and_deals_every_example_once(sizes, C, lam, alpha, seed):
    dom, y = _domain_of(sizes), _labels(sizes, 7, seed)
    parts = feddg_bench.assign(dom, len(sizes), C, lam, np.random.default_rng(seed), y, alpha)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(dom.size))
    got = np.array([np.bincount(dom[p], minlength=len(sizes)) for p in parts])
    assert np.array_equal(got, feddg_bench.client_counts(sizes, C, lam))  # the domain axis is FedDG-Bench's
    if lam == 0.0 and C >= len(sizes):
        assert all(np.unique(dom[p]).size == 1 for p in parts)  # single-domain clients still
    again = feddg_bench.assign(dom, len(sizes), C, lam, np.random.default_rng(seed), y, alpha)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))  # same seed, same assignment


def _skew(parts, dom, y, num_classes):
    """Mean over (client, domain) cells of at least 10 examples: total-variation distance between the cell's
    class histogram and its domain's class mix."""
    tv = []
    for p in parts:
        for d in np.unique(dom[p]):
            cell = y[p][dom[p] == d]
            if cell.size >= 10:
                mix = np.bincount(y[dom == d], minlength=num_classes) / (dom == d).sum()
                tv.append(0.5 * np.abs(np.bincount(cell, minlength=num_classes) / cell.size - mix).sum())
    return float(np.mean(tv))


def test_small_alpha_skews_labels_and_large_alpha_follows_the_domain_mix():
    sizes, C = (600, 400, 500), 6
    dom, y = _domain_of(sizes), _labels(sizes, 7, 0)
    for seed in range(3):
        skewed = _skew(feddg_bench.assign(dom, 3, C, 0.5, np.random.default_rng(seed), y, 0.1), dom, y, 7)
        mixed = _skew(feddg_bench.assign(dom, 3, C, 0.5, np.random.default_rng(seed), y, 100.0), dom, y, 7)
        plain = _skew(feddg_bench.assign(dom, 3, C, 0.5, np.random.default_rng(seed)), dom, y, 7)
        assert skewed > 0.4 > 0.15 > mixed, (seed, skewed, mixed)
        assert plain < 0.15  # the benchmark's dealing: no skew


def test_without_alpha_the_dealing_is_the_benchmarks():
    """dirichlet_alpha = None: each domain's shuffled examples in consecutive runs, client order (unchanged)."""
    sizes, C, lam = (37, 120, 55, 64), 7, 0.1
    dom = _domain_of(sizes)
    rng = np.random.default_rng(5)
    counts = feddg_bench.client_counts(sizes, C, lam)
    want = [[] for _ in range(C)]
    for d in range(len(sizes)):
        idx = rng.permutation(np.flatnonzero(dom == d))
        for c in range(C):
            lo = counts[:c, d].sum()
            want[c].append(idx[lo : lo + counts[c, d]])
    got = feddg_bench.assign(dom, len(sizes), C, lam, np.random.default_rng(5), _labels(sizes, 7, 0), None)
    assert all(np.array_equal(g, np.sort(np.concatenate(w))) for g, w in zip(got, want))


@pytest.mark.parametrize("seed", range(20))
def test_class_counts_meet_both_margins_exactly(seed):
    rng = np.random.default_rng(seed)
    C, K = int(rng.integers(1, 9)), int(rng.integers(1, 8))
    cols = rng.integers(0, 40, size=K)
    cols[0] += 1
    rows = np.bincount(rng.integers(0, C, size=cols.sum()), minlength=C)  # any split of the same total
    x = feddg_bench.class_counts(rows, cols, rng.dirichlet(np.full(K, 0.3), size=C))
    assert (x >= 0).all() and np.array_equal(x.sum(1), rows) and np.array_equal(x.sum(0), cols)


def test_stage_with_label_skew_records_alpha_and_skews_clients(tiny, tmp_path):
    from fedccrl_core.data import registry
    from fedccrl_core.data.partition import PartitionSettings, partition

    spec = registry.get_dataset("synthetic")
    kw = dict(val_fraction=0.1, seed=0, scheme="feddg_bench", num_clients=6, lam=0.5)
    m = partition(
        tiny / "raw",
        tmp_path / "skew",
        spec,
        PartitionSettings(16, dirichlet_alpha=0.1, **kw),
        workers=1,
        progress=False,
    ).to_dict()
    even = partition(tiny / "raw", tmp_path / "even", spec, PartitionSettings(16, **kw), workers=1, progress=False)
    even = even.to_dict()
    assert m["params"]["partition.dirichlet_alpha"] == 0.1 and even["params"]["partition.dirichlet_alpha"] is None
    for a, b in zip(m["clients"], even["clients"]):
        assert a["domain_counts"] == b["domain_counts"]  # the lambda counts are untouched

    def spread(man):  # mean over clients of the largest class share of its training rows
        return np.mean([max(c["train_class_hist"]) / max(1, sum(c["train_class_hist"])) for c in man["clients"]])

    assert spread(m) > spread(even) + 0.1
