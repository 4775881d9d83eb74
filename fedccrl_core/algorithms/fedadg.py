"""FedADG (Zhang, Lei, Shi, Huang & Chen, 2021, "Federated Learning with Domain Generalization",
arXiv:2111.10487): federated adversarial alignment of every client's features to one reference
distribution, class by class.

Players: feature extractor F = h and classifier C = g (the FedModel), a distribution generator G
that maps uniform noise xi and the label to a reference feature sample r = G(xi, y), and a
conditional discriminator D(z, y) in (0, 1) that outputs 1 for reference samples and 0 for client
features. Each round, client i runs E0 epochs of L_err = CE(C(F(x)), y) and then E1 adversarial
epochs; per minibatch, in the reference code's order (github.com/wzml/FedADG, pacs-ours/localTrain.py):
    D:    L_advd = E[(1 - D(r, y))^2 + D(F(x), y)^2]
    F, C: lambda0 * L_err + (1 - lambda0) * L_advf,   L_advf = E[(1 - D(F(x), y))^2]
    G:    L_advg = E[D(r, y)^2]
The losses are least squares, as in the reference code (not the BCE of a standard GAN). F fools D
into reading client features as reference ones; G moves the reference toward what D reads as
client features, so the reference adapts to all source domains (G is aggregated).
What is aggregated (reference train.py: FedAvg over [F, C, G], one local D per client): F, C and G
are in the model's state_dict (Eq. 2); D and the D/G optimizer states stay in ClientState.extra.

Departures: the label enters G and D as a one-hot scaled by `label_value` (reference 0.7); G has a
linear output (the reference ends in ReLU for AlexNet's post-ReLU features; MobileNetV3's
Hardswish features can be negative), and smaller than the reference's (noise 2048, hidden 4096),
because G is communicated every round; D keeps the reference's sizes (projection 1024, hidden 1024)
and its separate feature forward in eval mode is replaced by one train-mode forward shared with
the F, C step. Adam and cosine as every algorithm here (the reference: SGD, warm-up, plateau).


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedccrl_core.algorithm_params.fedadg import FedADGParams
from fedccrl_core.algorithms.base import Algorithm, KeptState, cross_entropy_step
from fedccrl_core.foundation import contract
from fedccrl_core.learning.models import FedModel


class ReferenceGenerator(nn.Module):
    """G(xi, y): noise and soft one-hot label -> a reference feature sample (reference GeneDistrNet)."""

    def __init__(self, noise_dim: int, num_classes: int, hidden: int, feature_dim: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(noise_dim + num_classes, hidden), nn.LeakyReLU(), nn.Linear(hidden, feature_dim)
        )

    def forward(self, xi, y_soft):
        return self.net(torch.cat([xi, y_soft], 1))


class Discriminator(nn.Module):
    """D(z, y): projection of z, concatenated with the label, MLP, sigmoid (reference Discriminator)."""

    def __init__(self, feature_dim: int, num_classes: int, rp_dim: int, hidden: int):
        super().__init__()
        self.projection = nn.Linear(feature_dim, rp_dim, bias=False)
        self.net = nn.Sequential(
            nn.Linear(rp_dim + num_classes, hidden), nn.LeakyReLU(), nn.Linear(hidden, 1), nn.Sigmoid()
        )

    def forward(self, z, y_soft):
        return self.net(torch.cat([self.projection(z), y_soft], 1)).squeeze(1)


def discriminator_loss(d_ref, d_feat):
    """L_advd = mean((1 - D(r, y))^2 + D(F(x), y)^2)."""
    return ((1 - d_ref) ** 2 + d_feat**2).mean()


def alignment_loss(d_feat):
    """L_advf = mean((1 - D(F(x), y))^2)."""
    return ((1 - d_feat) ** 2).mean()


def generator_loss(d_ref):
    """L_advg = mean(D(r, y)^2)."""
    return (d_ref**2).mean()


@dataclass
class FedADGKept(KeptState):
    """What a client keeps across rounds besides F and C's optimizer: D's weights and D's and G's optimizer states
    (state dicts; None before its first round)."""

    discriminator: dict | None = None
    opt_d: dict | None = None
    opt_g: dict | None = None


@dataclass
class FedADGScratch:
    """One client-round: D and the adversarial optimizers, and the E1 step's reference features r and soft labels,
    held from train_step to after_step's generator step."""

    D: Discriminator
    opt_d: torch.optim.Optimizer
    opt_g: torch.optim.Optimizer
    r: torch.Tensor | None = None
    y_soft: torch.Tensor | None = None


