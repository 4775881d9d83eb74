"""FedFD, federated feature diversification (Yang et al., ECCV 2024, "Feature Diversification and
Adaptation for Federated Domain Generalization", fedfd-a.txt section 3.2), on a local-BN framework
(SiloBN by default, section 4.1 / Table 1).

Every BatchNorm2d of the backbone becomes an `FDBatchNorm2d` (built in `build_model`, so any
backbone with BatchNorm2d works). Client k, each minibatch:
  Eq. 1   f_{i,k} = F(x_i) with ordinary train-mode BN (batch statistics; the local running
          statistics are updated), L_CE = CE(C(f_{i,k}), y_i)
  Eq. 2   f_{i,Delta} = F(x_i) where every BN layer l normalizes a^l with
              mu_Delta^l = u^l mu_k^l + (1 - u^l) mu_G^l,  sigma_Delta^l = u^l sigma_k^l + (1 - u^l) sigma_G^l
          u^l in R^{C_l}, each element ~ U(0, 1), drawn anew for every layer and forward; mu_k, sigma_k
          the instance statistics of a^l (the paper's choice), mu_G, sigma_G the global statistics of
          the global model theta_G received this round (its BN running statistics)
  Eq. 3   L_CAFL = 1/n sum_i ||f_{i,k} - f_{i,Delta}||_2^2
  Eq. 4   L_CACL = 1/n sum_i CE(C(f_{i,Delta}), y_i)
  Eq. 5   L_total = (1 - lambda1) L_CE + lambda1 L_CACL + lambda2 L_CAFL     (lambda1 0.1, lambda2 4.0)
Inference (the global model) is ordinary eval-mode BN with the global statistics (Table 3 (b)).

Ablations: `statistics` global (u = 0) | instance (u = 1) | mixed (Table 2); `u_sampling` random
U(u_low, u_high) (Table 9 ranges) | fixed u = u_fixed (Table 2, 0.5); `local_statistics` instance |
batch (section 3.2 "can be calculated on a batch or instance basis"); `diversification: false`
trains with L_CE only (the framework alone, Table 3 (c1) for FedFD-A); `framework` (Table 1).

Departure: L_CAFL defaults to the mean over the V feature dimensions (`cafl_reduction: mean`, i.e.
Eq. 3 / V, an MSE); `sum` is Eq. 3 as printed. With the printed sum, lambda2 = 4.0 outweighs L_CE by
about two orders of magnitude at initialization (V = 64 on small_cnn, 512 on ResNet-18), and local
training collapses the features to make f_{i,k} = f_{i,Delta} (L_CE stays at chance, measured on the
synthetic clients); with the mean, lambda2 = 4.0 is a regularizer of CE's size, which is what the
paper's lambda2 study (Fig. 5: lambda2 in [2, 5] gives consistent results) suggests.

Readings (the paper is silent): sigma = sqrt(var + eps) with BN's eps for instance and global
statistics; the statistics are not detached (gradients flow through mu_k, sigma_k and both sides of
L_CAFL); f is the encoder output h(x) (the classifier's input).


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from fedccrl_core.algorithm_params.fedfd import FDParams
from fedccrl_core.algorithms.local_bn import LocalBNAlgorithm
from fedccrl_core.foundation import contract
from fedccrl_core.learning.models import FedModel
from fedccrl_core.learning.statistics import channel_stats


def _per_channel(v: torch.Tensor) -> torch.Tensor:
    """[B, C] or [C] statistics -> broadcastable against [B, C, H, W]."""
    return v.reshape(*v.shape, 1, 1) if v.dim() == 2 else v.reshape(1, -1, 1, 1)


class FDBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d that can also normalize with mixed (Eq. 2) or, with an instance adapter,
    interpolated (Eq. 6-7) statistics. Same parameters and buffers as BatchNorm2d (plus `adapter.*`).

    Training forward by `mode`: "batch" (ordinary BN), "mix" (Eq. 2), "adapt" (Eq. 6-7, z ~ N(0, 1)).
    Eval forward: ordinary BN with the running (global) statistics, or with `inference`
    "adapter" the Eq. 6 statistics with alpha = clamp(epsilon) (deterministic, one pass), "instance"
    alpha = 1 (TBN). mu_G, sigma_G are the running statistics in eval mode and, in training, the
    global model's statistics set by `set_global_statistics` (a client's running statistics are its
    own under SiloBN/FedBN).
    """

    # always tracked here (track_running_stats=True below); BatchNorm2d types them Optional
    running_mean: torch.Tensor
    running_var: torch.Tensor
    global_mean: torch.Tensor | None
    global_var: torch.Tensor | None

    def __init__(
        self,
        num_features,
        eps=1e-5,
        momentum=0.1,
        affine=True,
        adapter: nn.Module | None = None,
        inference: str = "global",
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.adapter = adapter
        self.inference = inference
        self.mode = "batch"
        self.u_low, self.u_high = 0.0, 1.0  # u ~ U(u_low, u_high); u_low == u_high: fixed u
        self.local_statistics = "instance"
        self.generator: torch.Generator | None = None
        self.register_buffer("global_mean", None, persistent=False)
        self.register_buffer("global_var", None, persistent=False)
        self.last_u: torch.Tensor | None = None  # the u^l of the latest "mix" forward (analysis, tests)
        self.last_alpha: torch.Tensor | None = None  # the alpha of the latest training "adapt" forward

    # ---- statistics --------------------------------------------------------------------------
    def global_statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu_G, sigma_G), [C] each."""
        if self.training and self.global_mean is not None and self.global_var is not None:  # set together
            mean, var = self.global_mean, self.global_var
        else:
            mean, var = self.running_mean, self.running_var
        return mean.float(), torch.sqrt(var.float() + self.eps)

    def local_stats(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu_k, sigma_k): instance statistics [B, C] (or batch statistics [1, C])."""
        if self.local_statistics == "batch":
            mu = a.mean(dim=(0, 2, 3))
            return mu[None], torch.sqrt(a.var(dim=(0, 2, 3), unbiased=False) + self.eps)[None]
        return channel_stats(a, self.eps)

    def normalize_with(self, a: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """gamma (a - mu) / sigma + beta (section 3.1) with the given statistics."""
        out = (a - _per_channel(mu)) / _per_channel(sigma)
        if self.affine:
            out = out * _per_channel(self.weight) + _per_channel(self.bias)
        return out

    def draw_u(self, like: torch.Tensor) -> torch.Tensor:
        """u^l in R^C, each element ~ U(u_low, u_high), independently per channel (Eq. 2)."""
        c = self.num_features
        if self.u_low == self.u_high:
            return like.new_full((c,), float(self.u_low))
        u = torch.rand(c, generator=self.generator, device=like.device, dtype=like.dtype)
        return self.u_low + (self.u_high - self.u_low) * u

    # ---- forward paths -----------------------------------------------------------------------
    def mixed(self, a: torch.Tensor) -> torch.Tensor:
        """Eq. 2: normalize with u mu_k + (1 - u) mu_G and u sigma_k + (1 - u) sigma_G."""
        mu_k, sigma_k = self.local_stats(a)
        mu_g, sigma_g = self.global_statistics()
        u = self.draw_u(a)
        self.last_u = u.detach()
        return self.normalize_with(a, u * mu_k + (1 - u) * mu_g, u * sigma_k + (1 - u) * sigma_g)

    def interpolated(self, a: torch.Tensor, sample: bool) -> torch.Tensor:
        """Eq. 6: normalize with alpha mu_i + (1 - alpha) mu_G, alpha from the adapter (Eq. 7)."""
        mu_i, sigma_i = channel_stats(a, self.eps)
        mu_g, sigma_g = self.global_statistics()
        if self.inference == "instance" and not sample:
            alpha = torch.ones_like(mu_i[:, :1])
        else:
            assert self.adapter is not None  # "adapt" training and "adapter" inference are FedFD-A's, with one
            alpha = self.adapter(mu_i - mu_g, sigma_i - sigma_g, self.generator if sample else None)  # [B, 1]
        if sample:
            self.last_alpha = alpha.detach()
        return self.normalize_with(a, alpha * mu_i + (1 - alpha) * mu_g, alpha * sigma_i + (1 - alpha) * sigma_g)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        if not self.training:
            if self.inference == "global" or (self.adapter is None and self.inference != "instance"):
                return super().forward(a)
            return self.interpolated(a.float(), sample=False).to(a.dtype)
        if self.mode == "batch":
            return super().forward(a)
        if self.mode == "mix":
            return self.mixed(a.float()).to(a.dtype)
        if self.mode == "adapt":
            return self.interpolated(a.float(), sample=True).to(a.dtype)
        raise ValueError(f"FDBatchNorm2d: unknown mode {self.mode!r}")


def fd_layers(model: nn.Module) -> list[FDBatchNorm2d]:
    return [m for m in model.modules() if isinstance(m, FDBatchNorm2d)]


def replace_batchnorm(module: nn.Module, make_adapter=None, inference: str = "global") -> int:
    """Swap every nn.BatchNorm2d below `module` for an FDBatchNorm2d with the same state; returns
    how many were swapped. make_adapter(C) builds the layer's instance adapter (FedFD-A) or None."""
    count = 0
    for name, child in module.named_children():
        if type(child) is nn.BatchNorm2d:
            if not child.track_running_stats:
                raise ValueError(f"FedFD: BatchNorm2d {name!r} keeps no running statistics (no global statistics)")
            new = FDBatchNorm2d(
                child.num_features,
                child.eps,
                child.momentum,
                child.affine,
                make_adapter(child.num_features) if make_adapter else None,
                inference,
            )
            missing, unexpected = new.load_state_dict(child.state_dict(), strict=False)
            assert not unexpected and all(k.startswith("adapter.") for k in missing)
            assert child.running_mean is not None  # tracked: checked above
            setattr(module, name, new.to(child.running_mean.device))
            count += 1
        else:
            count += replace_batchnorm(child, make_adapter, inference)
    return count


@contextlib.contextmanager
def bn_mode(model: nn.Module, mode: str, generator: torch.Generator | None = None):
    """Every FDBatchNorm2d in `mode` for the duration (then back to ordinary BN)."""
    layers = fd_layers(model)
    for m in layers:
        m.mode, m.generator = mode, generator
    try:
        yield layers
    finally:
        for m in layers:
            m.mode, m.generator = "batch", None


def set_global_statistics(model: nn.Module, global_weights: dict) -> None:
    """mu_G, sigma_G^2 of every layer = the running statistics of the received global model theta_G."""
    for name, m in model.named_modules():
        if isinstance(m, FDBatchNorm2d):
            m.global_mean = global_weights[f"{name}.running_mean"].detach().clone().to(m.running_mean.device)
            m.global_var = global_weights[f"{name}.running_var"].detach().clone().to(m.running_var.device)


def cafl(f_k: torch.Tensor, f_delta: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """Eq. 3: 1/n sum_i ||f_{i,k} - f_{i,Delta}||_2^2 (reduction "sum", as printed), or that divided
    by the feature dimension V (reduction "mean": the mean squared error over batch and features)."""
    sq = (f_k - f_delta).pow(2).flatten(1)
    if reduction == "sum":
        return sq.sum(1).mean()
    if reduction == "mean":
        return sq.mean()
    raise ValueError(f"cafl: reduction must be sum or mean, got {reduction!r}")


def cacl(logits_delta: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Eq. 4: 1/n sum_i CE(C(f_{i,Delta}), y_i)."""
    return F.cross_entropy(logits_delta, y)


def total_loss(l_ce, l_cacl, l_cafl, lambda1: float, lambda2: float) -> torch.Tensor:
    """Eq. 5: (1 - lambda1) L_CE + lambda1 L_CACL + lambda2 L_CAFL."""
    return (1 - lambda1) * l_ce + lambda1 * l_cacl + lambda2 * l_cafl


class FedFD(LocalBNAlgorithm):
    name = "fedfd"
    Params = FDParams
    hp: FDParams
    pads_partial_batch = False  # FDBatchNorm2d's own statistics of the batch (learning/static_batch.py)

    def __init__(self, local, hparams=None):
        super().__init__(local, hparams)
        self.framework = self.hp.framework

    def u_range(self) -> tuple[float, float]:
        """(low, high) of u: Table 2's global (0), instance (1), fixed (u_fixed) or U(u_low, u_high)."""
        hp = self.hp
        if hp.statistics == "global":
            return 0.0, 0.0
        if hp.statistics == "instance":
            return 1.0, 1.0
        if hp.u_sampling == "fixed":
            return float(hp.u_fixed), float(hp.u_fixed)
        return float(hp.u_low), float(hp.u_high)

    @classmethod
    def make_adapter(cls, hp: FDParams):
        return None  # FedFD-A adds the instance adapter

    @classmethod
    def inference(cls, hp: FDParams) -> str:
        return "global"  # FedFD-A reads its own `inference`

    @classmethod
    def extend_model(cls, model, num_classes, hp) -> FedModel:
        make = cls.make_adapter(hp)
        if replace_batchnorm(model.h, make, cls.inference(hp)) == 0:
            raise ValueError(
                f"model.backbone: {cls.name} needs BatchNorm2d layers in {type(model.h).__name__} (section 3.1)"
            )
        return model

    def before_local_train(self, model, global_weights):
        set_global_statistics(model, global_weights)  # mu_G, sigma_G: theta_G's statistics this round
        low, high = self.u_range()
        for m in fd_layers(model):
            m.u_low, m.u_high, m.local_statistics = low, high, self.hp.local_statistics

    def train_step(self, model, x, y, ctx):
        f_k = model.h(x)  # ordinary BN: local feature f_{i,k}
        logits = model.g(f_k)
        l_ce = F.cross_entropy(logits, y)  # Eq. 1
        if not self.hp.diversification:
            return l_ce, {contract.L_CE: l_ce}, logits
        with bn_mode(model, "mix", ctx.generator):
            f_delta = model.h(x)  # Eq. 2 at every BN layer: f_{i,Delta}
        l_cafl = cafl(f_k, f_delta, self.hp.cafl_reduction)  # Eq. 3
        l_cacl = cacl(model.g(f_delta), y)  # Eq. 4
        loss = total_loss(l_ce, l_cacl, l_cafl, self.hp.lambda1, self.hp.lambda2)  # Eq. 5
        return loss, {contract.L_CE: l_ce, contract.L_CACL: l_cacl, contract.L_CAFL: l_cafl}, logits
