"""What a round releases and whom it samples, against values worked out by hand: the tests that kill `make mutation`'s
mutants of fedccrl_core/federation/sampling.py (Algorithm 1's m = max(1, round(C N)) clients), of the pre-release
check in fedccrl_core/federation/round_privacy.py (`Private.planned_round`, the sizes of what left the clients), and
of FedCCRL's announced k_i (`StatisticsExchange.released_rows`, Eq. 8). Each case is one where a plausible slip
(floor for round or ceil, the smallest sampling ratio for the largest, k announced from floor(r n)) gives another
number."""

from __future__ import annotations

import numpy as np
import pytest

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.algorithms.fedccrl import StatisticsExchange
from fedccrl_core.federation import round_privacy as RP
from fedccrl_core.federation.sampling import sample_clients, sampled_count
from fedccrl_core.foundation.seeding import numpy_rng
from fedccrl_core.learning.clients import ClientData

PRIV = {"enabled": True, "stats_noise_multiplier": 2.0, "weights_noise_multiplier": 4.0}


# ---- Algorithm 1: m = max(1, round(C N)) -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("clients", "fraction", "m"),
    [
        (3, 0.5, 2),  # round(1.5) = 2: floor would give 1
        (5, 0.5, 2),  # round(2.5) = 2 (half to even): ceil would give 3
        (10, 0.34, 3),  # round(3.4) = 3: ceil would give 4
        (10, 0.36, 4),  # round(3.6) = 4: floor would give 3
        (4, 0.1, 1),  # round(0.4) = 0, at least one client
        (7, 1.0, 7),
    ],
)
def test_sampled_count_rounds_c_times_n_to_the_nearest_and_keeps_one(clients, fraction, m):
    assert sampled_count(clients, fraction) == m


def test_sample_clients_draws_m_distinct_clients_in_id_order_from_the_seed_or_the_given_generator():
    ids = [f"c{i}" for i in range(10)]
    a = sample_clients(ids, 0.36, seed=7, rnd=3)
    assert len(a) == 4 == len(set(a)) and a == sorted(a, key=ids.index)
    assert a == sample_clients(ids, 0.36, seed=7, rnd=3)  # the run seed's draw: the same every time
    stream = numpy_rng(7, "sample", 3)  # the stream both engines derive the round's sample from (seeding.py)
    assert a == [ids[i] for i in sorted(stream.choice(10, size=4, replace=False))]
    draws = {tuple(sample_clients(ids, 0.36, seed=7, rnd=r)) for r in range(1, 9)}
    assert len(draws) > 1  # each round its own draw
    rng = np.random.default_rng(123)
    idx = sorted(np.random.default_rng(123).choice(10, size=4, replace=False))
    assert sample_clients(ids, 0.36, seed=7, rnd=3, rng=rng) == [ids[i] for i in idx]  # the caller's generator
    assert sample_clients(ids, 1.0, seed=7, rnd=3) == ids  # every client: no draw
    assert sample_clients(["x", "y"], 0.1, seed=0, rnd=1) in (["x"], ["y"])


# ---- Eq. 8: the k_i a client announces is the k_i it uploads ----------------------------------------------------
def _client(n: int) -> ClientData:
    x = np.zeros((n, 8, 8, 3), np.uint8)
    y = np.zeros(n, np.int64)
    mu = np.arange(n * 6, dtype=np.float32).reshape(n, 6)
    return ClientData.from_numpy("a_c0", "a", x, y, x[:0], y[:0], "cpu", mu, np.ones_like(mu))


@pytest.mark.parametrize(("n", "r", "k"), [(11, 0.1, 2), (19, 0.1, 2), (20, 0.1, 2), (21, 0.1, 3), (7, 0.5, 4)])
def test_fedccrl_announces_ceil_r_n_rows_and_uploads_exactly_that_many(n, r, k):
    """Eq. 8's ceil(r n_i): at n = 11, r = 0.1 the floor would announce 1 row while 2 leave the client."""
    alg = build_algorithm("fedccrl", LocalConfig(rounds=1), {"r": r})
    assert alg.released_rows(n) == k
    upload = alg.client_upload(_client(n), np.random.default_rng(0))
    assert len(upload["mu"]) == len(upload["sigma"]) == k == StatisticsExchange.upload_rows(upload)


@pytest.mark.parametrize(("n", "k"), [(11, 1), (21, 2), (29, 2)])
def test_the_reference_codes_floor_announces_and_uploads_floor_r_n_rows(n, k):
    """upload: floor_unbiased, the reference code's int(n r): at n = 29 the ceil would announce 3."""
    alg = build_algorithm("fedccrl", LocalConfig(rounds=1), {"r": 0.1, "upload": "floor_unbiased"})
    assert alg.released_rows(n) == k
    assert len(alg.client_upload(_client(n), np.random.default_rng(0))["mu"]) == k


