"""Privacy accounting for both channels, composed over the rounds, with dp_accounting's RDP accountant
(google/differential-privacy, the library Flower's `RdpAccountant` wraps).

Neighbouring relation REPLACE_ONE (one training image replaced; the clients' sizes are public). Per round:
  statistics  client i releases k_i = |F_i| (Eq. 8) of its n_i rows, drawn without replacement, each noised with
              std z_s D for sensitivity D: SampledWithoutReplacementDpEvent(n_i, k_i, Gaussian(z_s)) (Wang, Balle,
              Kasiviswanathan, AISTATS 2019, Thm. 27). An image belongs to one client, so the round's event is the
              client's with the largest k_i / n_i (the RDP of a sampled Gaussian grows with the sampling ratio).
  weights     m of the N clients are sampled without replacement (train.client_fraction); replacing one image
              (or a client's whole data) moves the mean of the clipped updates by at most 2 S / m, and the noise
              std is z S / m: SampledWithoutReplacementDpEvent(N, m, Gaussian(z / 2)).
Both are composed every round (ComposedDpEvent); RDP adds over events and rounds, and epsilon at `delta` is
the optimum over the RDP orders (Balle et al. 2020's conversion, dp_accounting.rdp.compute_epsilon). Both samples
(Eq. 8's rows, the round's clients) are drawn from the OS under DP (privacy/noise.py): the amplification assumes
the attacker does not know them. A channel that releases nothing (FedAvg's statistics) has no event.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from fedccrl_core.foundation import contract
from fedccrl_core.privacy.settings import BudgetExhausted, PrivacySettings

REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE


def sampled_gaussian(population: int, sample: int, noise_multiplier: float) -> dp_accounting.DpEvent:
    """A Gaussian mechanism on a uniform sample of `sample` out of `population`, without replacement."""
    if not 0 < sample <= population:
        raise ValueError(f"privacy accounting: a sample of {sample} out of {population}")
    gauss = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sample == population:
        return gauss
    return dp_accounting.SampledWithoutReplacementDpEvent(population, sample, gauss)


def worst_client(sizes: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """sizes: {client: (n_i, k_i)} of one round's uploads; the (n_i, k_i) with the largest sampling ratio."""
    return max(sizes.values(), key=lambda nk: (nk[1] / nk[0], -nk[0]))


def statistics_event(s: PrivacySettings, sizes: dict[str, tuple[int, int]]) -> dp_accounting.DpEvent:
    return sampled_gaussian(*worst_client(sizes), s.stats_noise_multiplier)


def weights_event(s: PrivacySettings, clients: int, sampled: int) -> dp_accounting.DpEvent:
    return sampled_gaussian(clients, sampled, s.weights_noise_multiplier / 2.0)


def epsilon_of(events: list[dp_accounting.DpEvent], delta: float, orders=None) -> float:
    """epsilon at delta of the composition of `events` (RDP accountant, REPLACE_ONE). A sampled Gaussian's RDP is
    also at most its Gaussian's without the sample (under REPLACE_ONE the sampled mechanism is a mixture of pairs
    that are equal or the Gaussian's pair, and Renyi divergence is jointly quasi-convex), so both compositions bound
    the run and epsilon is the smaller: it never falls when more is sampled, up to the whole population (whose
    event is the Gaussian itself), where Thm. 27's bound is loose."""
    eps = _composed_epsilon(events, delta, orders)
    unsampled = [e.event if isinstance(e, dp_accounting.SampledWithoutReplacementDpEvent) else e for e in events]
    if unsampled != list(events):
        eps = min(eps, _composed_epsilon(unsampled, delta, orders))
    return eps


def _composed_epsilon(events: list[dp_accounting.DpEvent], delta: float, orders=None) -> float:
    acc = (
        rdp.RdpAccountant(orders, neighboring_relation=REPLACE_ONE)
        if orders is not None
        else rdp.RdpAccountant(neighboring_relation=REPLACE_ONE)
    )
    counts: dict[dp_accounting.DpEvent, int] = {}
    for e in events:  # equal events (every round's, as a rule) are composed as one self-composition: computed once
        counts[e] = counts.get(e, 0) + 1
    if counts:
        acc.compose(
            dp_accounting.ComposedDpEvent(
                [dp_accounting.SelfComposedDpEvent(e, c) if c > 1 else e for e, c in counts.items()]
            )
        )
    return float(acc.get_epsilon(delta))


@dataclass
class Ledger:
    """The releases of a run so far, in order: ('statistics' | 'weights', round, event). epsilon() composes them;
    would_exceed() answers before a release whether it would take epsilon past max_epsilon."""

    settings: PrivacySettings
    releases: list[tuple[str, int, dp_accounting.DpEvent]] = field(default_factory=list)

    def record(self, channel: str, rnd: int, event: dp_accounting.DpEvent) -> None:
        self.releases.append((channel, rnd, event))

    def epsilon(self, extra: Sequence[dp_accounting.DpEvent] = (), channel: str | None = None) -> float:
        events = [e for c, _, e in self.releases if channel is None or c == channel]
        return epsilon_of(events + list(extra), self.settings.delta)

    def would_exceed(self, events: list[dp_accounting.DpEvent]) -> float | None:
        """The epsilon after `events` if it exceeds max_epsilon (0 = no limit), else None."""
        if not self.settings.max_epsilon:
            return None
        eps = self.epsilon(events)
        return eps if eps > self.settings.max_epsilon else None


STATISTICS, WEIGHTS = "statistics", "weights"


