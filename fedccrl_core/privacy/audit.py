"""What FedCCRL's statistics upload reveals about real images (Eq. 8 and the paragraph after it): a measurement.
Floor 1: numpy, scipy, scikit-learn. `fedccrl audit`'s test of the DP claim is privacy/canary_audit.py.

The membership measurement of real images (`audit`, scripts/privacy_audit.py): membership attacks, attribution
of rows to their origin, and how both accumulate over the rounds, on a replay of the engine's draw (`release`).

The attacker is the honest-but-curious server, or a client that receives F_pool (Alg. 1 line 7). It holds a
candidate image and computes its (mu, sigma) by Eq. 6-7 (6 numbers). Members: the target client's training images.
Non-members: images of the same domain that the client does not hold (the training images of the domain's other
clients). Two scores of a candidate against the rows the target client released so far:
  nearest   minus the distance to the nearest released row (knows nothing of the mechanism);
  lr        the likelihood ratio of "member" against "not a member" under the mechanism as train.privacy runs it
            (privacy/dp.py, stats_release: rows): a released row is y = box(box(x) + N(0, s^2 I)), s = z_s D, so
            p(y | x) is, per coordinate, the Gaussian density where y lies inside the box and the Gaussian tail
            mass beyond a face where y lies on it. A member is one of round t's k released rows with probability
            q = k / n (Eq. 8's sample), so round t contributes log(1 - q + q mean_y p(y | x) / p_ref(y)), p_ref the
            density of a row of a random image of the domain (the mean of p(y | x') over a reference set of
            non-members, disjoint from the scored ones). The log-ratios add over the rounds (fresh draws).
Each client's members and non-members are split at random into a reference set (non-members only: p_ref),
a calibration set, on which the threshold at each target FPR is chosen, and an evaluation set, on which TPR and
FPR are reported with Clopper-Pearson 95 % intervals (Carlini et al., S&P 2022: TPR at a low FPR, and AUC).

With train.privacy.statistics on, the release's epsilon (the statistics channel alone, after t rounds, the
accountant of privacy/accountant.py on the clients' sizes) bounds any test: TPR <= e^eps FPR + delta. A TPR whose
interval lies wholly above e^eps times the upper end of the FPR's interval, plus delta, is a failure of the DP
claim (`violated`). The FPR's interval limits it: with the default data's 288 non-members its upper end is at
least 0.0127, so the bound is 1 from eps 4.36 on, and this part cannot fail the default run (eps 4.64); the
canary audit (privacy/canary_audit.py) can.

The released rows are drawn as the engines draw them: Eq. 8's ceil(r n_i) rows without replacement
(train.fedccrl.upload: floor_unbiased, floor(r n_i) rows with the unbiased std), from numpy_rng(seed, "upload",
round, client) without DP; with train.privacy.statistics on, the sample and the noise from the OS's entropy
(privacy/noise.py), as client_upload draws them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from fedccrl_core.data.pools import sample_statistics, unbiased_sigma, upload_size
from fedccrl_core.foundation.seeding import numpy_rng
from fedccrl_core.privacy.canary_audit import clopper_pearson
from fedccrl_core.privacy.dp import clip_rows, privatize, stats_noise_std
from fedccrl_core.privacy.noise import private_rng
from fedccrl_core.privacy.settings import PrivacySettings

FPRS = (0.001, 0.01)
ATTACKS = ("nearest", "lr")
UPLOADS = {"ceil": "ceil", "floor_unbiased": "floor"}  # train.fedccrl.upload -> Eq. 8's rounding


@dataclass
class Client:
    client_id: str
    domain: str
    mu: np.ndarray  # [n_i, C], every training image's Eq. 6
    sigma: np.ndarray  # [n_i, C], Eq. 7
    hw: int = 0  # pixels per image (H W): the unbiased std of upload floor_unbiased

    @property
    def rows(self) -> np.ndarray:
        return np.concatenate([self.mu, self.sigma], axis=1).astype(np.float64)

    def uploaded_sigma(self, upload: str) -> np.ndarray:
        """sigma as the upload sends it: Eq. 7's, or the unbiased std (upload floor_unbiased)."""
        if upload == "ceil":
            return self.sigma
        if self.hw < 2:
            raise ValueError(f"audit: upload floor_unbiased needs the images' size (client {self.client_id})")
        return unbiased_sigma(self.sigma, self.hw)

    def candidate_rows(self, upload: str) -> np.ndarray:
        """The rows the attacker computes of this client's images, as the upload would send them."""
        return np.concatenate([self.mu, self.uploaded_sigma(upload)], axis=1).astype(np.float64)


