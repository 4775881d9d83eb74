"""Client sampling (Algorithm 1): m = max(1, round(C N)) of the N clients that answered a round, without replacement,
from the run seed (the paper), or from a generator the caller gives (train.privacy: the OS's, privacy/noise.py).


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import numpy as np

from fedccrl_core.foundation.seeding import numpy_rng


def sampled_count(clients: int, fraction: float) -> int:
    """m, the clients sampled out of N each round; `fraction` in (0, 1] (params.yaml's schema bounds it)."""
    return max(1, round(fraction * clients))


def sample_clients(
    client_ids: list[str], fraction: float, seed: int, rnd: int, rng: np.random.Generator | None = None
) -> list[str]:
    """m of the N clients without replacement, from the run seed, or from `rng` (train.privacy: the OS's)."""
    k = sampled_count(len(client_ids), fraction)
    if k == len(client_ids):
        return list(client_ids)
    idx = (rng or numpy_rng(seed, "sample", rnd)).choice(len(client_ids), size=k, replace=False)
    return [client_ids[i] for i in sorted(idx)]
