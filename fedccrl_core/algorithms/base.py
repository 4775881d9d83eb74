"""The algorithm interface. An algorithm is written once against it; each engine (in-process,
Flower simulation, Flower deployment) only moves its payloads.

Round t of Algorithm 1 (FedCCRL), generalized:
  lines 3-6   client side   `client_upload(data, rng)`            -> upload (FedCCRL: F_i, Eq. 8) or None
  line  7     server side   `server_payloads(uploads)`            -> {client_id: payload} (FedCCRL: F_pool \\ F_i)
  lines 8-22  client side   `local_train(model, data, state, global_weights, payload, gen)` -> (weights, n_i, metrics)
  line  23    server side   `aggregate(global_weights, replies)`  -> new global weights (Eq. 2 by default)
A subclass usually overrides only `train_step` (the loss of one minibatch) and, if it exchanges
something besides weights, `client_upload` / `server_payloads`.


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.foundation import contract, fastpath
from fedccrl_core.foundation.hparams import HParams, validate
from fedccrl_core.learning.aggregation import WeightedSum
from fedccrl_core.learning.clients import ClientData, ClientState
from fedccrl_core.learning.models import FedModel, build_model
from fedccrl_core.learning.static_batch import pad_rows, real_part, real_rows_only
from fedccrl_core.learning.statistics import normalize_u8

K = TypeVar("K", bound="KeptState")


@dataclass
class KeptState:
    """The base of an algorithm's per-client state kept across rounds (a dataclass of its module: GA's last local
    loss, FedADG's discriminator). It lives in ClientState.extra as plain data, each field under its own name, since
    the round checkpoints (federation/checkpoints.py) and Flower's Context.state (fedccrl_flower/client_state.py)
    store plain data only: a field's name is its saved key (renaming one orphans saved states). A field that is None
    (nothing kept yet) is not written."""

    @classmethod
    def of(cls: type[K], extra: dict) -> K:
        """What the client kept (ClientState.extra), None where it kept nothing yet."""
        return cls(**{f.name: extra.get(f.name) for f in dataclasses.fields(cls)})

    def save_into(self, extra: dict) -> None:
        """Into ClientState.extra, for the next round and the checkpoints."""
        extra.update({f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None})


@dataclass
class Reply:
    """A client's answer to one round: its weights, n_i (Eq. 2), float metrics, and what else it
    uploads with them (`upload`: arrays the server half aggregates, e.g. FedIIR's classifier gradient)."""

    client_id: str
    weights: dict[str, torch.Tensor]
    n: int
    metrics: dict[str, float] = field(default_factory=dict)
    upload: dict[str, torch.Tensor] | None = None


@dataclass
class StepContext:
    payload: Any
    global_params: list[torch.Tensor]
    generator: torch.Generator | None
    state: Any = None  # the algorithm's scratch for one client-round, its own type (FedCCRL's pool on the device)
    epoch: int = 0  # the local epoch being trained (0-based)
    global_weights: dict = field(default_factory=dict)  # as received (parameters and buffers)
    upload: dict | None = None  # set by a hook: travels up in the Reply, aggregated by the server half
    metrics: dict = field(default_factory=dict)  # floats a hook adds to the Reply's metrics (GA's losses)
    real_rows: int | None = None  # a padded batch (static shapes): its first real_rows rows are real, else None


@dataclass
class _Tally:
    """A client's local run, summed over its steps on the device: each loss term with its own count (a term present
    in some steps only: FedADG's adversarial epochs), the correct predictions and the samples seen."""

    correct: torch.Tensor
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    seen: int = 0

    def add(self, terms: dict[str, torch.Tensor], logits: torch.Tensor, y: torch.Tensor, real: int) -> None:
        for k, v in terms.items():
            self.sums[k] = self.sums.get(k, 0) + v.detach().float()
            self.counts[k] = self.counts.get(k, 0) + 1
        self.correct += (logits.detach().argmax(1) == y[:real]).sum()
        self.seen += real

    def metrics(self) -> dict[str, float]:
        """The mean of each term and the training accuracy: one host sync per client-round."""
        metrics = {k: float(v) / self.counts[k] for k, v in self.sums.items()}
        metrics[contract.TRAIN_ACC] = float(self.correct) / max(self.seen, 1)
        return metrics


class Algorithm:
    name = "base"
    # The hyperparameters of this algorithm, declared once (fedccrl_core/foundation/hparams.py): type, default, bounds
    # and source of each. params.yaml `train.<name>.<key>` overrides a default.
    Params: type[HParams] = HParams
    # Its train_step takes the loss on ctx.real_rows only, so a partial batch may be padded to a static shape
    # (learning/static_batch.py); an algorithm whose step mixes rows otherwise (a discriminator, a moving
    # statistic of the batch) keeps False and trains its partial batches at their own size.
    pads_partial_batch: bool = False

    def __init__(self, local: LocalConfig, hparams: HParams | dict | None = None):
        self.local = local
        self.hp = self.validated(hparams)

    @classmethod
    def validated(cls, hparams: HParams | dict | None) -> HParams:
        """This algorithm's frozen Params: an instance of them passes unchanged (validated once, with the params
        file); a mapping (train.<name> as read from a checkpoint or a message) is validated, every default filled
        in; ParamError naming the key otherwise."""
        if type(hparams) is cls.Params:
            return hparams
        return validate(cls.Params, hparams or {}, prefix=f"train.{cls.name}")

    # ---- the model this algorithm trains ------------------------------------------------------
    @classmethod
    def build_model(
        cls, backbone: str, num_classes: int, pretrained: str = "none", hparams: HParams | dict | None = None
    ) -> FedModel:
        """f = g . h, then `extend_model` adds what this algorithm needs. Everything in the returned module is
        aggregated. `checkpoint.load_model` rebuilds saved models through this same method."""
        return cls.extend_model(build_model(backbone, num_classes, pretrained), num_classes, cls.validated(hparams))

    @classmethod
    def extend_model(cls, model: FedModel, num_classes: int, hp: HParams) -> FedModel:
        """The hook of `build_model`: an algorithm that needs extra modules (a probabilistic head, a reference
        distribution, a discriminator) adds them to, or wraps, the plain f = g . h here. The plain model by default."""
        return model

    # ---- server state that must survive a resume (e.g. GA's aggregation weights) --------------
    def server_state(self) -> dict:
        return {}

    def load_server_state(self, state: dict) -> None:
        pass

    # ---- Algorithm 1 lines 3-7 -------------------------------------------------------------
    def upload_wanted(self, client_id: str) -> bool:
        """Server half: does the server need this client's upload this round? (CCST: only until it has
        the client's style.) The transport asks before the client computes anything."""
        return True

    def client_upload(self, data: ClientData, rng: np.random.Generator) -> dict | None:
        return None

    def server_payloads(self, uploads: dict[str, dict | None]) -> dict[str, Any]:
        return dict.fromkeys(uploads)

    # ---- Algorithm 1 lines 8-22 ------------------------------------------------------------
    def train_step(self, model, x: torch.Tensor, y: torch.Tensor, ctx: StepContext):
        """Loss of one minibatch (x normalized NCHW). Returns (loss, {term: tensor}, logits on x)."""
        raise NotImplementedError

    # ---- the hooks of the one local loop (`local_train_steps`); every algorithm uses this loop -----
    def min_batch(self) -> int:
        """Smallest minibatch trained; a smaller last batch of an epoch is skipped (a batch of 1
        breaks BatchNorm in train mode where a feature map is 1x1)."""
        return 2

    def local_epoch_count(self) -> int:
        """Local epochs of one client-round (FedADG: E0 + E1)."""
        return self.local.local_epochs

    def local_dataset(
        self,
        data: ClientData,
        state: ClientState,
        payload: Any,
        generator: torch.Generator | None,
        shuffle_rng: np.random.Generator,
    ) -> ClientData:
        """The data this client trains on this round, before anything else: its own by default (CCST: its
        images in K styles, D^{C_n}, built from the payload). n_i of the Reply is its n_train."""
        return data

    def begin_local(self, model, data: ClientData, state: ClientState, ctx: StepContext) -> None:
        """After the global weights, optimizer and schedule are loaded, before the first step: build
        and restore anything else this algorithm trains locally (FedADG's discriminator), in ctx.state."""

    def after_step(self, model, ctx: StepContext) -> dict[str, torch.Tensor]:
        """After the optimizer step of one minibatch: a further step (FedADG's generator); returns
        loss terms to average into the metrics."""
        return {}

    def end_local(self, model, state: ClientState, ctx: StepContext) -> None:
        """After the last epoch: keep what must survive the round in state.extra (a KeptState)."""

    def make_optimizer(self, model):
        """Adam over every parameter: fused (one kernel for all) on the CUDA fast path, else the multi-tensor form
        (a dozen operators per step for all parameters, not a dozen per parameter; on the CPU it runs the same
        kernels in the same order as the per-tensor loop, so its numbers are the loop's)."""
        fused = fastpath.enabled(self.local.fast, next(model.parameters()).device)
        return torch.optim.Adam(
            model.parameters(),
            lr=self.local.lr,
            weight_decay=self.local.weight_decay,
            fused=fused or None,
            foreach=None if fused else True,
        )

    def make_scheduler(self, opt):
        if self.local.lr_schedule == "cosine":  # stepped per local epoch over all rounds x epochs
            return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.local.rounds * self.local.local_epochs)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)

    def local_train(
        self,
        model,
        data: ClientData,
        state: ClientState,
        global_weights: dict,
        payload: Any,
        generator: torch.Generator | None,
        shuffle_rng: np.random.Generator,
    ) -> Reply:
        steps = self.local_train_steps(model, data, state, global_weights, payload, generator, shuffle_rng)
        while True:
            try:
                next(steps)
            except StopIteration as finished:
                return finished.value

    def local_train_steps(
        self,
        model,
        data: ClientData,
        state: ClientState,
        global_weights: dict,
        payload: Any,
        generator: torch.Generator | None,
        shuffle_rng: np.random.Generator,
    ):
        """`local_train` as a generator: yields after every optimizer step, returns the Reply. The engine
        interleaves several clients' generators on CUDA streams (federation/concurrent.py)."""
        data = self.local_dataset(data, state, payload, generator, shuffle_rng)
        assert data.train_x is not None  # the engine passes resident clients (ClientData.resident)
        fast = fastpath.enabled(self.local.fast, data.train_x.device)
        opt, sched, ctx = self._begin_local_run(model, data, state, global_weights, payload, generator)
        n, bs, dev = data.n_train, self.local.batch_size, data.train_x.device
        static = self.pads_partial_batch and fastpath.static_batches(self.local.fast, dev)
        tally = _Tally(correct=torch.zeros((), device=dev))
        for epoch in range(self.local_epoch_count()):
            ctx.epoch = epoch
            order = fastpath.to_device(torch.from_numpy(shuffle_rng.permutation(n)), dev)
            for start in range(0, n, bs):
                idx = order[start : start + bs]
                real = idx.numel()
                if real < self.min_batch():
                    continue
                if static and real < bs:  # padded to the static shape; the step reads its real rows only
                    idx = pad_rows(idx, bs)
                ctx.real_rows = real if idx.numel() > real else None
                x = normalize_u8(data.train_x[idx], self.local.mean, self.local.std)
                self._local_step(model, opt, ctx, (x, data.train_y[idx]), real, fast, tally)
                yield
            sched.step()
        state.optimizer = opt.state_dict()  # no copy: this optimizer is dropped, its tensors now belong to the state
        state.scheduler = sched.state_dict()
        self.end_local(model, state, ctx)
        metrics = tally.metrics()
        metrics[contract.LR] = float(opt.param_groups[0]["lr"])
        metrics.update(ctx.metrics)
        if self.local.privacy is not None:  # train.privacy on: computed on the client's data, not noised, so not sent
            metrics = {}
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return Reply(data.client_id, weights, n, metrics, ctx.upload)

    def _begin_local_run(self, model, data: ClientData, state: ClientState, global_weights: dict, payload, generator):
        """The model at the global weights in train mode, the optimizer and scheduler (resumed from the client's
        state) and the step context, begin_local called: (optimizer, scheduler, context)."""
        fastpath.prepare_model(model, self.local.fast)
        model.load_state_dict(global_weights)
        model.train()
        opt = self.make_optimizer(model)
        sched = self.make_scheduler(opt)
        if state.optimizer is not None:
            opt.load_state_dict(state.optimizer)
        if state.scheduler is not None:
            sched.load_state_dict(state.scheduler)
        ctx = StepContext(
            payload, [p.detach().clone() for p in model.parameters()], generator, global_weights=global_weights
        )
        self.begin_local(model, data, state, ctx)
        return opt, sched, ctx

    def _local_step(self, model, opt, ctx: StepContext, batch, real: int, fast: bool, tally: _Tally) -> None:
        """One optimizer step on the normalized batch (x, y), its loss terms and correct predictions tallied."""
        x, y = batch
        dev = x.device
        with fastpath.autocast(fast, dev), real_rows_only(model, real, x.shape[0]):
            loss, terms, logits = self.train_step(model, x, y, ctx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with fastpath.autocast(fast, dev):
            terms = {**terms, **self.after_step(model, ctx)}
        tally.add({contract.LOSS: loss, **terms}, logits, y, real)

    # ---- Algorithm 1 line 23 ---------------------------------------------------------------
    def sample_count(self, data: ClientData) -> int:
        """n_i as this algorithm's reply will state it (Eq. 2), known before the client trains: the
        round loop announces N = sum_i n_i to the streamed aggregation."""
        return data.n_train

    def aggregation(self, global_weights: dict, total: float | None = None) -> Aggregation | ListAggregation:
        """One round's aggregation, fed one reply at a time (`add`), read once (`result`). Eq. 2 is
        streamed (no list of every client's weights); an algorithm that overrides `aggregate` because
        it needs every reply at once (GA's weights come from all clients' gaps) gets the list form."""
        if type(self).aggregate is not Algorithm.aggregate:
            return ListAggregation(self, global_weights)
        return Aggregation(self, global_weights, total)

    def after_aggregate(
        self, global_weights: dict, averaged: dict, client_ids: list[str], uploads: dict | None = None
    ) -> dict:
        """Server-side step after Eq. 2 (FedIIR's moving average of `uploads`, the replies' uploads
        averaged with the same n_i weights; CCST's served clients)."""
        return averaged

    def aggregate(self, global_weights: dict, replies: list[Reply]) -> dict:
        """Eq. 2 over a list of replies, weighted by n_i: the same sum as the streamed form."""
        agg = Aggregation(self, global_weights, float(sum(r.n for r in replies)))
        for r in replies:
            agg.add(r)
        return agg.result()


class Aggregation:
    """Streamed Eq. 2: each reply's weights are folded into float64 sums as it arrives."""

    def __init__(self, alg: Algorithm, global_weights: dict, total: float | None):
        self.alg, self.global_weights, self.sum = alg, global_weights, WeightedSum(total)
        self.client_ids: list[str] = []
        self.uploads = WeightedSum(total)

    def add(self, reply: Reply) -> None:
        self.sum.add(reply.weights, reply.n)
        if reply.upload is not None:
            self.uploads.add(reply.upload, reply.n)
        self.client_ids.append(reply.client_id)

    def result(self) -> dict:
        uploads = self.uploads.result() if self.uploads.count else None
        return self.alg.after_aggregate(self.global_weights, self.sum.result(), self.client_ids, uploads)


class ListAggregation:
    """For an `aggregate` that needs every reply at once: keeps them, then calls it."""

    def __init__(self, alg: Algorithm, global_weights: dict):
        self.alg, self.global_weights = alg, global_weights
        self.replies: list[Reply] = []

    def add(self, reply: Reply) -> None:
        self.replies.append(dataclasses.replace(reply))  # the caller may drop the weights of its own

    def result(self) -> dict:
        return self.alg.aggregate(self.global_weights, self.replies)


def cross_entropy_step(model, x, y, real_rows: int | None = None):
    """Cross-entropy of one minibatch; of its first real_rows rows when it is padded (StepContext.real_rows)."""
    logits = real_part(model(x), real_rows)
    loss = F.cross_entropy(logits, real_part(y, real_rows))
    return loss, {contract.L_CLS: loss}, logits
