"""epsilon per image across the runs of a sweep: runs that train on the same clients compose.

A sweep (`dvc repro`: every held-out domain x algorithm x seed) trains many runs on one partition. An image of
domain d is a training image of every run in which d is a source domain, and each of those runs releases it
(its statistics row when Eq. 8 samples it, the aggregate its client's update enters). Its privacy loss is
therefore the composition of every event of every such run, not one run's epsilon. The events are the runs' own
(accountant.py: a statistics event for the client with the largest k_i / n_i, a weights event per round), and
they compose as any others do: RDP adds over events (Mironov 2017, Prop. 1), so

    epsilon_sweep(d) = epsilon_of(all events of every run whose source domains hold d, delta)

with the same accountant (dp_accounting's RDP accountant, REPLACE_ONE, accountant.py `epsilon_of`). A run counts
the events its ledger charged (a finished run, RunResult.extra) or the events it will charge when it trains every
round (`planned_releases`, for the check before a sweep trains anything).

A release is plain numbers (channel, population, sample, noise multiplier): the event
`sampled_gaussian(population, sample, noise multiplier)` of accountant.py, so it travels in JSON (history.json,
an MLflow tag) and never as a pickle.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fedccrl_core.privacy.accountant import STATISTICS, WEIGHTS, epsilon_of, sampled_gaussian, worst_client
from fedccrl_core.privacy.settings import PrivacySettings

Release = tuple[str, int, int, float]  # (channel, population, sample, noise multiplier): one charged event


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep as the sweep's accounting sees it: a label (algorithm, seed, held-out domain), the
    domains whose training images it trained on (its source domains), and the releases it charged or plans."""

    label: str
    trained_domains: tuple[str, ...]
    releases: tuple[Release, ...]


def ledger_releases(state: Iterable[Sequence]) -> list[Release]:
    """accountant.py RunPrivacy.state() (its plain numbers: [channel, round, population, sample, z] per release, in
    order) -> releases, in the same order."""
    return [(str(channel), int(p), int(k), float(z)) for channel, _, p, k, z in state]


def planned_releases(
    settings: PrivacySettings,
    uploads: bool,
    sizes: dict[str, tuple[int, int]],
    clients: int,
    sampled: int,
    rounds: int,
) -> list[Release]:
    """The releases of a run that trains all `rounds` rounds (RunPrivacy's per-round events, accountant.py):
    the statistics uploads of `sizes` = {client: (n_i, k_i)} when the algorithm uploads rows, and the aggregate
    of `sampled` out of `clients`."""
    per_round: list[Release] = []
    if uploads:
        n, k = worst_client(sizes)
        per_round.append((STATISTICS, n, k, settings.stats_noise_multiplier))
    per_round.append((WEIGHTS, clients, sampled, settings.weights_noise_multiplier / 2.0))
    return per_round * rounds


def per_image_epsilon(runs: Sequence[SweepRun], delta: float) -> dict[str, float]:
    """{domain: epsilon at `delta` of one training image of that domain over the whole sweep}: the composition
    of every release of every run that trained on the domain (the module's docstring). Domains in sorted order."""
    domains = sorted({d for r in runs for d in r.trained_domains})
    out = {}
    for d in domains:
        counts: dict[tuple[int, int, float], int] = {}
        for r in runs:
            if d in r.trained_domains:
                for _, p, k, z in r.releases:
                    counts[(p, k, z)] = counts.get((p, k, z), 0) + 1
        out[d] = _composed(tuple(sorted(counts.items())), delta)
    return out


@functools.lru_cache(maxsize=256)
def _composed(counts: tuple[tuple[tuple[int, int, float], int], ...], delta: float) -> float:
    """epsilon_of the events {(population, sample, z): count}: the domains of a sweep (and the steps of a worked
    example) share their compositions, computed once each."""
    return epsilon_of([sampled_gaussian(p, k, z) for (p, k, z), c in counts for _ in range(c)], delta)


def encode_releases(releases: Iterable[Release]) -> str:
    """Releases as compact JSON: [[channel, population, sample, z, count], ...], equal releases counted once (the
    order does not matter to the composition). Small enough for an MLflow tag (a run charges a few kinds)."""
    counts: dict[Release, int] = {}
    for r in releases:
        key = (str(r[0]), int(r[1]), int(r[2]), float(r[3]))
        counts[key] = counts.get(key, 0) + 1
    return json.dumps([[*k, c] for k, c in sorted(counts.items())], separators=(",", ":"))


def decode_releases(text: str, where: str) -> list[Release]:
    """encode_releases' JSON back to releases; ValueError naming `where` when it is not that."""
    try:
        rows = json.loads(text)
        out: list[Release] = []
        for channel, population, sample, z, count in rows:
            if channel not in (STATISTICS, WEIGHTS) or int(count) < 1:
                raise ValueError(channel)
            out += [(str(channel), int(population), int(sample), float(z))] * int(count)
        return out
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: not a list of [channel, population, sample, z, count] releases") from e
