"""What the in-process engine released, recorded: the public capture that `fedccrl audit` attacks.

`CapturingTransport` is the engine's `InProcessTransport` (engine.py) with one addition: every round's
`collect_uploads` (Algorithm 1 lines 3-6: each client's `client_upload`, FedCCRL's F_i of Eq. 8, clipped and noised
under train.privacy by the algorithm itself) is kept in `captured[round][client]` as it leaves the clients, a copy
of the arrays. `CapturingEngine` is `InProcessEngine` with that transport (`driver.train(run, engine=...)`, or
built directly to read `engine.transport.captured` after `run()`): a training run that records its releases.

`capture_statistics` runs the uploads phase alone for `rounds` rounds, as RoundLoop runs it (federation/loop.py),
with the round loop's own accounting of each upload (`privacy_of`, `upload_sizes`, RunPrivacy.statistics): the
statistics channel's release does not depend on training (Eq. 8 draws from the client's fixed per-image
statistics, Eq. 6-7), so its uploads are what a full run's would be, at a fraction of the cost.


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from fedccrl_core.algorithms.base import Algorithm
from fedccrl_core.federation.engine import InProcessEngine, InProcessTransport
from fedccrl_core.federation.round_privacy import privacy_of, upload_sizes
from fedccrl_core.learning.clients import ClientData
from fedccrl_core.privacy.charged import ChargedRelease


def _copy(upload):
    if isinstance(upload, dict):
        return {k: np.array(v, copy=True) if isinstance(v, np.ndarray) else v for k, v in upload.items()}
    return upload


class CapturingTransport(InProcessTransport):
    """InProcessTransport that records each round's uploads (`captured`: {round: {client id: upload or None}})."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.captured: dict[int, dict] = {}

    def collect_uploads(self, rnd: int, charged: ChargedRelease | None = None) -> dict:
        uploads = super().collect_uploads(rnd, charged)
        self.captured[rnd] = {cid: _copy(u) for cid, u in uploads.items()}
        return uploads


class CapturingEngine(InProcessEngine):
    transport_class = CapturingTransport


def statistics_rows(captured: dict[int, dict]) -> dict[str, np.ndarray]:
    """{client id: its statistics rows (mu then sigma, float64) of every captured round, stacked}."""
    rows: dict[str, list[np.ndarray]] = {}
    for rnd in sorted(captured):
        for cid, u in captured[rnd].items():
            if isinstance(u, dict) and "mu" in u:
                rows.setdefault(cid, []).append(np.concatenate([u["mu"], u["sigma"]], axis=1).astype(np.float64))
    return {cid: np.concatenate(v) for cid, v in rows.items()}


class _UploadsOnly(torch.nn.Module):
    """The model slot of a transport that runs the uploads phase only: the transport reads the model's device (the
    CPU); the uploads never touch the model."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))


@dataclass
class StatisticsCapture:
    """The statistics uploads of `rounds` rounds: `rows[client]` [sum of k_i over the rounds, 2C] float64 (mu then
    sigma, as uploaded), `sizes[client]` (n_i, k_i) of the last round, and the statistics channel's epsilon after
    the rounds from the round loop's ledger (inf without train.privacy.statistics)."""

    rows: dict[str, np.ndarray]
    sizes: dict[str, tuple[int, int]]
    epsilon: float
    per_round: dict[int, dict] = field(default_factory=dict)


def capture_statistics(alg: Algorithm, clients: list[ClientData], seed: int, rounds: int) -> StatisticsCapture:
    """Rounds 1..`rounds` of the in-process engine's uploads phase over `clients`, recorded and accounted."""
    if rounds < 1:
        raise ValueError(f"params.yaml: train.rounds must be >= 1 to capture an upload, got {rounds}")
    privacy = privacy_of(alg)  # refuses a release without a mechanism, as the round loop does
    transport = CapturingTransport(alg, _UploadsOnly(), clients, seed)
    sizes: dict[str, tuple[int, int]] = {}
    for rnd in range(1, rounds + 1):
        sizes = upload_sizes(transport.collect_uploads(rnd), transport)
        if privacy is not None:
            privacy.statistics(rnd, sizes)
    if privacy is not None and privacy.uploads:
        from fedccrl_core.privacy.accountant import STATISTICS

        eps = privacy.ledger.epsilon(channel=STATISTICS)
    else:
        eps = math.inf
    return StatisticsCapture(
        statistics_rows(transport.captured),
        sizes,
        eps,
        transport.captured,
    )
