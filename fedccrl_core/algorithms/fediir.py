"""FedIIR (Guo et al., ICML 2023, "Out-of-Distribution Generalization of Federated Learning
via Implicit Invariant Relationships").

Invariant relationships are learned implicitly by aligning each client's gradient of the
classifier g with the mean classifier gradient over clients:
    L_i(w) = R_i(w) + gamma * || grad_{w_g} R_i(w) - g_bar ||^2
with R_i the client's cross-entropy on a minibatch, the gradient taken with create_graph=True so
the penalty trains h as well, and g_bar the server's exponential moving average
    g_bar <- ema * g_bar + (1 - ema) * mean_i g_i,   g_bar initialized to 0,
where g_i = grad_{w_g} R_i(w^t) is client i's mean minibatch gradient on the global model w^t.

Reading of the reference code (YamingGuo98/FedIIR, domainbed/algorithms.py, FedIIR.mean_grad and
update): at the start of round t every sampled client's g_i is computed on the global model w^t
(one pass over its data), the server updates g_bar, and only then do the clients train with the
penalty. That is a second server round trip inside a round; both engines here have one (weights
and payload down, weights and metrics up). So client i computes g_i on the received w^t *before*
its local training and sends it up with its weights; the server folds it into g_bar when it
aggregates round t, and clients use that g_bar in round t+1. Departure: the g_bar used in round t
holds the gradients at w^(t-1), one round late (in round 1, g_bar = 0).

How g_i and g_bar travel: g_i goes up in the client's Reply (`Reply.upload`, keyed by g's parameter
names), next to its weights; the round loop averages the uploads with the weights' n_i (Eq. 2; the
reference averages over all minibatches of all clients, i.e. also about n_i) and `after_aggregate`
applies the moving average. g_bar is server state of the algorithm's server half (checkpointed) and
goes down as the clients' payload; before the first aggregation it is 0 and nothing is sent (the
client uses zeros). The model holds neither.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedccrl_core.algorithm_params.fediir import FedIIRParams
from fedccrl_core.algorithms.base import Algorithm
from fedccrl_core.foundation import contract
from fedccrl_core.learning.statistics import normalize_u8


def classifier_gradient(g: nn.Module, z: torch.Tensor, y: torch.Tensor, create_graph: bool) -> tuple:
    """(R = CE(g(z), y), grad_{w_g} R as a tuple aligned with g.parameters(), logits)."""
    logits = g(z)
    risk = F.cross_entropy(logits, y)
    return risk, torch.autograd.grad(risk, list(g.parameters()), create_graph=create_graph), logits


def iir_penalty(grads, grad_mean) -> torch.Tensor:
    """|| grad_{w_g} R_i - g_bar ||^2 summed over g's parameters."""
    return sum(((gi - gm) ** 2).sum() for gi, gm in zip(grads, grad_mean))


def ema_update(grad_mean: torch.Tensor, grad_new: torch.Tensor, ema: float) -> torch.Tensor:
    """g_bar <- ema * g_bar + (1 - ema) * (mean of the clients' g_i)."""
    return ema * grad_mean + (1 - ema) * grad_new


@dataclass
class FedIIRScratch:
    """One client-round: the server's moving average g_bar, one tensor per parameter of g, on the client's device
    (zeros before the server has one)."""

    g_bar: list[torch.Tensor]


class FedIIR(Algorithm):
    name = "fediir"
    Params = FedIIRParams
    hp: FedIIRParams

    def __init__(self, local, hparams=None):
        super().__init__(local, hparams)
        self.g_bar: dict[str, torch.Tensor] | None = None  # server: the moving average, 0 before round 1

    # ---- server half --------------------------------------------------------------------------
    def server_payloads(self, uploads):
        return dict.fromkeys(uploads, self.g_bar)

    def after_aggregate(self, global_weights, averaged, client_ids, uploads=None):
        if uploads is not None:  # uploads = sum_i n_i g_i / N
            old = self.g_bar or {k: torch.zeros_like(v) for k, v in uploads.items()}
            self.g_bar = {k: ema_update(old[k], uploads[k], self.hp.ema) for k in uploads}
        return averaged

    def server_state(self):
        return {"g_bar": self.g_bar}

    def load_server_state(self, state):
        self.g_bar = state.get("g_bar")

    @torch.no_grad()
    def _features(self, model, x):
        return model.h(x)

    def mean_classifier_gradient(self, model, data) -> list[torch.Tensor]:
        """g_i on the current (global) weights: the mean of the minibatch gradients over the client's data."""
        model.train()  # as the reference: train-mode forward (begin_local restores the BN buffers after)
        sums: list[torch.Tensor] | None = None
        batches, bs = 0, self.local.batch_size
        for start in range(0, data.n_train, bs):
            if data.n_train - start < 2:  # a batch of 1 breaks BatchNorm in train mode
                continue
            x = normalize_u8(data.train_x[start : start + bs], self.local.mean, self.local.std)
            _, grads, _ = classifier_gradient(
                model.g, self._features(model, x), data.train_y[start : start + bs], False
            )
            sums = list(grads) if sums is None else [s + g for s, g in zip(sums, grads)]
            batches += 1
        assert sums is not None, "FedIIR: a client needs at least 2 training rows"
        return [s / batches for s in sums]

    # ---- client half: the base local loop's hooks --------------------------------------------
    def begin_local(self, model, data, state, ctx):
        """g_i on the received w^t, before local training; then w^t again (the train-mode passes moved
        the BN buffers). g_bar from the payload, zeros before the server has one."""
        g_i = self.mean_classifier_gradient(model, data)
        model.load_state_dict(ctx.global_weights)
        names = [n for n, _ in model.g.named_parameters()]
        ctx.upload = {n: g.detach().clone() for n, g in zip(names, g_i)}  # up: g_i on w^t
        params = dict(model.g.named_parameters())
        ctx.state = FedIIRScratch(
            [
                torch.zeros_like(params[n])
                if ctx.payload is None
                else torch.as_tensor(ctx.payload[n]).to(params[n].device, params[n].dtype)
                for n in names
            ]
        )

    def train_step(self, model, x, y, ctx):
        risk, grads, logits = classifier_gradient(model.g, model.h(x), y, create_graph=True)
        scratch: FedIIRScratch = ctx.state
        l_iir = iir_penalty(grads, scratch.g_bar)
        return risk + self.hp.gamma * l_iir, {contract.L_CLS: risk, contract.L_IIR: l_iir}, logits
