"""The toy algorithm of tests/test_add_an_algorithm.py, in a module of its own as a real algorithm's sits in
fedccrl_core/algorithms/ (docs/contributing.md, "Add an algorithm", step 1): cross-entropy (Eq. 1) times `scale`."""

from __future__ import annotations

from toy_params import ToyParams

from fedccrl_core.algorithms.base import Algorithm, cross_entropy_step


class Toy(Algorithm):
    name = "toy"
    Params = ToyParams
    hp: ToyParams

    def train_step(self, model, x, y, ctx):
        loss, terms, logits = cross_entropy_step(model, x, y, ctx.real_rows)
        return self.hp.scale * loss, terms, logits