class RunPrivacy:
    """What the round loop asks of train.privacy, round by round (federation/loop.py):

    before_round(t, sizes, N, m)  before round t's first release: raise BudgetExhausted if its two events
                          together (the statistics uploads of `sizes` = {client: (n_i, k_i)} announced, and the
                          aggregate of m sampled out of N) would take epsilon past max_epsilon. A size not yet
                          announced (Flower's round 1) is charged as its upper bound: every row released (k = n),
                          every client sampled. A channel that releases nothing (no statistics uploads) is not charged.
    statistics(t, sizes)  the uploads' event, recorded.
    before_weights(t, N, m) / weights(t, N, m)  the aggregate's event, checked again with the clients that did
                          answer (before the aggregate is released), then recorded.
    record()              the round record's fields: epsilon so far, each channel alone, and 1 in
                          dp_seeded_noise when noise_seed seeded the noise (not private).
    The ledger is plain numbers (state() / load_state()): a resumed run goes on with the epsilon it had spent.
    keep(state()) is called at every release as it is charged (privacy/ledger_file.py writes the ledger file), so a
    release that no round checkpoint covers (a round interrupted after it) is still counted on resume; then
    on_release(release) (privacy/study_ledger.py appends it to the study's ledger, across runs). `ledger_id` names
    this run's ledger (a resume keeps it): a release is (ledger_id, its index in state()) wherever it is counted.
    """

    def __init__(self, settings: PrivacySettings, uploads: bool = True):
        self.s = settings
        self.uploads = uploads  # the algorithm uploads statistics rows: the statistics channel releases
        self.ledger = Ledger(settings)
        self._plain: list[tuple[str, int, int, int, float]] = []
        self.keep: Callable[[list], None] | None = None  # given state() at every release (the ledger file)
        self.on_release: Callable[[list], None] | None = None  # given each new release (the study ledger)
        # which ledger this is: a new one's own; a resumed run's, the ledger file's (ledger_file.py resume)
        self.ledger_id = secrets.token_hex(8)

    def _record(self, channel: str, rnd: int, population: int, sample: int, z: float) -> None:
        self.ledger.record(channel, rnd, sampled_gaussian(population, sample, z))
        self._plain.append((channel, rnd, population, sample, z))

    def _add(self, channel: str, rnd: int, population: int, sample: int, z: float) -> None:
        """A release, charged: recorded, then kept (on disk) before the run goes on."""
        self._record(channel, rnd, population, sample, z)
        if self.keep is not None:
            self.keep(self.state())
        if self.on_release is not None:
            self.on_release([channel, rnd, population, sample, z])

    def released_in(self, rnd: int) -> bool:
        """Whether round `rnd` released anything so far (its record, if it has one, covers it)."""
        return rnd in {r for _, r, *_ in self._plain}

    def _check(self, rnd: int, what: str, events: list[dp_accounting.DpEvent]) -> None:
        eps = self.ledger.would_exceed(events)
        if eps is not None:
            raise BudgetExhausted(
                f"privacy budget: round {rnd}'s {what} would bring epsilon to {eps:.3f} at delta "
                f"{self.s.delta:g}, above train.privacy.max_epsilon = {self.s.max_epsilon:g}; stopping before it. "
                f"epsilon spent (the ledger): {self.ledger.epsilon():.3f}"
            )

    def round_events(self, sizes: dict[str, tuple[int, int]], clients: int, sampled: int) -> list:
        """The events of a round as announced; sizes not announced charged as their upper bound."""
        events = []
        if self.uploads:
            events.append(
                statistics_event(self.s, sizes)
                if sizes
                else dp_accounting.GaussianDpEvent(self.s.stats_noise_multiplier)
            )
        events.append(
            weights_event(self.s, clients, sampled)
            if clients
            else dp_accounting.GaussianDpEvent(self.s.weights_noise_multiplier / 2.0)
        )
        return events

    def before_round(self, rnd: int, sizes: dict[str, tuple[int, int]], clients: int, sampled: int) -> None:
        self._check(
            rnd,
            "releases (statistics and weights)" if self.uploads else "weights release",
            self.round_events(sizes, clients, sampled),
        )

    def statistics(self, rnd: int, sizes: dict[str, tuple[int, int]]) -> None:
        if self.uploads and sizes:
            self._add(STATISTICS, rnd, *worst_client(sizes), self.s.stats_noise_multiplier)

    def before_weights(self, rnd: int, clients: int, sampled: int) -> None:
        self._check(rnd, "weights release", [weights_event(self.s, clients, sampled)])

    def weights(self, rnd: int, clients: int, sampled: int) -> None:
        self._add(WEIGHTS, rnd, clients, sampled, self.s.weights_noise_multiplier / 2.0)

    def record(self) -> dict[str, float]:
        out = {
            contract.DP_EPSILON: self.ledger.epsilon(),
            contract.DP_EPSILON_WEIGHTS: self.ledger.epsilon(channel=WEIGHTS),
        }
        if self.uploads:
            out[contract.DP_EPSILON_STATISTICS] = self.ledger.epsilon(channel=STATISTICS)
        if self.s.seeded:
            out[contract.DP_SEEDED_NOISE] = 1.0
        return out

    def state(self) -> list:
        return [list(x) for x in self._plain]

    def load_state(self, state: list | None) -> None:
        self.ledger, self._plain = Ledger(self.s), []
        for channel, rnd, population, sample, z in state or []:  # releases of the past: not kept again
            self._record(str(channel), int(rnd), int(population), int(sample), float(z))
