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

How g_i and g_bar travel: as buffers `grad_g.*` of the model, shaped like g's parameters (so every
engine moves and counts them, and a checkpoint of the global weights keeps g_bar across a resume).
Down, the buffers hold g_bar; up, the client overwrites them with g_i; Eq. 2 averages the g_i
weighted by n_i (the reference averages over all minibatches of all clients, i.e. also about n_i),
and `aggregate` applies the moving average. The buffers are unused by the forward pass.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedccrl_core.algorithms.base import Algorithm
from fedccrl_core.models import FedModel, build_model
from fedccrl_core.statistics import normalize_u8


class ClassifierGradient(nn.Module):
    """Buffers shaped like g's parameters: the server's g_bar on the way down, the client's g_i on the way up."""

    def __init__(self, g: nn.Module):
        super().__init__()
        self.names = [n.replace(".", "_") for n, _ in g.named_parameters()]
        for name, p in zip(self.names, g.parameters()):
            self.register_buffer(name, torch.zeros_like(p, requires_grad=False))

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in self.names]


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


class FedIIR(Algorithm):
    name = "fediir"
    defaults = {
        # penalty weight: reference hparams_registry PACS 1e-3 (VLCS 5e-3, OfficeHome 5e-4); FedCCRL reference 0.001
        "gamma": 0.001,
        "ema": 0.95,  # moving-average factor of g_bar: reference and FedCCRL reference default 0.95
    }

    @classmethod
    def build_model(cls, backbone, num_classes, pretrained="none", hparams=None) -> FedModel:
        model = build_model(backbone, num_classes, pretrained)
        model.grad_g = ClassifierGradient(model.g)
        return model

    @torch.no_grad()
    def _features(self, model, x):
        return model.h(x)

    def mean_classifier_gradient(self, model, data) -> list[torch.Tensor]:
        """g_i on the current (global) weights: the mean of the minibatch gradients over the client's data."""
        model.train()  # as the reference: train-mode forward (BN buffers are restored by local_train's reload)
        sums, batches, bs = None, 0, self.local.batch_size
        for start in range(0, data.n_train, bs):
            if data.n_train - start < 2:  # a batch of 1 breaks BatchNorm in train mode
                continue
            x = normalize_u8(data.train_x[start:start + bs], self.local.mean, self.local.std)
            _, grads, _ = classifier_gradient(model.g, self._features(model, x), data.train_y[start:start + bs], False)
            sums = list(grads) if sums is None else [s + g for s, g in zip(sums, grads)]
            batches += 1
        return [s / batches for s in sums]

    def local_train(self, model, data, state, global_weights, payload, generator, shuffle_rng):
        model.load_state_dict(global_weights)  # grad_g.* now hold g_bar, used by train_step
        g_i = self.mean_classifier_gradient(model, data)
        reply = super().local_train(model, data, state, global_weights, payload, generator, shuffle_rng)
        for name, g in zip(model.grad_g.names, g_i):  # up: g_i on w^t in place of g_bar
            reply.weights[f"grad_g.{name}"] = g.detach().clone()
        return reply

    def train_step(self, model, x, y, ctx):
        risk, grads, logits = classifier_gradient(model.g, model.h(x), y, create_graph=True)
        l_iir = iir_penalty(grads, model.grad_g.tensors())
        return risk + self.hp["gamma"] * l_iir, {"l_cls": risk, "l_iir": l_iir}, logits

    def after_aggregate(self, global_weights, averaged, client_ids):
        new = dict(averaged)  # Eq. 2 gave grad_g.* = sum_i n_i g_i / N
        for key in [k for k in new if k.startswith("grad_g.")]:
            new[key] = ema_update(global_weights[key], new[key], self.hp["ema"])
        return new
