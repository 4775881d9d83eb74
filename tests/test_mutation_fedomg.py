"""FedOMG's server step (Eq. 15-17) against float64 loops written from fedomg.py's stated algorithm: the Eq. 15
search step by step, the Gram matrix and the combination block by block. The tests that kill `make mutation`'s
mutants of fedccrl_core/algorithms/fedomg.py that tests/test_fedomg.py leaves alive."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.algorithms.base import Reply
from fedccrl_core.algorithms.fedomg import (
    column_blocks,
    combine,
    gram_matrix,
    is_matched,
    matching_objective,
    search_coefficients,
)

fedomg_module = importlib.import_module("fedccrl_core.algorithms.fedomg")


def search_loop(gram: np.ndarray, p: np.ndarray, kappa: float, lr: float, steps: int, momentum: float) -> list[float]:
    """Eq. 15 as fedomg.py states it: G scaled by s^2 (s = mean_u ||g_u||), Gamma = softmax(w) from w = 0, `steps`
    heavy-ball steps buf = momentum buf + dF/dw, w = w - lr buf, and the visited Gamma of lowest F."""
    u = len(p)
    s = sum(math.sqrt(gram[i][i]) for i in range(u)) / u
    if not s * s > 0:
        return [1.0 / u] * u
    g = [[gram[i][j] / (s * s) for j in range(u)] for i in range(u)]
    g_p = [sum(g[i][j] * p[j] for j in range(u)) for i in range(u)]
    g_fl = math.sqrt(max(sum(p[i] * g_p[i] for i in range(u)), 0.0))
    w, buf = [0.0] * u, [0.0] * u
    best_f, best = math.inf, None
    for step in range(steps + 1):
        e = [math.exp(x - max(w)) for x in w]
        gamma = [x / sum(e) for x in e]
        g_gamma = [sum(g[i][j] * gamma[j] for j in range(u)) for i in range(u)]
        norm = math.sqrt(max(sum(gamma[i] * g_gamma[i] for i in range(u)), 0.0))
        f = sum(gamma[i] * g_p[i] for i in range(u)) + kappa * g_fl * norm
        if f < best_f:
            best_f, best = f, gamma
        if step == steps:
            break
        d = [g_p[i] + (kappa * g_fl / norm * g_gamma[i] if norm > 0 else 0.0) for i in range(u)]
        mean_d = sum(gamma[i] * d[i] for i in range(u))
        grad = [gamma[i] * (d[i] - mean_d) for i in range(u)]
        buf = [momentum * buf[i] + grad[i] for i in range(u)]
        w = [w[i] - lr * buf[i] for i in range(u)]
    return best


def gram_of(rows: np.ndarray) -> np.ndarray:
    return np.array([[float(np.dot(a, b)) for b in rows] for a in rows])


@pytest.mark.parametrize(
    ("kappa", "lr", "steps", "momentum"), [(0.5, 25.0, 20, 0.5), (1.5, 3.0, 7, 0.9), (0.2, 40.0, 1, 0.0)]
)
def test_search_equals_its_loop_step_by_step(kappa, lr, steps, momentum):
    rng = np.random.default_rng(0)
    common = rng.normal(0, 1, 30)
    rows = np.stack([common + rng.normal(0, 2.0, 30) * (u + 1) for u in range(4)])
    gram = gram_of(rows)
    p = np.array([0.1, 0.2, 0.3, 0.4])
    got = search_coefficients(torch.tensor(gram), torch.tensor(p), kappa, lr, steps, momentum)
    want = search_loop(gram, p, kappa, lr, steps, momentum)
    assert got.dtype == torch.float64 and got.shape == (4,)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-9, atol=1e-12)
    assert float(got.sum()) == pytest.approx(1.0, abs=1e-12)


def test_search_of_zero_updates_is_uniform():
    p = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    got = search_coefficients(torch.zeros(3, 3, dtype=torch.float64), p, 0.5, 25, 20, 0.5)
    assert got.tolist() == [1 / 3, 1 / 3, 1 / 3]


def test_search_through_a_zero_gamma_g():
    """g_2 = -g_1 with equal weights: Gamma_g = 0 at the uniform start, where the matching term has no gradient."""
    row = np.array([1.0, -2.0, 0.5])
    gram = gram_of(np.stack([row, -row]))
    p = np.array([0.5, 0.5])
    got = search_coefficients(torch.tensor(gram), torch.tensor(p), 0.8, 10.0, 5, 0.5)
    np.testing.assert_allclose(got.numpy(), search_loop(gram, p, 0.8, 10.0, 5, 0.5), rtol=1e-9, atol=1e-12)


def test_matching_objective_equals_eq15_row_by_row():
    rng = np.random.default_rng(1)
    rows = rng.normal(0, 1, (3, 8))
    gram, p = gram_of(rows), np.array([0.5, 0.25, 0.25])
    gammas = np.array([[1 / 3, 1 / 3, 1 / 3], [1.0, 0.0, 0.0], [0.2, 0.5, 0.3]])
    got = matching_objective(torch.tensor(gammas), torch.tensor(gram), torch.tensor(p), 0.7)
    g_fl = p @ rows
    for r, gamma in enumerate(gammas):
        gamma_g = gamma @ rows
        want = float(gamma_g @ g_fl) + 0.7 * float(np.linalg.norm(g_fl)) * float(np.linalg.norm(gamma_g))
        assert float(got[r]) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("chunk", [3, 4, 64])
def test_gram_and_combine_block_by_block(chunk, monkeypatch):
    """D read in blocks of CHUNK columns (10 columns: a partial last block with 3 and 4): G = D D^T and
    sum_u c_u D_u equal their loops, and the blocks tile D exactly once."""
    monkeypatch.setattr(fedomg_module, "CHUNK", chunk)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randn(10, generator=g) for _ in range(3)]
    d = np.stack([r.double().numpy() for r in rows])
    starts = []
    for start, block in column_blocks(rows):
        assert block.dtype == torch.float64
        np.testing.assert_array_equal(block.numpy(), d[:, start : start + block.shape[1]])
        starts.append((start, block.shape[1]))
    assert starts == [(s, min(chunk, 10 - s)) for s in range(0, 10, chunk)]
    gram = gram_matrix(rows)
    assert gram.dtype == torch.float64
    np.testing.assert_allclose(gram.numpy(), gram_of(d), rtol=1e-12)
    coefficients = torch.tensor([0.5, -1.0, 2.0])
    out = combine(rows, coefficients)
    assert out.dtype == torch.float64
    np.testing.assert_allclose(
        out.numpy(), [sum(float(coefficients[u]) * d[u, i] for u in range(3)) for i in range(10)]
    )


def test_is_matched_takes_the_parameters_not_the_batchnorm_statistics():
    f, i = torch.zeros(1), torch.zeros(1, dtype=torch.long)
    assert is_matched("h.conv.weight", f) and is_matched("bn.bias", f) and is_matched("running_var_scale", f)
    assert not is_matched("h.bn.running_mean", f) and not is_matched("bn.running_var", f)
    assert not is_matched("running_mean", f)
    assert not is_matched("h.conv.weight", i)


def step(theta, replies, hp):
    alg = build_algorithm("fedomg", LocalConfig(), hp)
    agg = alg.aggregation(theta, float(sum(r.n for r in replies)))
    for r in replies:
        agg.add(r)
    return agg.result(), agg


def test_a_model_without_parameters_is_fedavg():
    theta = {"bn.running_mean": torch.zeros(2), "bn.num_batches_tracked": torch.tensor(1)}
    replies = [
        Reply("a", {"bn.running_mean": torch.tensor([1.0, 2.0]), "bn.num_batches_tracked": torch.tensor(3)}, 1),
        Reply("b", {"bn.running_mean": torch.tensor([3.0, 0.0]), "bn.num_batches_tracked": torch.tensor(5)}, 3),
    ]
    out, agg = step(theta, replies, {"kappa": 0.5})
    assert out["bn.running_mean"].tolist() == [2.5, 0.5] and int(out["bn.num_batches_tracked"]) == 5
    assert agg.last is None


def test_step_records_gamma_c_and_p_and_frees_the_rows():
    g = torch.Generator().manual_seed(4)
    theta = {"w": torch.randn(6, generator=g)}
    replies = [Reply(f"c{u}", {"w": theta["w"] + torch.randn(6, generator=g)}, n) for u, n in enumerate((2, 6))]
    out, agg = step(theta, replies, {"kappa": 0.9, "global_lr": 0.5})
    d = np.stack([(r.weights["w"] - theta["w"]).double().numpy() for r in replies])
    gram = gram_of(d)
    p = np.array([0.25, 0.75])
    gamma = np.array(search_loop(gram, p, 0.9, 25.0, 20, 0.5))  # the defaults: search_lr 25, 20 steps, momentum 0.5
    np.testing.assert_allclose(agg.last["gamma"].numpy(), gamma, rtol=1e-9)
    np.testing.assert_allclose(agg.last["p"].numpy(), p)
    c = 0.9 * math.sqrt(p @ gram @ p) / math.sqrt(gamma @ gram @ gamma)  # Eq. 16
    assert agg.last["c"] == pytest.approx(c, rel=1e-9)
    assert agg.last["client_ids"] == ["c0", "c1"]
    want = theta["w"].double().numpy() + 0.5 * (p @ d + c * (gamma @ d))  # Eq. 17 with g_u = -Delta_u
    np.testing.assert_allclose(out["w"].double().numpy(), want, rtol=1e-5, atol=1e-6)
    assert agg.rows == []


def test_opposite_updates_give_a_zero_gamma_g_and_no_matching_term():
    """Delta_2 = -Delta_1, n equal: g_FL = 0, the search stays uniform, Gamma*_g = 0 and c = 0 (no division)."""
    theta = {"w": torch.zeros(3)}
    delta = torch.tensor([1.0, -2.0, 0.5])
    replies = [Reply("a", {"w": delta.clone()}, 4), Reply("b", {"w": -delta}, 4)]
    out, agg = step(theta, replies, {"kappa": 0.5, "global_lr": 1.0})
    assert agg.last["c"] == 0.0
    assert out["w"].tolist() == [0.0, 0.0, 0.0]


def test_search_of_small_updates_is_not_uniform():
    """Updates of norm ~1e-3 (s^2 < 1): the search still runs on G / s^2."""
    rng = np.random.default_rng(5)
    rows = rng.normal(0, 1e-3, (3, 12)) * np.array([[1.0], [3.0], [0.5]])
    gram, p = gram_of(rows), np.array([0.2, 0.3, 0.5])
    got = search_coefficients(torch.tensor(gram), torch.tensor(p), 0.5, 25.0, 20, 0.5)
    np.testing.assert_allclose(got.numpy(), search_loop(gram, p, 0.5, 25.0, 20, 0.5), rtol=1e-9, atol=1e-12)
    assert float((got - 1 / 3).abs().max()) > 1e-3


def test_search_leaves_a_zero_gamma_g_without_dividing_by_it():
    """g_2 = -g_1, p = (0.8, 0.2): g_FL != 0 but Gamma_g = 0 at the uniform start; kappa < 1 lets F go below 0."""
    row = np.array([1.0, -2.0, 0.5])
    gram, p = gram_of(np.stack([row, -row])), np.array([0.8, 0.2])
    got = search_coefficients(torch.tensor(gram), torch.tensor(p), 0.5, 10.0, 5, 0.5)
    want = search_loop(gram, p, 0.5, 10.0, 5, 0.5)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-9, atol=1e-12)
    assert abs(want[0] - 0.5) > 1e-3 and not torch.isnan(got).any()


def test_kappa_0_runs_no_search():
    g = torch.Generator().manual_seed(6)
    theta = {"w": torch.randn(4, generator=g)}
    replies = [Reply(f"c{u}", {"w": theta["w"] + torch.randn(4, generator=g)}, 3) for u in range(2)]
    _, agg = step(theta, replies, {"kappa": 0.0})
    assert agg.last["gamma"] is None and agg.last["c"] == 0.0


def test_kappa_0_and_eta_1_is_eq2_term_by_term_with_the_total_known():
    """kappa = 0, eta_g = 1 adds exact zeros to Eq. 2's result, and with N known before the first reply every term is
    n_u / N * theta_u (aggregation.WeightedSum): float64 weights show the order of the rounding."""
    rng = np.random.default_rng(8)
    theta = {"w": torch.tensor(rng.normal(size=64))}
    ns = (3, 7, 11)
    replies = [Reply(f"c{u}", {"w": torch.tensor(rng.normal(size=64))}, n) for u, n in enumerate(ns)]
    big_n = float(sum(ns))
    want = np.zeros(64)
    for r in replies:
        want = want + r.weights["w"].numpy() * (r.n / big_n)
    late = np.zeros(64)  # the other order: n_u theta_u summed, then / N
    for r in replies:
        late = late + r.weights["w"].numpy() * float(r.n)
    assert not np.array_equal(late * (1.0 / big_n), want)  # the case tells the two roundings apart
    alg = build_algorithm("fedomg", LocalConfig(), {"kappa": 0.0, "global_lr": 1.0})
    assert np.array_equal(alg.aggregate(theta, replies)["w"].numpy(), want)
    agg = alg.aggregation(theta, big_n)
    for r in replies:
        agg.add(r)
    assert np.array_equal(agg.result()["w"].numpy(), want)


def test_updates_are_rows_in_the_replies_precision():
    """Global weights in float64, replies in float32: theta is cast to the replies' dtype first, so Delta_u is
    theta_u - float32(theta) in float32 (exact by Sterbenz), and the result is in the replies' dtype."""
    theta = {
        "w": torch.tensor([1 / 3, 2 / 3, -0.1], dtype=torch.float64),
        "b": torch.tensor([0.7], dtype=torch.float64),
    }
    replies = [
        Reply("a", {"w": torch.tensor([0.5, 0.6, -0.2]), "b": torch.tensor([0.75])}, 2),
        Reply("b", {"w": torch.tensor([0.25, 0.7, -0.05]), "b": torch.tensor([0.5])}, 3),
    ]
    alg = build_algorithm("fedomg", LocalConfig(), {"kappa": 0.5})
    agg = alg.aggregation(theta, 5.0)
    for r in replies:
        agg.add(r)
    theta32 = np.concatenate([theta["w"].numpy().astype(np.float32), theta["b"].numpy().astype(np.float32)])
    assert agg.theta.dtype == torch.float32 and np.array_equal(agg.theta.numpy(), theta32)
    for r, row in zip(replies, agg.rows):
        want = np.concatenate([r.weights["w"].numpy(), r.weights["b"].numpy()]) - theta32  # float32 - float32
        assert row.dtype == torch.float32 and np.array_equal(row.numpy(), want)
    exact = np.concatenate([r.weights["w"].numpy(), r.weights["b"].numpy()]).astype(np.float64) - np.concatenate(
        [theta["w"].numpy(), theta["b"].numpy()]
    )
    assert not np.array_equal(exact.astype(np.float32), agg.rows[0].numpy())  # the case tells the two apart
    out = agg.result()
    assert agg.last["c"] > 0 and out["w"].dtype == torch.float32 and out["b"].dtype == torch.float32