def test_upload_rows_counts_statistics_uploads_only():
    assert StatisticsExchange.upload_rows({"mu": np.zeros((3, 6)), "sigma": np.zeros((3, 6))}) == 3
    assert StatisticsExchange.upload_rows({"g": np.zeros(3)}) is None
    assert StatisticsExchange.upload_rows(None) is None


def test_released_sizes_pair_each_statistics_upload_with_its_announced_n():
    uploads = {"a": {"mu": np.zeros((2, 6))}, "b": {"g": np.zeros(4)}, "c": {"mu": np.zeros((5, 6))}}
    assert RP.released_rows(uploads) == {"a": 2, "c": 5}
    assert RP.released_sizes(uploads, {"a": 11, "b": 40, "c": 50}) == {"a": (11, 2), "c": (50, 5)}

    asked: list[list[str]] = []

    class Announced:
        def announced_n(self, sampled):
            asked.append(list(sampled))
            return {cid: {"a": 11, "c": 50}[cid] for cid in sampled}

    assert RP.upload_sizes(uploads, Announced()) == {"a": (11, 2), "c": (50, 5)}
    assert asked == [["a", "c"]]
    assert RP.upload_sizes({"b": {"g": np.zeros(4)}}, Announced()) == {}


# ---- the pre-release check: the worst case over who may answer ----------------------------------------------------
class Known:
    """A transport that knows the clients' announced sizes (None: not known yet) and its least number of clients."""

    def __init__(self, known: dict, least: int):
        self.known, self.least = known, least

    def known_n(self):
        return dict(self.known)

    def least_clients(self):
        return self.least


def _private(known: dict, least: int, fraction: float, algorithm: str = "fedccrl", priv=PRIV) -> RP.Private:
    alg = build_algorithm(algorithm, LocalConfig(rounds=2, privacy=priv), {"r": 0.1} if algorithm == "fedccrl" else {})
    acc = RP.accounting_of(alg, Known(known, least), 0, fraction, lambda m: None)
    assert isinstance(acc, RP.Private)
    return acc


def test_planned_round_charges_the_largest_sampling_ratio_between_least_and_all_clients():
    """C = 0.5 over N = 2..5 answering clients: m = 1, 2, 2, 2, ratios 1/2, 2/3, 1/2, 2/5; the worst case is 3 of 3
    answering with 2 sampled, neither the smallest ratio (2 of 5) nor all clients (5)."""
    known = {"a": 11, "b": 20, "c": 21, "d": 30, "e": 40}
    sizes, clients, sampled = _private(known, 2, 0.5).planned_round()
    assert (clients, sampled) == (3, 2)
    assert sizes == {"a": (11, 2), "b": (20, 2), "c": (21, 3), "d": (30, 3), "e": (40, 4)}  # ceil(0.1 n)


def test_planned_round_prefers_more_clients_at_an_equal_ratio_and_never_fewer_than_one():
    """C = 1: every N has ratio 1, the tie goes to the most clients; least 0 is read as 1."""
    _, clients, sampled = _private({"a": 5, "b": 6, "c": 7}, 0, 1.0).planned_round()
    assert (clients, sampled) == (3, 3)
    _, clients, sampled = _private({"a": 5, "b": 6, "c": 7, "d": 8}, 9, 0.25).planned_round()
    assert (clients, sampled) == (4, 1)  # least above the known clients: all of them


def test_planned_round_charges_a_client_of_unknown_size_as_releasing_every_row():
    sizes, _, _ = _private({"a": 11, "late": None}, 1, 1.0).planned_round()
    assert sizes == {"a": (11, 2), "late": (1, 1)}


def test_planned_round_without_statistics_or_clients():
    sizes, clients, sampled = _private({"a": 11, "b": 12}, 1, 0.5, algorithm="fedavg").planned_round()
    assert sizes == {} and (clients, sampled) == (1, 1)  # least 1: one client answering, sampled, ratio 1 > 1/2
    assert _private({}, 1, 0.5).planned_round() == ({}, 0, 0)


def test_before_round_hands_on_the_statistics_release_it_charged_under_max_epsilon():
    """Private.before_round: under max_epsilon, the (n_i, k_i) of the largest ratio it charged (what the QUERY
    carries, privacy/charged.py); None without max_epsilon, without statistics, or with no client known."""
    from fedccrl_core.privacy.charged import ChargedRelease

    limited = {**PRIV, "max_epsilon": 1e6}
    known = {"a": 216, "b": 11, "c": 40}  # k = 22, 2, 4: b's 2/11 is the largest ratio
    assert _private(known, 1, 1.0, priv=limited).before_round(2) == ChargedRelease(11, 2)
    assert _private({"a": 216, "late": None}, 1, 1.0, priv=limited).before_round(2) == ChargedRelease(1, 1)
    assert _private(known, 1, 1.0).before_round(2) is None  # no max_epsilon: the check charges nothing
    assert _private(known, 1, 1.0, "fedavg", limited).before_round(2) is None  # no statistics released
    assert _private({}, 1, 1.0, priv=limited).before_round(1) is None
