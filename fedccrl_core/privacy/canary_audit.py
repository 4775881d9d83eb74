"""`fedccrl audit`'s test of the DP claim on the statistics the engine uploaded: canaries, the attacks, the guesses,
and the epsilon lower bound they support. Floor 1 of fedccrl_core: numpy, scipy (no torch: `fedccrl --help` imports
it).

The test. Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS 2023 (arXiv:2305.08846):
m canary slots, each holding one of two rows chosen by an independent fair coin S_i; the auditor sees only the
release, guesses S_i on r slots fixed in number before the release (abstaining on the rest), and counts the correct
guesses v. If the release is (eps, delta)-DP with respect to each slot, v is dominated by Binomial(r, e^eps /
(1 + e^eps)) up to a delta term (their Thm. 3.1 and its (eps, delta) version): `one_run_p_value`. The epsilon lower
bound is the largest eps whose p-value is below ALPHA (`epsilon_lower_bound`); the audit fails the DP claim when it
exceeds the claimed eps (the same event as "p-value at the claimed eps < ALPHA": the p-value grows with eps). Its
reach, the bound that r correct guesses of r would give, is the most this audit's size can refute. This bound, not
the Clopper-Pearson bound on FPR and FNR of Jagielski et al. 2020 / Nasr et al. 2021, because the m slots share one
release and are not independent trials, which the latter needs. One slot flipping its coin replaces one row by
another: the REPLACE_ONE relation of privacy/accountant.py, so the eps audited is the accountant's own.

The canaries (`make_canaries`). Each client holds C slots (C channels) and fillers; every row is a corner of the
clipping box pushed OUTSIDE it: per coordinate, a bit says which face (mu: lo - L or hi + L; sigma: lo, or hi + L,
a std is never negative), L = OUTSIDE box diameters. The fillers sit at corner 0 (every bit 0); slot j's two rows at
the corners p_j = (mu bit j only, sigma every bit but j) and its complement. So every corner a client holds is a
distinct pattern, none is the fillers', each has C bits set, and the mu parts alone (e_j, not e_j) are distinct too.
The clients' sizes stay the run's (Eq. 8's k_i and the accountant's events with them): the fillers fill each client
to n_i rows.

The attacks (chosen by train.privacy.stats_release, public, before the release):
  rows     a released row is read as a corner of the mu cube when each of its C mu coordinates lies within
           TAU box widths of a face or beyond it, weighted 1 on the faces and falling to 0 at the band's inner edge
           (`mu_corner`); slot j's score is the weight of the rows read as its plus corner's mu part minus that of
           the rows read as its minus corner's. Intact, the first clip puts every row on a corner of the box, and
           the noise z_s D (D the box's diameter, about 1.8 mu widths at z_s = 1) hides which; a smaller noise
           reveals it (z_s = 0.1: a row reaches another corner's band with probability ~1e-5 per coordinate);
           without the first clip a canary L outside lands on its own faces exactly, at any noise that the second
           clip (post-processing) cannot hide.
  moments  per client and round, the set of coordinates on which the k released rows differ (`spread_pattern`):
           the fillers' rows are one point, so without noise on the sums the rows drawn from (mean, variance) vary
           exactly on the coordinates where the sampled canary differs from the fillers, its C-bit pattern; two
           canaries in one sample give more than C bits and are skipped. Noised sums make every coordinate vary.
The guesses: the r slots of largest |score|, by its sign; r = GUESS_SHARE of the slots expected to be released at
least once, from the sizes alone (`planned_guesses`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedccrl_core.privacy.settings import PrivacySettings

GUESS_SHARE = 0.6  # r = this share of the slots expected to be released at least once (fixed before the release)
ALPHA = 0.05  # the test's level: the DP claim fails when the eps lower bound at this level exceeds the claimed eps
OUTSIDE = 10.0  # L: a canary lies this many box diameters beyond its faces (a clip that is skipped shows)
TAU = 0.2  # the rows attack reads a coordinate as on a face within this share of the box's width
SPREAD = 1e-3  # the moments attack: rows differ on a coordinate when they spread over this share of its width
CONFIDENCE = 0.95  # of the Clopper-Pearson intervals
COPIES = 100  # the audit's clients: this many copies of the federation's clients (same sizes), each with canaries


def box(privacy: PrivacySettings, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) per coordinate (mu_1..C, sigma_1..C) of train.privacy's clipping box (its defaults when off)."""
    lo = np.r_[[privacy.stats_mu_range[0]] * channels, [privacy.stats_sigma_range[0]] * channels]
    hi = np.r_[[privacy.stats_mu_range[1]] * channels, [privacy.stats_sigma_range[1]] * channels]
    return lo.astype(np.float64), hi.astype(np.float64)


