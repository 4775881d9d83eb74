"""The confusion matrix of a classifier's predictions, in numpy: the evaluate stage (fedccrl_core/outcomes/runs.py) and
`fedccrl-serve evaluate` count with it, and serving imports no torch.

Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import numpy as np


def confusion_matrix(y_true, y_pred, num_classes: int) -> np.ndarray:
    """C[i, j] = number of samples of true class i predicted as j (int64, num_classes x num_classes)."""
    idx = np.asarray(y_true, dtype=np.int64) * num_classes + np.asarray(y_pred, dtype=np.int64)
    return np.bincount(idx, minlength=num_classes * num_classes).reshape(num_classes, num_classes)
