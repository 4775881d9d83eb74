"""What FedCCRL's statistics upload reveals (Eq. 8 and the paragraph after it), measured: a membership attack,
attribution of rows to their origin, and how both accumulate over the rounds. Floor 1: numpy, scipy, scikit-learn.

The attacker is the honest-but-curious server, or a client that receives F_pool (Alg. 1 line 7). It holds a
candidate image, computes its (mu, sigma) by Eq. 6-7 (6 numbers) and scores it by the distance to the nearest row
that the target client released so far. Members: the client's training images. Non-members: images of the same
domain that the client does not hold (the training images of the domain's other clients). The metrics are Carlini
et al.'s (S&P 2022, "Membership Inference Attacks From First Principles"): TPR at a low FPR, and AUC.

The released rows are drawn exactly as the engines draw them: numpy_rng(seed, "upload", round, client), Eq. 8's
ceil(r n_i) rows without replacement, then train.privacy's clipping and noise from the same generator when on.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedccrl_core.data.pools import sample_statistics
from fedccrl_core.privacy.dp import privatize
from fedccrl_core.privacy.settings import PrivacySettings
from fedccrl_core.seeding import numpy_rng

FPRS = (0.001, 0.01)


@dataclass
class Client:
    client_id: str
    domain: str
    mu: np.ndarray      # [n_i, C], every training image's Eq. 6
    sigma: np.ndarray   # [n_i, C], Eq. 7

    @property
    def rows(self) -> np.ndarray:
        return np.concatenate([self.mu, self.sigma], axis=1).astype(np.float64)


def release(c: Client, r: float, seed: int, rnd: int, privacy: PrivacySettings) -> tuple[np.ndarray, np.ndarray]:
    """(released rows [k, 2C], the indices of the images they came from) of client c in round rnd."""
    rng = numpy_rng(seed, "upload", rnd, c.client_id)
    idx = np.arange(len(c.mu))[:, None]
    chosen = sample_statistics(idx, idx, r, rng)[0][:, 0]  # Eq. 8's draw, as StatisticsExchange.client_upload
    mu, sigma = c.mu[chosen], c.sigma[chosen]
    if privacy.on_statistics:
        mu, sigma = privatize(mu, sigma, privacy, rng)
    return np.concatenate([mu, sigma], axis=1).astype(np.float64), chosen


def tpr_at_fpr(scores_in: np.ndarray, scores_out: np.ndarray, fpr: float) -> float:
    """The largest TPR at a threshold whose FPR is at most `fpr` (higher score = member)."""
    from sklearn.metrics import roc_curve

    y = np.r_[np.ones(len(scores_in)), np.zeros(len(scores_out))]
    f, t, _ = roc_curve(y, np.r_[scores_in, scores_out])
    return float(t[f <= fpr].max())


def auc(scores_in: np.ndarray, scores_out: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(np.r_[np.ones(len(scores_in)), np.zeros(len(scores_out))],
                               np.r_[scores_in, scores_out]))


def nearest_distance(candidates: np.ndarray, released: np.ndarray) -> np.ndarray:
    from scipy.spatial import cKDTree

    return cKDTree(released).query(candidates, k=1)[0]


def membership(clients: list[Client], released: dict[str, list[np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Scores (minus the nearest distance) of every client's members and same-domain non-members, pooled over
    the clients that have a same-domain peer."""
    ins, outs = [], []
    for c in clients:
        peers = [p for p in clients if p.domain == c.domain and p.client_id != c.client_id]
        if not peers or not released[c.client_id]:
            continue
        rel = np.concatenate(released[c.client_id])
        ins.append(-nearest_distance(c.rows, rel))
        outs.append(-nearest_distance(np.concatenate([p.rows for p in peers]), rel))
    if not ins:
        raise ValueError("audit: no client has a peer of its own domain (partition.clients_per_domain >= 2 "
                         "gives the non-members: images of the domain the client does not hold)")
    return np.concatenate(ins), np.concatenate(outs)


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


def audit(clients: list[Client], r: float, rounds: int, seed: int, privacy: PrivacySettings) -> dict:
    """One row per round: the released share (measured, and 1 - (1 - r)^t), membership TPR at FPR 0.1 % and
    1 % and AUC on what was released up to round t; attribution accuracy (domain, client) on round 1's rows."""
    released: dict[str, list[np.ndarray]] = {c.client_id: [] for c in clients}
    seen = {c.client_id: np.zeros(len(c.mu), bool) for c in clients}
    out = []
    for t in range(1, rounds + 1):
        for c in clients:
            rows, chosen = release(c, r, seed, t, privacy)
            released[c.client_id].append(rows)
            seen[c.client_id][chosen] = True
        s_in, s_out = membership(clients, released)
        n = sum(len(c.mu) for c in clients)
        rec = {"round": t, "released_share": float(sum(v.sum() for v in seen.values()) / n),
               "expected_share": 1 - (1 - r) ** t, "auc": auc(s_in, s_out),
               "members": int(len(s_in)), "non_members": int(len(s_out))}
        for f in FPRS:
            rec[f"tpr_at_fpr_{f:g}"] = tpr_at_fpr(s_in, s_out, f)
        out.append(rec)
    first = [(released[c.client_id][0], c) for c in clients]
    rows = np.concatenate([x for x, _ in first])
    dom_acc, dom_chance = attribution(rows, np.concatenate([[c.domain] * len(x) for x, c in first]), seed)
    cli_acc, cli_chance = attribution(rows, np.concatenate([[c.client_id] * len(x) for x, c in first]), seed)
    return {"rounds": out, "attribution": {"domain_accuracy": dom_acc, "domain_chance": dom_chance,
                                           "client_accuracy": cli_acc, "client_chance": cli_chance,
                                           "rows": int(len(rows))},
            "r": r, "seed": seed, "privacy": privacy.model_dump() if privacy.enabled else None}