class FedADG(Algorithm):
    name = "fedadg"
    Params = FedADGParams
    hp: FedADGParams

    @classmethod
    def extend_model(cls, model, num_classes, hp) -> FedModel:
        model.generator = ReferenceGenerator(hp.noise_dim, num_classes, hp.gen_hidden, model.feature_dim)
        return model

    def make_optimizer(self, model):  # F and C only; D and G have their own
        params = list(model.h.parameters()) + list(model.g.parameters())
        return torch.optim.Adam(params, lr=self.local.lr, weight_decay=self.local.weight_decay)

    def make_scheduler(self, opt):  # cosine over rounds x (E0 + E1) epochs
        if self.local.lr_schedule == "cosine":
            return torch.optim.lr_scheduler.CosineAnnealingLR(
                opt, T_max=self.local.rounds * (self.local.local_epochs + self.hp.e1)
            )
        return super().make_scheduler(opt)

    # ---- the base local loop's hooks: E0 epochs of L_err, then E1 adversarial epochs ----------
    def local_epoch_count(self):
        return self.local.local_epochs + self.hp.e1

    def begin_local(self, model, data, state, ctx):
        """D and its optimizer, G's optimizer: kept per client across rounds, as F and C's optimizer."""
        hp, kept = self.hp, FedADGKept.of(state.extra)
        dev = next(model.parameters()).device
        D = Discriminator(model.feature_dim, model.g.out_features, hp.rp_dim, hp.disc_hidden).to(dev).train()
        opt_d = torch.optim.Adam(D.parameters(), lr=hp.lr_adv, weight_decay=self.local.weight_decay)
        opt_g = torch.optim.Adam(model.generator.parameters(), lr=hp.lr_adv, weight_decay=self.local.weight_decay)
        for obj, saved in ((D, kept.discriminator), (opt_d, kept.opt_d), (opt_g, kept.opt_g)):
            if saved is not None:
                obj.load_state_dict(saved)
        ctx.state = FedADGScratch(D, opt_d, opt_g)

    def train_step(self, model, x, y, ctx):
        if ctx.epoch < self.local.local_epochs:  # E0: L_err only
            return cross_entropy_step(model, x, y)
        # E1: D first, then F and C (the base loop steps their optimizer on the returned loss), then G
        hp = self.hp
        scratch: FedADGScratch = ctx.state
        y_soft = F.one_hot(y, model.g.out_features).float() * hp.label_value
        xi = torch.rand(len(y), hp.noise_dim, generator=ctx.generator, device=x.device)
        z, r = model.h(x), model.generator(xi, y_soft)
        l_advd = self.discriminator_step(scratch.D, scratch.opt_d, z, r, y_soft)
        loss, l_err, l_advf, logits = self.feature_loss(model, scratch.D, z, y, y_soft)
        scratch.r, scratch.y_soft = r, y_soft
        return loss, {contract.L_CLS: l_err, contract.L_ADVF: l_advf, contract.L_ADVD: l_advd}, logits

    def after_step(self, model, ctx):
        if ctx.epoch < self.local.local_epochs:
            return {}
        scratch: FedADGScratch = ctx.state
        r, y_soft = scratch.r, scratch.y_soft
        scratch.r = scratch.y_soft = None  # this step's graph is not kept past its generator step
        return {contract.L_ADVG: self.generator_step(scratch.D, scratch.opt_g, r, y_soft)}

    def end_local(self, model, state, ctx):
        scratch: FedADGScratch = ctx.state
        FedADGKept(
            discriminator={k: v.detach().clone() for k, v in scratch.D.state_dict().items()},
            opt_d=scratch.opt_d.state_dict(),
            opt_g=scratch.opt_g.state_dict(),
        ).save_into(state.extra)

    def discriminator_step(self, D, opt_d, z, r, y_soft):
        l_advd = discriminator_loss(D(r.detach(), y_soft), D(z.detach(), y_soft))
        opt_d.zero_grad(set_to_none=True)
        l_advd.backward()
        opt_d.step()
        return l_advd

    def feature_loss(self, model, D, z, y, y_soft):
        """lambda0 L_err + (1 - lambda0) L_advf, stepped on F and C by the base loop's optimizer."""
        logits = model.g(z)
        l_err, l_advf = F.cross_entropy(logits, y), alignment_loss(D(z, y_soft))
        return self.hp.lambda0 * l_err + (1 - self.hp.lambda0) * l_advf, l_err, l_advf, logits

    def generator_step(self, D, opt_g, r, y_soft):
        l_advg = generator_loss(D(r, y_soft))
        opt_g.zero_grad(set_to_none=True)
        l_advg.backward()
        opt_g.step()
        return l_advg
