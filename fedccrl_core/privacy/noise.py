"""Where the privacy noise and the privacy sampling come from: the operating system's entropy, never the run seed.

The run seed (params.yaml `train.seeds`) is public: the Flower server sends it to every client, and anyone with
params.yaml regenerates every draw derived from it. A Gaussian mechanism is private only if its noise is unknown
to the attacker, and sampling amplifies privacy only if the sample is (Wang, Balle, Kasiviswanathan 2019). So, with
train.privacy on, the noise of both channels, Eq. 8's choice of the rows released and the round's choice of
clients are drawn from a numpy Generator seeded by `SeedSequence()` without entropy given: 128 bits from
`secrets.randbits` (the OS's CSPRNG), fresh at every call. A DP run is therefore not bit-reproducible.

`train.privacy.noise_seed` (tests only) seeds these draws instead; such a run is not private and says so
(PrivacySettings.noise_source()).


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import numpy as np

from fedccrl_core.foundation.seeding import derive_seed
from fedccrl_core.privacy.settings import PrivacySettings


def private_rng(s: PrivacySettings, *keys) -> np.random.Generator:
    """A generator for noise or privacy sampling: OS entropy, or (noise_seed set) derived from noise_seed and
    `keys` (which must then name the draw: channel, round, client)."""
    if s.noise_seed is None:
        return np.random.default_rng(np.random.SeedSequence())
    return np.random.default_rng(derive_seed(s.noise_seed, "privacy", *keys))