def slot_patterns(channels: int) -> np.ndarray:
    """[C, 2, 2C] bool: slot j's plus corner (mu bit j, sigma every bit but j) and minus corner (its complement)."""
    eye = np.eye(channels, dtype=bool)
    plus = np.concatenate([eye, ~eye], axis=1)
    return np.stack([plus, ~plus], axis=1)


@dataclass
class Canaries:
    """Client `client[i]` holds slot i's plus row when `coin[i]`, else its minus row; `slot[i]` is its index j of
    `slot_patterns`. `rows_of` gives a client's rows: its slots' held rows, then fillers up to its size."""

    client: np.ndarray  # [m] client ids
    slot: np.ndarray  # [m] j in 0..C-1
    coin: np.ndarray  # [m] bool: S_i = +1
    lo: np.ndarray  # [2C] the clipping box
    hi: np.ndarray
    sizes: dict[str, int]  # n_i: the client's rows, slots and fillers

    def point(self, bits: np.ndarray) -> np.ndarray:
        """The row at a corner pattern [.., 2C] (bool), pushed outside the box (sigma's low side on its face)."""
        c = bits.shape[-1] // 2
        reach = OUTSIDE * float(np.linalg.norm(self.hi - self.lo))
        low = np.r_[self.lo[:c] - reach, self.lo[c:]]
        return np.where(bits, self.hi + reach, low).astype(np.float32)

    def rows_of(self, client_id: str) -> np.ndarray:
        at = self.client == client_id
        pats = slot_patterns(len(self.lo) // 2)
        held = pats[self.slot[at], np.where(self.coin[at], 0, 1)]
        fill = np.zeros((self.sizes[client_id] - int(at.sum()), len(self.lo)), bool)
        return self.point(np.concatenate([held, fill]))


def make_canaries(sizes: dict[str, int], channels: int, privacy: PrivacySettings, rng: np.random.Generator) -> Canaries:
    """C slots per client (the module's docstring), their coins fair and independent from `rng` (the auditor's)."""
    if channels < 2:
        raise ValueError(f"audit: the canaries need at least 2 channels, got {channels}")
    small = sorted(cid for cid, n in sizes.items() if n <= channels)
    if small:
        raise ValueError(f"audit: clients {', '.join(small)} hold {channels} images or fewer: no room for fillers")
    ids = np.concatenate([[cid] * channels for cid in sizes]).astype(str)
    lo, hi = box(privacy, channels)
    slot = np.tile(np.arange(channels), len(sizes))
    return Canaries(ids, slot, rng.random(len(ids)) < 0.5, lo, hi, dict(sizes))


# ---------------------------------------------------------------- the attacks
def mu_corner(rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, (its mu corner as an int, bit j: mu_j read on the high face; -1 where a mu coordinate lies more than
    TAU widths inside both faces) and its weight, 1 - (the largest inward distance from the corner's faces, in TAU
    widths): 1 on or beyond the faces, towards 0 at the band's inner edge."""
    c = rows.shape[1] // 2
    mu, width = rows[:, :c], TAU * (hi[:c] - lo[:c])
    inward = np.minimum(np.maximum(mu - lo[:c], 0.0), np.maximum(hi[:c] - mu, 0.0))  # to the nearer face
    high = hi[:c] - mu < mu - lo[:c]
    code = (high * (1 << np.arange(c))).sum(axis=1)
    weight = 1.0 - (inward / width).max(axis=1)
    return np.where(weight > 0, code, -1), np.maximum(weight, 0.0)


def spread_pattern(rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """[2C] bool: the coordinates on which one round's released rows differ (more than SPREAD widths)."""
    return (rows.max(axis=0) - rows.min(axis=0)) > SPREAD * (hi - lo)


def rows_scores(canaries: Canaries, released: dict[str, list[np.ndarray]]) -> np.ndarray:
    """Per slot: the weights of the rows read as its plus corner's mu part minus those read as its minus corner's,
    over all rounds (`mu_corner`)."""
    c = len(canaries.lo) // 2
    pats = slot_patterns(c)[:, :, :c]  # [C, 2, C] mu parts
    codes = (pats * (1 << np.arange(c))).sum(axis=2)  # [C, 2]
    out = np.zeros(len(canaries.client))
    for cid, rounds in released.items():
        at = np.flatnonzero(canaries.client == cid)
        if not len(at) or not rounds:
            continue
        code, weight = mu_corner(np.concatenate(rounds), canaries.lo, canaries.hi)
        seen = np.bincount(code + 1, weights=weight, minlength=(1 << c) + 1)
        j = canaries.slot[at]
        out[at] = seen[codes[j, 0] + 1] - seen[codes[j, 1] + 1]
    return out


def moments_scores(canaries: Canaries, released: dict[str, list[np.ndarray]]) -> np.ndarray:
    """Per slot: rounds whose spread pattern is its plus corner minus rounds whose pattern is its minus corner."""
    pats = slot_patterns(len(canaries.lo) // 2)
    out = np.zeros(len(canaries.client))
    for cid, rounds in released.items():
        at = np.flatnonzero(canaries.client == cid)
        j = canaries.slot[at]
        for rows in rounds:
            hit = (pats == spread_pattern(rows, canaries.lo, canaries.hi)).all(axis=2)  # [C, 2]
            out[at] += hit[j, 0].astype(float) - hit[j, 1]
    return out


def attack_of(privacy: PrivacySettings) -> str:
    """The attack for the release train.privacy configures (public, fixed before the release)."""
    return "moments" if privacy.on_statistics and privacy.stats_release == "moments" else "rows"


def canary_scores(canaries: Canaries, released: dict[str, list[np.ndarray]], attack: str) -> np.ndarray:
    """Per slot, the attack's score (positive: plus looks held); `released`: {client id: its rows per round}."""
    return (moments_scores if attack == "moments" else rows_scores)(canaries, released)


def clopper_pearson(x: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Exact binomial interval (Clopper & Pearson 1934) from beta quantiles."""
    from scipy.stats import beta

    a = (1 - confidence) / 2
    lo = 0.0 if x == 0 else float(beta.ppf(a, x, n - x + 1))
    hi = 1.0 if x == n else float(beta.ppf(1 - a, x + 1, n - x))
    return lo, hi


# ---------------------------------------------------------------- guesses and the test
def planned_guesses(sizes: dict[str, tuple[int, int]], slots: dict[str, int], rounds: int) -> int:
    """r = GUESS_SHARE x the slots expected to be released at least once in `rounds` rounds, sum over clients of
    slots_i (1 - (1 - k_i / n_i)^T): from the sizes alone, fixed before the release as the theorem requires."""
    expected = sum(slots[cid] * (1 - (1 - k / n) ** rounds) for cid, (n, k) in sizes.items())
    return max(1, math.floor(GUESS_SHARE * expected))


def guess(scores: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
    """(slots guessed, their guesses: True = plus): the r slots of largest |score|, sign(score)."""
    order = np.argsort(-np.abs(scores), kind="stable")[:r]
    return order, scores[order] > 0


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P[v or more of r guesses correct] if the release is (eps, delta)-DP for each of the m slots (Steinke et al.
    2023, the (eps, delta) version of their Thm. 3.1):
        P[Bin(r, p) >= v] + 2 m delta max_{1<=i<=v} P[v > Bin(r, p) >= v - i] / i,   p = e^eps / (1 + e^eps)."""
    from scipy.stats import binom

    if not 0 <= v <= r <= m:
        raise ValueError(f"audit: need 0 <= correct ({v}) <= guesses ({r}) <= slots ({m})")
    if not math.isfinite(epsilon):
        return 1.0
    p = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(binom.sf(v - 1, r, p))
    if v == 0:
        return min(1.0, tail)
    below = np.cumsum(binom.pmf(v - np.arange(1, v + 1), r, p))  # P[v > Bin >= v - i], i = 1..v
    return min(1.0, tail + 2 * m * delta * float((below / np.arange(1, v + 1)).max()))


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, alpha: float = ALPHA) -> float:
    """The largest eps the guesses refute at level alpha (p-value below alpha; 0 when they refute none): the
    empirical lower bound of Steinke et al. 2023. The p-value grows with eps."""
    from scipy.optimize import brentq

    def f(eps: float) -> float:
        return one_run_p_value(m, r, v, eps, delta) - alpha

    if f(0.0) >= 0:
        return 0.0
    hi = 1.0
    while f(hi) < 0:
        hi *= 2
        if hi > 700:
            return float("inf")
    return float(brentq(f, 0.0, hi, xtol=1e-6))


@dataclass(frozen=True)
class OneRunAudit:
    """The one-run audit's statistics (`one_run_audit`), in the order results/audit.json lists them."""

    slots: int  # m
    guesses: int  # r
    correct: int  # v
    scored: int  # slots with a nonzero score
    precision: float  # v / r
    precision_lo: float  # its Clopper-Pearson 95 % interval
    precision_hi: float
    precision_bound: float  # the most (eps, delta)-DP allows on average: e^eps / (1 + e^eps)
    epsilon_statistics: float  # the claimed eps (the statistics channel's)
    delta: float
    p_value: float  # at the claimed eps
    alpha: float
    epsilon_lower_bound: float
    epsilon_reach: float  # the bound of r correct of r
    violated: bool  # lower bound > claimed eps
    testable: bool  # reach > claimed eps


@dataclass(frozen=True)
class CanaryAudit(OneRunAudit):
    """`fedccrl audit`'s record (results/audit.json): the statistics, then what was audited and the guesses'
    scores by coin. Written by pipeline/fedccrl_pipeline/audit.py `audit_clients`."""

    rounds: int
    attack: str  # `attack_of` the settings
    copies: int
    clients: int  # the federation's, before the copies
    slots_per_client: int  # C
    r: float  # Eq. 8's upload ratio
    upload: str  # train.fedccrl.upload
    seed: int
    guess_share: float
    noise: str  # the settings' noise source, or "off"
    privacy: dict | None  # train.privacy as audited (None: off)
    scores: list[float]
    coins: list[bool]

    def verdict(self) -> str:
        """No DP claim, DP violated (the eps lower bound exceeds the claim), beyond the audit's reach (r correct
        guesses of r would not refute the claim), or consistent."""
        if self.privacy is None:
            return "no DP claim"
        if self.violated:
            return "DP violated"
        return "consistent" if self.testable else "beyond reach"


def one_run_audit(coins: np.ndarray, scores: np.ndarray, r: int, epsilon: float, delta: float) -> OneRunAudit:
    """The audit's statistics: m slots, r guesses, v correct, the precision v / r with its Clopper-Pearson 95 %
    interval and the most that (eps, delta)-DP allows on average (e^eps / (1 + e^eps)), the p-value at the claimed
    eps, the eps lower bound the guesses support, the reach (the bound of r correct of r: the most this size
    refutes), and `violated` (lower bound > claimed eps) and `testable` (reach > claimed eps)."""
    m = len(scores)
    r = min(r, m)
    slots, said = guess(scores, r)
    v = int((said == coins[slots]).sum())
    lo, hi = clopper_pearson(v, r)
    lower = epsilon_lower_bound(m, r, v, delta)
    reach = epsilon_lower_bound(m, r, r, delta)
    return OneRunAudit(
        slots=m,
        guesses=r,
        correct=v,
        scored=int((scores != 0).sum()),
        precision=v / r,
        precision_lo=lo,
        precision_hi=hi,
        precision_bound=1.0 if not math.isfinite(epsilon) else 1.0 / (1.0 + math.exp(-epsilon)),
        epsilon_statistics=epsilon,
        delta=delta,
        p_value=one_run_p_value(m, r, v, epsilon, delta),
        alpha=ALPHA,
        epsilon_lower_bound=lower,
        epsilon_reach=reach,
        violated=bool(math.isfinite(epsilon) and lower > epsilon),
        testable=bool(reach > epsilon),
    )
