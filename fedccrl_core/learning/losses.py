"""FedCCRL's losses (fedccrl-v2.txt Sec. 3.4-3.6, Eq. 9-16).

Symbols: X, X^(1), X^(2) the original and the two augmented batches (Eq. 3); Z = h(X),
Z^(1), Z^(2) their representations (Eq. 4); Y_hat = g(Z), Y_hat^(1), Y_hat^(2) the
predictions (Eq. 5), passed here as LOGITS (the softmax is taken inside where a probability
is meant); Y the labels.

Departures and readings (each also in the function's docstring):
  * L_SC (Eq. 11) prints a SUM over the anchors i in I. We take the MEAN over anchors by
    default (``reduction="mean"``), as the authors' code does (``torch.mean`` over the 2B
    anchors) and as Khosla et al.'s SupCon loss does; lambda1 = 0.1 was tuned with the mean.
    ``reduction="sum"`` gives the printed form. P(i) EXCLUDES i, as Eq. 11 defines it
    (P(i) is a subset of A(i) = I minus i). Note: the authors' code counts i among its own
    positives (its same-label mask keeps the diagonal); we follow the paper.
  * L_CLS (Eq. 16) is the MEAN of the three cross-entropies (the 1/3 in Eq. 16). The
    authors' code SUMS them, which triples L_CLS relative to lambda1 L_RA and lambda2 L_JS; we
    follow the paper.
  * L_JS clamps Y_bar to [1e-7, 1] before the log, as AugMix's reference code does.
The reference code's two forms are offered as switches (params.yaml train.fedccrl.supcon and
l_cls), to reproduce the reference code's runs: ``supcon_self_positive_loss`` and ``three_view_ce(..., reduction="sum")``.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedccrl_core.foundation import contract


def supcon_loss(
    z_prime: torch.Tensor,
    z_dprime: torch.Tensor,
    y_prime: torch.Tensor,
    y_dprime: torch.Tensor,
    tau: float = 0.1,
    reduction: str = "mean",
) -> torch.Tensor:
    """Supervised contrastive loss L_SC(Z', Z'') (Eq. 9-11).

    Z = cat(Z', Z'') in R^{2B x V} (Eq. 9), Y = cat(Y', Y'') (Eq. 10), I = {1..2B},
    A(i) = I minus {i}, P(i) = {p in A(i) : y_p = y_i}, s(Z_i, Z_p) = exp(sim(Z_i, Z_p) / tau)
    with sim the cosine similarity, and

        L_SC = agg_{i in I} -1/|P(i)| sum_{p in P(i)} log(s(Z_i, Z_p) / sum_{a in A(i)} s(Z_i, Z_a))
                                                                                    (Eq. 11)

    agg is the mean over anchors (default; the reference code's choice) or the printed sum.
    Anchors with P(i) empty (impossible when both views of a sample are present) are skipped,
    and the mean is over the remaining anchors. Computed in float32 with log-sum-exp over A(i)
    (row max subtracted, diagonal masked).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    z = F.normalize(torch.cat([z_prime, z_dprime], dim=0).float(), dim=1)  # Eq. 9, unit rows
    y = torch.cat([y_prime, y_dprime], dim=0)  # Eq. 10
    n = z.shape[0]
    with torch.autocast(z.device.type, enabled=False):  # float32 even under bf16 autocast (fastpath.py)
        sim = z @ z.T / tau  # log s(Z_i, Z_a)
    not_self = ~torch.eye(n, dtype=torch.bool, device=z.device)  # A(i)
    log_denominator = torch.logsumexp(sim.masked_fill(~not_self, float("-inf")), dim=1, keepdim=True)
    log_ratio = sim - log_denominator  # log s(Z_i, Z_p) / sum_{a in A(i)} s(Z_i, Z_a)
    positive = (y[:, None] == y[None, :]) & not_self  # P(i)
    n_positive = positive.sum(dim=1)
    sum_positive = torch.where(positive, log_ratio, torch.zeros_like(log_ratio)).sum(dim=1)
    has_positive = n_positive > 0
    per_anchor = -sum_positive / n_positive.clamp_min(1)
    per_anchor = torch.where(has_positive, per_anchor, torch.zeros_like(per_anchor))
    if reduction == "sum":
        return per_anchor.sum()
    return per_anchor.sum() / has_positive.sum().clamp_min(1)


def supcon_self_positive_loss(
    z_prime: torch.Tensor,
    z_dprime: torch.Tensor,
    y_prime: torch.Tensor,
    y_dprime: torch.Tensor,
    tau: float = 0.1,
) -> torch.Tensor:
    """L_SC as the reference code computes it (SanphouWang/FedCCRL 60b2d9b,
    algorithm/client/fedccrl.py:130-146), not Eq. 11: the positive set is P(i) u {i} (the
    same-label mask keeps its diagonal), the denominator still runs over A(i), and the loss is the
    mean over all 2B anchors, computed as log(sum_a exp(sim) - exp(sim_ii)) with no max subtracted:

        L = 1/2B sum_i [ -1/|P(i) u {i}| sum_{p in P(i) u {i}} sim(Z_i, Z_p)/tau
                         + log sum_{a in A(i)} exp(sim(Z_i, Z_a)/tau) ]
    """
    z = F.normalize(torch.cat([z_prime, z_dprime], dim=0).float(), dim=1)
    y = torch.cat([y_prime, y_dprime], dim=0)
    with torch.autocast(z.device.type, enabled=False):
        sim = z @ z.T / tau
    positive = (y[:, None] == y[None, :]).float()  # diagonal kept: i is its own positive
    exp_sim = sim.exp()
    log_denominator = (exp_sim.sum(dim=1) - exp_sim.diagonal()).log()
    mean_positive = (sim * positive).sum(dim=1) / positive.sum(dim=1)
    return (log_denominator - mean_positive).mean()


SUPCON = {"paper": supcon_loss, "self_positive": supcon_self_positive_loss}  # train.fedccrl.supcon


def representation_alignment_loss(
    z: torch.Tensor,
    z1: torch.Tensor,
    z2: torch.Tensor,
    y: torch.Tensor,
    tau: float = 0.1,
    supcon: str = "paper",
) -> torch.Tensor:
    """L_RA = 1/2 (L_SC(Z^(1), Z) + L_SC(Z^(2), Z))  (Eq. 12); each view shares the labels Y.
    ``supcon``: "paper" (Eq. 11) or "self_positive" (the reference code's form)."""
    l_sc = SUPCON[supcon]
    return 0.5 * (l_sc(z1, z, y, y, tau) + l_sc(z2, z, y, y, tau))


def js_loss(logits: torch.Tensor, logits1: torch.Tensor, logits2: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon consistency L_JS (Eq. 13-14) over the softmax of the three predictions.

    Y_bar = 1/3 (Y_hat + Y_hat^(1) + Y_hat^(2))                               (Eq. 13)
    L_JS  = 1/3 (KL(Y_hat || Y_bar) + KL(Y_hat^(1) || Y_bar) + KL(Y_hat^(2) || Y_bar))   (Eq. 14)
    KL(P || Q) = sum_c P_c (log P_c - log Q_c), averaged over the batch; Y_bar is clamped to
    [1e-7, 1] before the log (AugMix).
    """
    log_p = [F.log_softmax(t.float(), dim=1) for t in (logits, logits1, logits2)]
    p = [lp.exp() for lp in log_p]
    log_y_bar = ((p[0] + p[1] + p[2]) / 3.0).clamp(1e-7, 1.0).log()  # Eq. 13
    kl = [(pv * (lpv - log_y_bar)).sum(dim=1).mean() for pv, lpv in zip(p, log_p)]
    return (kl[0] + kl[1] + kl[2]) / 3.0  # Eq. 14


def three_view_ce(
    logits: torch.Tensor,
    logits1: torch.Tensor,
    logits2: torch.Tensor,
    y: torch.Tensor,
    reduction: str = "mean",
) -> torch.Tensor:
    """L_CLS = sum_{Y' in {Y_hat, Y_hat^(1), Y_hat^(2)}} 1/3 L_CRE(Y', Y)  (Eq. 16).
    ``reduction="sum"`` drops the 1/3, as the reference code does (algorithm/client/fedccrl.py:76, :86)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    ce = [F.cross_entropy(view.float(), y) for view in (logits, logits1, logits2)]
    total = ce[0] + ce[1] + ce[2]
    return total / 3.0 if reduction == "mean" else total


def fedccrl_loss(
    logits: torch.Tensor,
    logits1: torch.Tensor,
    logits2: torch.Tensor,
    z: torch.Tensor,
    z1: torch.Tensor,
    z2: torch.Tensor,
    y: torch.Tensor,
    lambda1: float = 0.1,
    lambda2: float = 0.1,
    tau: float = 0.1,
    l_ra: bool = True,
    l_js: bool = True,
    l_cls: str = "mean",
    supcon: str = "paper",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """L = L_CLS + lambda1 L_RA + lambda2 L_JS  (Eq. 15).

    ``l_ra`` / ``l_js`` are the Table 2 ablation switches: a term that is off is neither
    computed nor reported (its key is absent from the dict, rather than a misleading 0).
    Returns (L, terms) where terms holds detached 0-dim tensors (contract.LOSS, L_CLS and
    L_RA / L_JS when on); convert them to floats only when logging, to keep the
    training step free of host syncs. ``l_cls`` ("mean" | "sum") and ``supcon`` ("paper" |
    "self_positive") choose the paper's or the reference code's form.
    """
    loss_cls = three_view_ce(logits, logits1, logits2, y, l_cls)
    total = loss_cls
    terms = {contract.L_CLS: loss_cls.detach()}
    if l_ra:
        loss_ra = representation_alignment_loss(z, z1, z2, y, tau, supcon)
        total = total + lambda1 * loss_ra
        terms[contract.L_RA] = loss_ra.detach()
    if l_js:
        loss_js = js_loss(logits, logits1, logits2)
        total = total + lambda2 * loss_js
        terms[contract.L_JS] = loss_js.detach()
    terms[contract.LOSS] = total.detach()
    return total, terms
