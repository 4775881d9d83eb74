"""Eq. 2 of FedCCRL, theta^{t+1} = 1/N sum_i n_i theta_i^t with N = sum_i n_i, as tensor arithmetic.

Floor 1 (docs/architecture.md, "Layers"): algorithms (floor 2) aggregate with it and the round loop (floor 3)
streams replies into it. `WeightedSum` folds one client's weights at a time into float64
accumulators, so no list of every client's weights is ever held; `weighted_average` over a list
is the same sum, term for term, so both give the same bits when they see the same total.
"""

from __future__ import annotations

import torch


class WeightedSum:
    """Streamed Eq. 2: `add(state, n)` once per client, then `result()`.

    `total` is N when it is known before the first client arrives (then every term is
    n_i / N * theta_i, exactly as `weighted_average` computes it); with `total=None` the terms are
    n_i * theta_i and the sum is divided by N at the end (equal within float64 rounding).
    Integer buffers (BatchNorm's num_batches_tracked) are not averaged: the largest value is kept.
    """

    def __init__(self, total: float | None = None):
        if total is not None and float(total) <= 0:
            raise ValueError(f"weighted_average: total weight must be positive, got {total}")
        self.total = None if total is None else float(total)
        self.seen = 0.0
        self.count = 0
        self._acc: dict[str, torch.Tensor] = {}
        self._ref: dict[str, torch.Tensor] = {}

    def add(self, state: dict[str, torch.Tensor], n: float) -> None:
        if self.count == 0:
            self._ref = {k: torch.empty(0, dtype=v.dtype) for k, v in state.items()}
            self._shapes = {k: v.shape for k, v in state.items()}
        elif state.keys() != self._ref.keys():
            raise ValueError(f"weighted_average: client {self.count} has different state keys")
        scale = n / self.total if self.total is not None else float(n)
        for k, v in state.items():
            if v.shape != self._shapes[k]:
                raise ValueError(
                    f"weighted_average: '{k}' has shape {tuple(v.shape)}, expected {tuple(self._shapes[k])}"
                )
            if v.is_floating_point():
                if k not in self._acc:
                    self._acc[k] = torch.zeros_like(v, dtype=torch.float64)
                self._acc[k] += v.to(torch.float64) * scale
            else:
                self._acc[k] = v.clone() if k not in self._acc else torch.maximum(self._acc[k], v)
        self.seen += float(n)
        self.count += 1

    def result(self) -> dict[str, torch.Tensor]:
        """1/N sum_i n_i theta_i. If the clients that arrived weigh less than the announced total (a
        client dropped), the sum is rescaled to them: equal to the list form within float64 rounding."""
        if self.count == 0:
            raise ValueError("weighted_average: no client states to aggregate")
        if self.seen <= 0:
            raise ValueError(f"weighted_average: total weight must be positive, got {self.seen}")
        rescale = None
        if self.total is None:
            rescale = 1.0 / self.seen
        elif self.seen != self.total:
            rescale = self.total / self.seen
        out = {}
        for k, ref in self._ref.items():
            acc = self._acc[k]
            if ref.is_floating_point():
                out[k] = (acc if rescale is None else acc * rescale).to(ref.dtype)
            else:
                out[k] = acc
        return out


def weighted_average(states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """Eq. 2 over every floating-point entry of the state dicts (parameters and BN running stats)."""
    if not states:
        raise ValueError("weighted_average: no client states to aggregate")
    if len(states) != len(weights):
        raise ValueError(f"weighted_average: {len(states)} states but {len(weights)} weights")
    acc = WeightedSum(float(sum(weights)))
    for s, n in zip(states, weights):
        acc.add(s, n)
    return acc.result()