def release(
    c: Client, r: float, seed: int, rnd: int, privacy: PrivacySettings, upload: str = "ceil"
) -> tuple[np.ndarray, np.ndarray]:
    """(released rows [k, 2C], the indices of the images they came from) of client c in round rnd."""
    if upload not in UPLOADS:
        raise ValueError(f"audit: train.fedccrl.upload must be one of {', '.join(UPLOADS)}, got {upload!r}")
    rng = (
        private_rng(privacy, "audit", rnd, c.client_id)
        if privacy.on_statistics
        else numpy_rng(seed, "upload", rnd, c.client_id)
    )
    idx = np.arange(len(c.mu))[:, None]
    chosen = sample_statistics(idx, idx, r, rng, rounding=UPLOADS[upload])[0][:, 0]  # Eq. 8's draw
    mu, sigma = c.mu[chosen], c.uploaded_sigma(upload)[chosen]
    if privacy.on_statistics:
        mu, sigma = privatize(mu, sigma, privacy, rng)
    return np.concatenate([mu, sigma], axis=1).astype(np.float64), chosen


# ---------------------------------------------------------------- scores
def nearest_distance(candidates: np.ndarray, released: np.ndarray) -> np.ndarray:
    from scipy.spatial import cKDTree

    return cKDTree(released).query(candidates, k=1)[0]


def row_log_likelihood(
    released: np.ndarray, candidates: np.ndarray, privacy: PrivacySettings, std: np.ndarray | float | None = None
) -> np.ndarray:
    """log p(y | x) [candidates, released] of the rows mechanism: y = box(box(x) + N(0, s^2 I)) per coordinate
    (s = z_s D, or `std` per coordinate)."""
    from scipy.stats import norm

    c = len(candidates[0]) // 2
    cmu, csig = clip_rows(candidates[:, :c], candidates[:, c:], privacy)
    x = np.concatenate([cmu, csig], axis=1)[:, None, :]  # [m, 1, 2C]
    y = released[None, :, :]  # [1, k, 2C]
    lo = np.r_[[privacy.stats_mu_range[0]] * c, [privacy.stats_sigma_range[0]] * c]
    hi = np.r_[[privacy.stats_mu_range[1]] * c, [privacy.stats_sigma_range[1]] * c]
    s = np.broadcast_to(np.asarray(stats_noise_std(privacy, c) if std is None else std, np.float64), lo.shape)
    at_lo = y <= lo + 1e-6 * np.maximum(1.0, np.abs(lo))  # on a face, float32 on the wire
    at_hi = y >= hi - 1e-6 * np.maximum(1.0, np.abs(hi))
    inside = norm.logpdf((y - x) / s) - np.log(s)
    ll = np.where(at_lo, norm.logcdf((lo - x) / s), np.where(at_hi, norm.logsf((hi - x) / s), inside))
    return ll.sum(axis=2)


