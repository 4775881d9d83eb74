"""The 2-d embedding of FedCCRL Fig. 5 (t-SNE of h(x)); numpy and sklearn only, no torch, so that a drawing
process can run it without loading torch.

Floor 4 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import numpy as np


def tsne_2d(features: np.ndarray, seed: int) -> np.ndarray:
    """Fig. 5's 2-d embedding (Barnes-Hut t-SNE) on one thread. Its gradient sums depend on the OpenMP thread
    count, so one thread draws the same Fig. 5 on every machine; at a few hundred points it is also the fastest
    (measured on 2 shared cores: 0.4 s against 0.55 s, and BLAS threads stalled the PCA init up to 0.4 s)."""
    from sklearn.manifold import TSNE
    from threadpoolctl import threadpool_limits

    perplexity = float(min(30, max(2, (len(features) - 1) // 3)))
    with threadpool_limits(limits=1):  # OpenMP and BLAS
        return TSNE(n_components=2, init="pca", random_state=seed, perplexity=perplexity, max_iter=500).fit_transform(
            features
        )
