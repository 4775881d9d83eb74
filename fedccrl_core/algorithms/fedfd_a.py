"""FedFD-A: FedFD plus instance feature adaptation (fedfd-a.txt section 3.3, Fig. 3, Tables 15-16).

Every FDBatchNorm2d gets an instance adapter G_phi: two fully connected layers with output size 2
(section 4.1), fed the channel-wise differences between the instance and the global statistics:
  Eq. 7   [delta_i; epsilon_i] = G_phi([mu_i - mu_G; sigma_i - sigma_G]),
          alpha_i = T(z delta_i + epsilon_i), z ~ N(0, 1), T = clamp to [0, 1]
  Eq. 6   mu*_i = alpha_i mu_i + (1 - alpha_i) mu_G,  sigma*_i = alpha_i sigma_i + (1 - alpha_i) sigma_G
alpha_i is one scalar per sample and layer (shared by the channels). At test time alpha = T(epsilon)
("the mean of z is 0"): one deterministic forward pass, so the exported ONNX graph computes the
instance statistics and the interpolation itself.

Training alternates, per minibatch (Table 15): the main network (theta, phi of the classifier) is
updated by FedFD's Eq. 5, then the adapter by L_CE (Eq. 1) of the forward with Eq. 6-7 statistics.
Both steps use the same minibatch and one SGD optimizer; each parameter group gets the gradient of
its own objective only: the main network's parameters are frozen (requires_grad off) while the
adapter's forward is recorded, and the adapter takes no part in the Eq. 5 forwards. Departure: the
two updates happen in the same optimizer step, so the adapter's step sees the main network before,
not after, this minibatch's update (one step of lag; see docs/algorithms/local-bn.md).

Our choices (the paper is silent): hidden width max(adapter_min_hidden, C // adapter_reduction)
with ReLU (C/16 gives Table 4's +0.22M parameters on ResNet-18: 11.31M -> 11.53M); z drawn per
sample and layer; epsilon's bias starts at adapter_init_alpha = 0.5 so that alpha starts inside
(0, 1), where the clamp passes gradient.

Ablations: `adapter: false` is FedFD (Table 3); `diversification: false` trains the adapter on the
framework alone (Table 3 (c1)); `inference` adapter | global | instance (Table 3 (c1): global
statistics, instance statistics (TBN), instance feature adapter).


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedccrl_core.algorithm_params.fedfd_a import FedFDAParams
from fedccrl_core.algorithms.fedfd import FedFD, bn_mode
from fedccrl_core.foundation import contract


class InstanceAdapter(nn.Module):
    """G_phi of one BN layer: [mu_i - mu_G; sigma_i - sigma_G] (2C) -> (delta, epsilon) -> alpha (Eq. 7)."""

    def __init__(self, num_channels: int, hidden: int, init_alpha: float = 0.5):
        super().__init__()
        self.fc1 = nn.Linear(2 * num_channels, hidden)
        self.fc2 = nn.Linear(hidden, 2)
        with torch.no_grad():
            self.fc2.bias[1] = init_alpha  # epsilon: alpha starts at T(init_alpha)

    def delta_epsilon(self, d_mu: torch.Tensor, d_sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.fc2(F.relu(self.fc1(torch.cat([d_mu, d_sigma], dim=1))))
        return out[:, :1], out[:, 1:]

    def forward(
        self,
        d_mu: torch.Tensor,
        d_sigma: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """alpha [B, 1]. With a generator (training): T(z delta + epsilon), z ~ N(0, 1) per sample;
        without (test): T(epsilon)."""
        delta, epsilon = self.delta_epsilon(d_mu, d_sigma)
        if generator is None:
            return epsilon.clamp(0.0, 1.0)
        z = torch.randn(delta.shape, generator=generator, device=delta.device, dtype=delta.dtype)
        return (z * delta + epsilon).clamp(0.0, 1.0)


def adapter_hidden(num_channels: int, reduction: int, min_hidden: int) -> int:
    return max(int(min_hidden), num_channels // int(reduction))


class FedFDA(FedFD):
    name = "fedfd_a"
    Params = FedFDAParams
    hp: FedFDAParams

    @classmethod
    def inference(cls, hp: FedFDAParams) -> str:  # type: ignore[override]  # hp is always cls.Params (extend_model)
        return hp.inference

    @classmethod
    def make_adapter(cls, hp: FedFDAParams):  # type: ignore[override]  # hp is always cls.Params (extend_model)
        if not hp.adapter:
            return None
        return lambda c: InstanceAdapter(
            c, adapter_hidden(c, hp.adapter_reduction, hp.adapter_min_hidden), float(hp.adapter_init_alpha)
        )

    @staticmethod
    def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
        return [p for n, p in model.named_parameters() if ".adapter." in f".{n}"]

    def train_step(self, model, x, y, ctx):
        loss, terms, logits = super().train_step(model, x, y, ctx)  # main network: Eq. 5
        if not self.hp.adapter:
            return loss, terms, logits
        adapter = {id(p) for p in self.adapter_parameters(model)}
        frozen = [p for p in model.parameters() if id(p) not in adapter and p.requires_grad]
        for p in frozen:  # the adapter's loss must not train the main network
            p.requires_grad_(False)
        try:
            with bn_mode(model, "adapt", ctx.generator):
                l_adapter = F.cross_entropy(model(x), y)  # Eq. 1 with Eq. 6-7 statistics
        finally:
            for p in frozen:
                p.requires_grad_(True)
        terms[contract.L_ADAPTER] = l_adapter
        return loss + l_adapter, terms, logits