def reference_std(reference: np.ndarray, privacy: PrivacySettings) -> np.ndarray:
    """Per coordinate, the std of a released row of a random image of the domain, as the attacker models it: the
    noise (z_s D) and a kernel of Scott's width over the reference rows, h_j = n^(-1 / (d + 4)) std_j (the
    reference set is a sample of the domain, not the domain: without h the model is n spikes)."""
    n, d = reference.shape
    h = n ** (-1.0 / (d + 4)) * reference.std(axis=0)
    return np.sqrt(stats_noise_std(privacy, d // 2) ** 2 + h**2)


def lr_round(
    released: np.ndarray, candidates: np.ndarray, reference: np.ndarray, q: float, privacy: PrivacySettings
) -> np.ndarray:
    """One round's log(1 - q + q mean_y p(y | x) / p_ref(y)) for every candidate x."""
    from scipy.special import logsumexp

    ref_ll = row_log_likelihood(released, reference, privacy, reference_std(reference, privacy))
    log_ref = logsumexp(ref_ll, axis=0) - math.log(len(reference))
    log_ratio = logsumexp(row_log_likelihood(released, candidates, privacy) - log_ref[None, :], axis=1) - math.log(
        len(released)
    )
    return np.logaddexp(math.log1p(-q), math.log(q) + log_ratio) if q < 1 else log_ratio


# ---------------------------------------------------------------- thresholds, rates and their intervals
def threshold_at_fpr(calibration_out: np.ndarray, fpr: float) -> float:
    """The threshold (member if score > it) that lets at most floor(fpr n) calibration non-members through."""
    ranked = np.sort(calibration_out)[::-1]
    return float(ranked[min(math.floor(fpr * len(ranked)), len(ranked) - 1)])


@dataclass(frozen=True)
class Rates:
    """TPR and FPR at one threshold, each with its Clopper-Pearson interval (in a round's record: `<attack>/<name>@
    <fpr>`)."""

    tpr: float
    tpr_lo: float
    tpr_hi: float
    fpr: float
    fpr_lo: float
    fpr_hi: float


def rates(s_in: np.ndarray, s_out: np.ndarray, threshold: float) -> Rates:
    tp, fp = int((s_in > threshold).sum()), int((s_out > threshold).sum())
    (tl, th), (fl, fh) = clopper_pearson(tp, len(s_in)), clopper_pearson(fp, len(s_out))
    return Rates(tp / len(s_in), tl, th, fp / len(s_out), fl, fh)


def tpr_at_fpr(scores_in: np.ndarray, scores_out: np.ndarray, fpr: float) -> float:
    """The largest TPR at a threshold whose FPR is at most `fpr` on these same scores (higher = member): the
    optimistic reading of the ROC; the audit reports `rates` at a threshold from a separate calibration split."""
    from sklearn.metrics import roc_curve

    y = np.r_[np.ones(len(scores_in)), np.zeros(len(scores_out))]
    f, t, _ = roc_curve(y, np.r_[scores_in, scores_out])
    return float(t[f <= fpr].max())


def auc(scores_in: np.ndarray, scores_out: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(np.r_[np.ones(len(scores_in)), np.zeros(len(scores_out))], np.r_[scores_in, scores_out]))


def bound(epsilon: float, fpr: float, delta: float) -> float:
    """The largest TPR (epsilon, delta)-DP allows at false-positive rate fpr."""
    if not math.isfinite(epsilon) or epsilon > 700:  # e^eps past float range: no bound below 1
        return 1.0
    return min(1.0, math.exp(epsilon) * fpr + delta)


# ---------------------------------------------------------------- the attack
@dataclass
class Split:
    """One client's candidates: indices into its own rows (members) and into its peers' rows (non-members)."""

    client: Client
    peers: np.ndarray  # [p, 2C] the non-members' rows
    ref: np.ndarray  # indices into peers: the reference set of p_ref
    cal_in: np.ndarray
    cal_out: np.ndarray
    ev_in: np.ndarray
    ev_out: np.ndarray


def splits(clients: list[Client], seed: int, upload: str) -> list[Split]:
    rng = np.random.default_rng([seed, 42])  # the auditor's split, not a privacy draw
    out = []
    for c in clients:
        peers = [p for p in clients if p.domain == c.domain and p.client_id != c.client_id]
        if not peers:
            continue
        prow = np.concatenate([p.candidate_rows(upload) for p in peers])
        o, i = rng.permutation(len(prow)), rng.permutation(len(c.mu))
        third, half = len(o) // 3, len(i) // 2
        out.append(Split(c, prow, o[:third], i[:half], o[third : 2 * third], i[half:], o[2 * third :]))
    if not out:
        raise ValueError(
            "audit: no client has a peer of its own domain (partition.clients_per_domain >= 2 "
            "gives the non-members: images of the domain the client does not hold)"
        )
    return out


def scores(
    sp: Split, released: list[np.ndarray], q: float, privacy: PrivacySettings, upload: str, lr_sums: dict | None
) -> dict[str, tuple[np.ndarray, ...]]:
    """{attack: (cal_in, cal_out, ev_in, ev_out)} after the rounds in `released`; `lr_sums` carries the LR
    attack's running sums over the rounds (None: no LR attack)."""
    own = sp.client.candidate_rows(upload)
    sets = (own[sp.cal_in], sp.peers[sp.cal_out], own[sp.ev_in], sp.peers[sp.ev_out])
    rel = np.concatenate(released)
    nearest = tuple(-nearest_distance(x, rel) for x in sets)
    if lr_sums is None:
        return {"nearest": nearest}
    ref = sp.peers[sp.ref]
    new = [lr_round(released[-1], x, ref, q, privacy) for x in sets]
    lr = tuple(a + b for a, b in zip(lr_sums.get(sp.client.client_id, (0, 0, 0, 0)), new))
    lr_sums[sp.client.client_id] = lr
    return {"nearest": nearest, "lr": lr}


def attribution(rows: np.ndarray, labels: np.ndarray, seed: int) -> tuple[float, float]:
    """5-fold cross-validated accuracy of a 5-nearest-neighbour classifier that names a released row's origin,
    and chance (the largest class's share)."""
    from sklearn.model_selection import StratifiedKFold, cross_val_score
    from sklearn.neighbors import KNeighborsClassifier

    _, counts = np.unique(labels, return_counts=True)
    folds = int(min(5, counts.min()))
    if folds < 2 or len(counts) < 2:
        return float("nan"), float(counts.max() / counts.sum())
    cv = StratifiedKFold(folds, shuffle=True, random_state=seed)
    acc = cross_val_score(KNeighborsClassifier(5), rows, labels, cv=cv).mean()
    return float(acc), float(counts.max() / counts.sum())


def statistics_epsilon(clients: list[Client], r: float, rounds: int, privacy: PrivacySettings, upload: str) -> float:
    """The statistics channel's epsilon after `rounds` rounds (inf without DP on it)."""
    if not privacy.on_statistics:
        return float("inf")
    from fedccrl_core.privacy import accountant as A

    sizes = {c.client_id: (len(c.mu), upload_size(len(c.mu), r, UPLOADS[upload])) for c in clients}
    return A.epsilon_of([A.statistics_event(privacy, sizes)] * rounds, privacy.delta)


def _attack_fields(per: list[dict], eps: float, delta: float) -> dict:
    """One round's fields per attack: AUC, the evaluation split's sizes, and at each FPR the TPR and FPR with
    their intervals, the DP bound and whether the TPR's interval lies above it."""
    rec: dict = {}
    for attack in (a for a in ATTACKS if a in per[0]):
        _cal_in, cal_out, ev_in, ev_out = (np.concatenate([p[attack][j] for p in per]) for j in range(4))
        rec.update({f"{attack}/auc": auc(ev_in, ev_out), "members": len(ev_in), "non_members": len(ev_out)})
        for f in FPRS:
            got = rates(ev_in, ev_out, threshold_at_fpr(cal_out, f))
            top = bound(eps, got.fpr_hi, delta)
            fields = {**asdict(got), "bound": top, "violated": got.tpr_lo > top}
            rec.update({f"{attack}/{k}@{f:g}": v for k, v in fields.items()})
    return rec


def _attribution(clients: list[Client], released: dict[str, list[np.ndarray]], seed: int) -> dict:
    """How well round 1's released rows tell their domain and their client apart, against chance."""
    first = [(released[c.client_id][0], c) for c in clients]
    rows = np.concatenate([x for x, _ in first])
    dom_acc, dom_chance = attribution(rows, np.concatenate([[c.domain] * len(x) for x, c in first]), seed)
    cli_acc, cli_chance = attribution(rows, np.concatenate([[c.client_id] * len(x) for x, c in first]), seed)
    return {
        "domain_accuracy": dom_acc,
        "domain_chance": dom_chance,
        "client_accuracy": cli_acc,
        "client_chance": cli_chance,
        "rows": len(rows),
    }


def audit(
    clients: list[Client], r: float, rounds: int, seed: int, privacy: PrivacySettings, upload: str = "ceil"
) -> dict:
    """One record per round: the released share (measured, and 1 - (1 - r)^t), the statistics channel's epsilon,
    and per attack AUC and, at FPR 0.1 % and 1 %, the evaluation split's TPR and FPR with their intervals, the DP
    bound and whether the TPR's interval lies above it; attribution accuracy (domain, client) on round 1's rows.
    The LR attack runs when the rows mechanism is on (its model is that mechanism)."""
    sp = splits(clients, seed, upload)
    lr_on = privacy.on_statistics and privacy.stats_release == "rows"
    released: dict[str, list[np.ndarray]] = {c.client_id: [] for c in clients}
    seen = {c.client_id: np.zeros(len(c.mu), bool) for c in clients}
    lr_sums: dict = {}
    out = []
    for t in range(1, rounds + 1):
        for c in clients:
            rows, chosen = release(c, r, seed, t, privacy, upload)
            released[c.client_id].append(rows)
            seen[c.client_id][chosen] = True
        per = [
            scores(
                s,
                released[s.client.client_id],
                len(released[s.client.client_id][-1]) / len(s.client.mu),
                privacy,
                upload,
                lr_sums if lr_on else None,
            )
            for s in sp
        ]
        n = sum(len(c.mu) for c in clients)
        eps = statistics_epsilon(clients, r, t, privacy, upload)
        rec = {
            "round": t,
            "released_share": float(sum(v.sum() for v in seen.values()) / n),
            "expected_share": 1 - (1 - r) ** t,
            "epsilon_statistics": eps,
        }
        rec.update(_attack_fields(per, eps, privacy.delta))
        out.append(rec)
    return {
        "rounds": out,
        "attribution": _attribution(clients, released, seed),
        "violated": any(v for rec in out for k, v in rec.items() if "/violated@" in k and v),
        "r": r,
        "seed": seed,
        "upload": upload,
        "noise": privacy.noise_source(),
        "privacy": privacy.model_dump() if privacy.enabled else None,
    }
