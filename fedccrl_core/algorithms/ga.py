"""GA, Generalization Adjustment (Zhang et al., CVPR 2023, "Federated Domain Generalization with
Generalization Adjustment", FedDG-GA; code github.com/MediaBrain-SJTU/FedDG-GA), on top of FedAvg.

The server keeps aggregation weights a_i (a_i^1 = n_i / N, Eq. 2) and after each round moves them
toward the clients whose generalization gap is largest:
    G_i      = L(theta^{r+1}; D_i) - L(theta_i^r; D_i)      global model's loss minus local model's loss
    a_i     <- a_i + d^r * (G_i - mean_j G_j) / max_j |G_j - mean_j G_j|
    a       <- clip(a, 0, 1) / sum(clip(a, 0, 1))
    d^r      = (d / K) * (1 - (r - 1) / R)                   linear decay over the R rounds
theta^{r+1} = sum_i a_i theta_i^r.

Readings and departures:
- Timing as in the reference (algorithms/fedavg/train_pacs_GA.py, utils/weight_adjust.py): the gap of round r pairs
  the local model theta_i^r with the *aggregated* model theta^{r+1}, and the adjusted weights are
  used from the next aggregation on. Here client i evaluates the received theta^{r+1} at the start
  of round r+1 and reports G_i with the loss of its own theta_i^r, which it kept in ClientState.extra;
  the server adjusts a before aggregating round r+1. Round 1 has no gap and aggregates with n_i / N.
- The losses are mean cross-entropy in eval mode on the client's validation split (the reference
  evaluates on each site's val loader), or on its train split with `gap_data: train` (or when a
  client has no validation data).
- The reference scales the step by a hard-coded 1/3 (its K = 3 source sites, the initial weight
  1/K); here 1/K with K the number of clients in the round. The gaps are centered by their mean
  as in the FedCCRL reference's GA (the GA reference divides the raw gaps by their max magnitude).
- Initial weights n_i / N as in the FedCCRL reference's GA (the GA reference starts from 1/K).


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedccrl_core.algorithm_params.ga import GAParams
from fedccrl_core.algorithms.base import Algorithm, KeptState, cross_entropy_step
from fedccrl_core.learning.aggregation import weighted_average
from fedccrl_core.learning.clients import ClientData
from fedccrl_core.learning.statistics import normalize_u8

# the client's reply metrics: L(theta^r; D_i), L(theta_i^r; D_i), and G_i (from round 2), which the server reads
LOSS_GLOBAL, LOSS_LOCAL, GAP = "ga_loss_global", "ga_loss_local", "ga_gap"


@dataclass
class GAKept(KeptState):
    """What a client keeps across rounds: L(theta_i^r; D_i) after its last local training, for G_i."""

    ga_loss_local: float | None = None  # the saved key: the reply metric's name, LOSS_LOCAL


@dataclass
class GAScratch:
    """One client-round: the client's data (for its gap split) and L(theta^r; D_i), measured before training."""

    data: ClientData
    loss_global: float


def step_size(d: float, r: int, rounds: int, k: int) -> float:
    """d^r = (d / K) (1 - (r - 1) / R): linear decay from d / K in round 1 to d / (K R) in round R."""
    return d / k * (1.0 - (r - 1) / rounds)


def generalization_adjustment(a: dict[str, float], gaps: dict[str, float], d_r: float) -> dict[str, float]:
    """One GA update of the weights of the clients in `gaps`: step by the normalized centered gap, clip to
    [0, 1], renormalize (to their previous total, 1 when every client reports a gap)."""
    mass = sum(a[cid] for cid in gaps)
    mean_gap = sum(gaps.values()) / len(gaps)
    scale = max(abs(g - mean_gap) for g in gaps.values())
    new = {cid: a[cid] + (d_r * (gaps[cid] - mean_gap) / scale if scale > 0 else 0.0) for cid in gaps}
    clipped = {cid: min(max(w, 0.0), 1.0) for cid, w in new.items()}
    total = sum(clipped.values())
    if total <= 0:
        return {cid: mass / len(gaps) for cid in gaps}
    return {cid: mass * w / total for cid, w in clipped.items()}


class GA(Algorithm):
    name = "ga"
    Params = GAParams
    hp: GAParams
    pads_partial_batch = True  # its loss reads ctx.real_rows only (learning/static_batch.py)

    def __init__(self, local, hparams=None):
        super().__init__(local, hparams)
        self.a: dict[str, float] = {}  # aggregation weight a_i per client id
        self.round = 0  # rounds aggregated so far

    def server_state(self):
        return {"a": dict(self.a), "round": self.round}

    def load_server_state(self, state):
        self.a, self.round = dict(state.get("a", {})), int(state.get("round", 0))

    def train_step(self, model, x, y, ctx):
        return cross_entropy_step(model, x, y, ctx.real_rows)

    @torch.no_grad()
    def loss_on(self, model, data) -> float:
        """Mean cross-entropy of `model` (eval mode) on the client's gap split."""
        x_u8, y = (
            (data.val_x, data.val_y) if self.hp.gap_data == "val" and len(data.val_y) else (data.train_x, data.train_y)
        )
        model.eval()
        total = sum(
            F.cross_entropy(
                model(normalize_u8(x_u8[i : i + 256], self.local.mean, self.local.std)), y[i : i + 256], reduction="sum"
            )
            for i in range(0, len(y), 256)
        )
        return float(total) / max(len(y), 1)

    # the local loop's hooks: the client measures its losses around local training (the gap G_i)
    def begin_local(self, model, data, state, ctx):
        ctx.state = GAScratch(data, self.loss_on(model, data))  # L(theta^r; D_i), theta^r = last aggregate
        ctx.metrics[LOSS_GLOBAL] = ctx.state.loss_global
        model.train()  # loss_on evaluated in eval mode

    def end_local(self, model, state, ctx):
        scratch: GAScratch = ctx.state
        loss_local = self.loss_on(model, scratch.data)  # L(theta_i^r; D_i)
        ctx.metrics[LOSS_LOCAL] = loss_local
        kept = GAKept.of(state.extra)
        if kept.ga_loss_local is not None:  # G_i of the previous round
            ctx.metrics[GAP] = scratch.loss_global - kept.ga_loss_local
        GAKept(loss_local).save_into(state.extra)

    def aggregate(self, global_weights, replies):
        self.round += 1
        n_total = sum(r.n for r in replies)
        a = {r.client_id: self.a.get(r.client_id, r.n / n_total) for r in replies}
        gaps = {r.client_id: r.metrics[GAP] for r in replies if GAP in r.metrics}
        if len(gaps) >= 2:
            a.update(
                generalization_adjustment(
                    a, gaps, step_size(self.hp.step_size, self.round, self.local.rounds, len(replies))
                )
            )
        self.a.update(a)
        return weighted_average([r.weights for r in replies], [a[r.client_id] for r in replies])
