"""Local BatchNorm frameworks: what FedBN and SiloBN keep on the client, and the SGD setting of
FedFD-A (fedfd-a.txt section 4.1, "Baseline Frameworks" and "Implementation Details").

  FedBN  [32]  keeps BN statistics AND BN affine parameters (gamma, beta) local
  SiloBN  [1]  keeps only the BN statistics (running mean / var) local; gamma, beta are aggregated
  FedAvg [35]  keeps nothing local (FedFD / FedFD-A's `framework: fedavg`, Table 1)

Every round a client loads the global weights theta_G and then puts back its own local BN tensors
(LocalBNKept, in ClientState.extra across rounds; plain tensors, so they survive the in-process
checkpoint and Flower's Context.state). After training it stores them again.

The global model is still complete. The server runs Eq. 2 (theta_G = sum_k n_k/n theta_k, section
3.1) over every tensor, so the global model's BN entries are the n_k-weighted average of the clients'
local BN tensors. For the statistics this is exactly what section 3.1 calls the global statistics
mu_G, sigma_G ("computed by aggregating the local statistics"), which FedFD reads during training
and which the held-out domain is evaluated and exported with (Table 3 (a), "Inference: global
statistics"). A client never loads these averaged entries once it has its own: the average exists
only for the global (held-out) model.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedccrl_core.algorithm_params.local_bn import LocalBNParams
from fedccrl_core.algorithms.base import Algorithm, KeptState, cross_entropy_step
from fedccrl_core.learning.static_batch import BATCH_NORMS

BN_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")
BN_AFFINE = ("weight", "bias")
FRAMEWORKS = {"fedavg": (), "silobn": BN_STATISTICS, "fedbn": BN_STATISTICS + BN_AFFINE}


def local_bn_keys(model: nn.Module, framework: str) -> list[str]:
    """The state_dict keys a client keeps local under `framework` (every BatchNorm layer)."""
    suffixes = FRAMEWORKS[framework]
    keys = []
    for name, module in model.named_modules():
        if isinstance(module, BATCH_NORMS):  # FedFD's FDBatchNorm2d too
            own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
            keys += [f"{name}.{s}" if name else s for s in suffixes if own.get(s) is not None]
    return keys


@dataclass
class LocalBNKept(KeptState):
    """What a client keeps across rounds: its own BN tensors (the framework's, `local_bn_keys`) by state-dict key."""

    local_bn: dict[str, torch.Tensor] | None = None


class LocalBNAlgorithm(Algorithm):
    """Cross-entropy local training with a framework's BN tensors kept per client."""

    Params = LocalBNParams
    hp: LocalBNParams
    pads_partial_batch = True  # its loss reads ctx.real_rows only (learning/static_batch.py)
    framework = "silobn"  # subclasses fix it, or read it from their Params (FedFD)

    def __init__(self, local, hparams=None):
        super().__init__(local, hparams)
        if self.hp.batch_size is not None:
            # the paper's batch of 64 (section 4.1) replaces train.batch_size for this algorithm
            self.local = self.local.model_copy(update={"batch_size": int(self.hp.batch_size)})

    # ---- optimizer: SGD lr 0.01, momentum 0.5, fixed learning rate (section 4.1) ------------------
    def make_optimizer(self, model):
        if self.hp.optimizer == "train":
            return super().make_optimizer(model)
        return torch.optim.SGD(
            model.parameters(), lr=self.hp.lr, momentum=self.hp.momentum, weight_decay=self.hp.weight_decay
        )

    def make_scheduler(self, opt):
        if self.hp.optimizer == "train":
            return super().make_scheduler(opt)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)  # "a fixed learning rate"

    # ---- local BN tensors --------------------------------------------------------------------
    def before_local_train(self, model, global_weights: dict) -> None:
        """Hook: runs after the client's local BN tensors are chosen, before training (FedFD reads
        the global statistics here)."""

    def local_train_steps(self, model, data, state, global_weights, payload, generator, shuffle_rng):
        """The base step generator with the client's own BN tensors swapped in and kept afterwards (a
        generator, so the CUDA engine can still interleave several clients, federation/concurrent.py)."""
        keys = local_bn_keys(model, self.framework)
        kept = LocalBNKept.of(state.extra).local_bn or {}
        weights = dict(global_weights)
        for k in keys:  # the client's own BN tensors replace theta_G's averaged ones
            if k in kept:
                ref = global_weights[k]
                weights[k] = torch.as_tensor(kept[k]).to(device=ref.device, dtype=ref.dtype)
        self.before_local_train(model, global_weights)
        reply = yield from super().local_train_steps(model, data, state, weights, payload, generator, shuffle_rng)
        if keys:
            LocalBNKept({k: reply.weights[k].detach().clone() for k in keys}).save_into(state.extra)
        return reply

    def train_step(self, model, x, y, ctx):
        return cross_entropy_step(model, x, y, ctx.real_rows)
