"""The toy algorithm's hyperparameters (tests/test_add_an_algorithm.py; the class is in tests/toy_algorithm.py), in a
module of their own without torch, as a real algorithm's sit in fedccrl_core/algorithm_params/ (docs/contributing.md, "Add an algorithm", step 1)."""

from __future__ import annotations

from fedccrl_core.foundation.hparams import HParams, hp


class ToyParams(HParams):
    """train.toy."""

    scale: float = hp(1.0, "the weight of the cross-entropy (Eq. 1 times scale): a test's choice", gt=0)