def test_one_client_with_kappa_1_adds_the_matching_term_with_c_exactly_1():
    """U = 1: Gamma* = (1), Gamma*_g = g_FL, so Eq. 16's c = kappa ||g_FL|| / ||g_FL|| = 1 at kappa = 1, and Eq. 17
    moves theta by eta_g (Delta + c Delta) = 2 eta_g Delta."""
    rng = np.random.default_rng(12)
    theta = {"w": torch.tensor(rng.normal(size=5))}
    delta = rng.normal(size=5)
    replies = [Reply("a", {"w": theta["w"] + torch.tensor(delta)}, 4)]
    out, agg = step(theta, replies, {"kappa": 1.0, "global_lr": 0.5})
    assert agg.last["c"] == 1.0 and agg.last["gamma"].tolist() == [1.0]
    want = theta["w"].numpy() + 0.5 * (delta + 1.0 * delta)
    np.testing.assert_allclose(out["w"].numpy(), want, rtol=1e-12, atol=1e-12)


def test_search_refuses_an_objective_that_is_never_finite():
    """A Gram matrix with finite norms but a NaN inner product: F is NaN at every iterate, so no visited iterate has
    the lowest F and the search says so."""
    gram = torch.tensor([[1.0, math.nan], [math.nan, 1.0]], dtype=torch.float64)
    p = torch.tensor([0.5, 0.5], dtype=torch.float64)
    with pytest.raises(
        AssertionError, match=r"^FedOMG: the coefficient search met no finite objective \(a non-finite update\?\)$"
    ):
        search_coefficients(gram, p, 0.5, 25.0, 3, 0.5)
