"""FedProx (Li et al., MLSys 2020): local objective h_k(w) = F_k(w) + mu/2 ||w - w^t||^2 (their Eq. 2),
with w^t the global weights received this round.

Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from fedccrl_core.algorithm_params.fedprox import FedProxParams
from fedccrl_core.algorithms.base import Algorithm, cross_entropy_step
from fedccrl_core.foundation import contract


class FedProx(Algorithm):
    name = "fedprox"
    Params = FedProxParams
    hp: FedProxParams
    pads_partial_batch = True  # its loss reads ctx.real_rows only (learning/static_batch.py)

    def train_step(self, model, x, y, ctx):
        loss, terms, logits = cross_entropy_step(model, x, y, ctx.real_rows)
        prox = sum(((p - g) ** 2).sum() for p, g in zip(model.parameters(), ctx.global_params))
        l_prox = 0.5 * self.hp.mu * prox
        terms[contract.L_PROX] = l_prox
        return loss + l_prox, terms, logits
