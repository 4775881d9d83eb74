"""Eq. 2, theta = 1/N sum_i n_i theta_i with N = sum_i n_i, against a float64 loop: the tests that kill
`make mutation`'s mutants of fedccrl_core/learning/aggregation.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedccrl_core.learning.aggregation import WeightedSum, weighted_average


def states(weights: list[float], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "w": torch.randn(3, 2, generator=g),
            "b": torch.randn(4, generator=g, dtype=torch.float64),
            "bn.num_batches_tracked": torch.tensor(10 * (i + 1) % 7),
        }
        for i in range(len(weights))
    ]


def eq2_loop(sts: list[dict], weights: list[float], key: str) -> np.ndarray:
    """Eq. 2 entry by entry in float64."""
    total = sum(weights)
    out = np.zeros(sts[0][key].shape)
    for s, n in zip(sts, weights):
        out += n * s[key].double().numpy()
    return out / total


@pytest.mark.parametrize("weights", [[3.0, 1.0, 6.0], [1.0], [2.0, 2.0]])
def test_weighted_average_equals_eq2(weights):
    sts = states(weights)
    out = weighted_average(sts, weights)
    assert out.keys() == sts[0].keys()
    for key in ("w", "b"):
        assert out[key].dtype == sts[0][key].dtype
        np.testing.assert_allclose(out[key].double().numpy(), eq2_loop(sts, weights, key), rtol=1e-6, atol=1e-7)
    # an integer buffer is not averaged: the largest count is kept
    assert int(out["bn.num_batches_tracked"]) == max(int(s["bn.num_batches_tracked"]) for s in sts)


@pytest.mark.parametrize("total", [None, 10.0])
def test_streamed_sum_equals_eq2_with_or_without_the_total(total):
    weights = [3.0, 1.0, 6.0]
    sts = states(weights, seed=1)
    acc = WeightedSum(total)
    for s, n in zip(sts, weights):
        acc.add(s, n)
    assert acc.count == 3 and acc.seen == 10.0
    out = acc.result()
    for key in ("w", "b"):
        np.testing.assert_allclose(out[key].double().numpy(), eq2_loop(sts, weights, key), rtol=1e-6, atol=1e-7)


def test_a_dropped_client_is_rescaled_to_the_clients_that_arrived():
    """total announced as 10, only the clients of weights 3 and 1 arrive: Eq. 2 over those two."""
    sts = states([3.0, 1.0], seed=2)
    acc = WeightedSum(10.0)
    acc.add(sts[0], 3.0)
    acc.add(sts[1], 1.0)
    out = acc.result()
    for key in ("w", "b"):
        np.testing.assert_allclose(out[key].double().numpy(), eq2_loop(sts, [3.0, 1.0], key), rtol=1e-6, atol=1e-7)


def eq2_terms_loop(sts: list[dict], weights: list[float], key: str, total: float | None) -> np.ndarray:
    """Eq. 2 term by term in float64, in the documented order: sum_i (n_i / N) theta_i when N is announced, else
    (sum_i n_i theta_i) * (1 / N); then in the entry's own dtype."""
    acc = np.zeros(sts[0][key].shape)
    for s, n in zip(sts, weights):
        acc += s[key].double().numpy() * (n / total if total is not None else float(n))
    if total is None:
        acc = acc * (1.0 / sum(weights))
    return acc.astype(sts[0][key].numpy().dtype)


@pytest.mark.parametrize("total", [None, 10.0])
def test_eq2_is_accumulated_in_float64_term_by_term(total):
    """Bit for bit: every term in float64 (the float32 weights cast first), so the list form and the streamed form
    with the total announced give the same bits."""
    weights = [3.0, 1.0, 6.0]
    g = torch.Generator().manual_seed(3)
    sts = [
        {"w": torch.randn(4000, generator=g), "b": torch.randn(300, generator=g, dtype=torch.float64)} for _ in weights
    ]
    acc = WeightedSum(total)
    for s, n in zip(sts, weights):
        acc.add(s, n)
    streamed = acc.result()
    listed = weighted_average(sts, weights)
    for key in ("w", "b"):
        want = eq2_terms_loop(sts, weights, key, total)
        np.testing.assert_array_equal(streamed[key].numpy(), want)
        if total is not None:
            np.testing.assert_array_equal(listed[key].numpy(), want)


def test_the_integer_buffer_keeps_the_largest_whatever_the_order():
    sts = [{"n": torch.tensor(v)} for v in (5, 9, 2)]
    assert int(weighted_average(sts, [1.0, 1.0, 1.0])["n"]) == 9
    assert int(weighted_average(sts[::-1], [1.0, 1.0, 1.0])["n"]) == 9
    assert int(weighted_average(sts[:1], [1.0])["n"]) == 5


def test_the_first_state_is_not_modified():
    sts = [{"n": torch.tensor(5), "w": torch.ones(2)}, {"n": torch.tensor(9), "w": torch.zeros(2)}]
    weighted_average(sts, [1.0, 1.0])
    assert int(sts[0]["n"]) == 5 and sts[0]["w"].tolist() == [1.0, 1.0]


def test_refusals_name_the_problem():
    st = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=r"^weighted_average: no client states to aggregate$"):
        weighted_average([], [])
    with pytest.raises(ValueError, match="2 states but 1 weights"):
        weighted_average([st, st], [1.0])
    with pytest.raises(ValueError, match="total weight must be positive, got 0"):
        WeightedSum(0)
    with pytest.raises(ValueError, match="total weight must be positive, got -1"):
        WeightedSum(-1)
    with pytest.raises(ValueError, match=r"^weighted_average: no client states to aggregate$"):
        WeightedSum().result()
    acc = WeightedSum()
    acc.add(st, 0.0)
    with pytest.raises(ValueError, match="total weight must be positive, got 0.0"):
        acc.result()
    acc = WeightedSum()
    acc.add(st, 1.0)
    with pytest.raises(ValueError, match="client 1 has different state keys"):
        acc.add({"v": torch.ones(2)}, 1.0)
    with pytest.raises(ValueError, match=r"'w' has shape \(3,\), expected \(2,\)"):
        acc.add({"w": torch.ones(3)}, 1.0)


def test_a_positive_total_is_accepted():
    acc = WeightedSum(1e-9)
    acc.add({"w": torch.ones(2)}, 1e-9)
    assert acc.result()["w"].tolist() == [1.0, 1.0]
