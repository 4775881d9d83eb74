"""The paths `fedccrl-bench speed` measures: fast (the in-process engine, as `fedccrl train` runs it), plain (the
baseline of plain.py with the reference code's per-batch AugMix) and plain per-sample (with per-sample PIL
AugMix). Each gives the seconds of local steps (and of their augmentation and decoding), of rounds and of the
target's evaluation.

Floor 5 (docs/architecture.md, "Layers"): research tooling, imported by no product module."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from fedccrl_benchmarks.speed_config import BenchConfig, log
from fedccrl_benchmarks.speed_data import BenchData
from fedccrl_benchmarks.speed_timing import BusySampler, round_times, sync, time_steps


def _epochs_for(n_steps: int, n: int, bs: int) -> int:
    per_epoch = sum(1 for s in range(0, n, bs) if min(bs, n - s) >= 2)
    return max(1, math.ceil(n_steps / max(per_epoch, 1)))


def _hp():
    from fedccrl_core.algorithms.fedccrl import FedCCRL

    return FedCCRL.Params()


def _local(cfg: BenchConfig, epochs: int, fast: bool):
    from fedccrl_core.algorithm_params.train import LocalConfig

    return LocalConfig(rounds=1, local_epochs=epochs, batch_size=cfg.batch_size, fast=fast)


def _model(cfg: BenchConfig, num_classes: int, device):
    from fedccrl_core.learning.models import build_model

    torch.manual_seed(cfg.seed)
    return build_model(cfg.backbone, num_classes, "none").to(device)


def _statistics(images_u8: np.ndarray):
    from fedccrl_core.data.pools import compute_statistics
    from fedccrl_core.learning.statistics import IMAGENET_MEAN, IMAGENET_STD

    return compute_statistics(images_u8, IMAGENET_MEAN, IMAGENET_STD)


def fast_clients(data: BenchData, device) -> list:
    """The clients as the engine holds them: shards uint8 on the device, with their statistics."""
    from fedccrl_core.learning.clients import ClientData

    return [
        ClientData.from_numpy(f"client{i}", f"d{i % 3}", x, y, vx, vy, device, *_statistics(x))
        for i, ((x, y), (vx, vy)) in enumerate(zip(data.train, data.val))
    ]


class FastPath:
    """The in-process engine as `fedccrl train` runs it (train.fast on)."""

    name = "fast"

    def __init__(self, cfg: BenchConfig, data: BenchData, device: torch.device):
        from fedccrl_core.algorithms.fedccrl import FedCCRL
        from fedccrl_core.augment.augmix_pil import probe_augmix_impl
        from fedccrl_core.federation.engine import concurrent_width
        from fedccrl_core.federation.loop import EvalSets

        self.cfg, self.data, self.device = cfg, data, device
        self.clients = fast_clients(data, device)
        tx, ty = data.target
        self.evalsets = EvalSets.for_target(self.clients, tx, ty, cfg.eval_batch_size, device)
        # its AugMix implementation: the faster of the two on this device at this size (augment/augmix_pil.py)
        self.augmix_impl, self.augmix_probe_s = probe_augmix_impl(device, cfg.size, cfg.batch_size)
        self.hparams = {"augmix_impl": self.augmix_impl}
        log(
            f"fast: AugMix implementation {self.augmix_impl} (probe, one {cfg.batch_size}-image batch: "
            + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in self.augmix_probe_s.items())
            + ")"
        )
        self.concurrent = concurrent_width(
            cfg.concurrent_clients, device, len(self.clients), FedCCRL(_local(cfg, 1, True), self.hparams)
        )

    def _payload(self, alg):
        """Client 0's payload of one round (Algorithm 1 lines 3-7)."""
        return alg.server_payloads(
            {c.client_id: alg.client_upload(c, np.random.default_rng(i)) for i, c in enumerate(self.clients)}
        )[self.clients[0].client_id]

    def _local_steps_seconds(self, alg, payload) -> float:
        """Seconds of cfg.steps local steps of `alg` on client 0, after cfg.warmup untimed ones."""
        from fedccrl_core.foundation.seeding import torch_generator
        from fedccrl_core.learning.clients import ClientState

        cfg, device, c0 = self.cfg, self.device, self.clients[0]
        model = _model(cfg, self.data.num_classes, device)
        global_w = {k: v.detach().clone() for k, v in model.state_dict().items()}
        steps = alg.local_train_steps(
            model,
            c0,
            ClientState(),
            global_w,
            payload,
            torch_generator(cfg.seed, "bench", device=device),
            np.random.default_rng(0),
        )
        return time_steps(steps, cfg.warmup, cfg.steps, device)

    def fedavg_step_seconds(self) -> float:
        """The same local steps with FedAvg (cross-entropy on the clean batch): the step without Eq. 3-16."""
        from fedccrl_core.algorithms.fedavg import FedAvg

        cfg = self.cfg
        alg = FedAvg(_local(cfg, _epochs_for(cfg.warmup + cfg.steps, self.clients[0].n_train, cfg.batch_size), True))
        return self._local_steps_seconds(alg, self._payload(alg))

    def step_seconds(self) -> tuple[float, float, float]:
        """(seconds of cfg.steps local steps on client 0, seconds of their augmentation alone, decoding)."""
        from fedccrl_core.algorithms.base import StepContext
        from fedccrl_core.algorithms.fedccrl import FedCCRL
        from fedccrl_core.foundation.seeding import torch_generator
        from fedccrl_core.learning.statistics import normalize_u8

        cfg, device, c0 = self.cfg, self.device, self.clients[0]
        alg = FedCCRL(_local(cfg, _epochs_for(cfg.warmup + cfg.steps, c0.n_train, cfg.batch_size), True), self.hparams)
        payload = self._payload(alg)
        step_s = self._local_steps_seconds(alg, payload)
        # the augmentation of as many batches, alone (the same device-side M(X) the step runs twice)
        ctx = StepContext(payload, [], torch_generator(cfg.seed, "bench-aug", device=device))
        order = torch.from_numpy(np.random.default_rng(1).permutation(c0.n_train)).to(device)
        bs = min(cfg.batch_size, c0.n_train)
        batches = [order[st : st + bs] for st in ((s * bs) % (c0.n_train - bs + 1) for s in range(cfg.steps))]
        alg.augmented_views(normalize_u8(c0.train_x[batches[0]]), ctx)  # warm
        sync(device)
        t0 = time.perf_counter()
        for idx in batches:
            alg.augmented_views(normalize_u8(c0.train_x[idx]), ctx)
        sync(device)
        return step_s, time.perf_counter() - t0, 0.0  # decoded once, before training

    def round_seconds(self) -> tuple[list[float], BusySampler]:
        """Seconds of each of cfg.rounds rounds of the engine, and the GPU's busy share over them."""
        from fedccrl_core.algorithms.fedccrl import FedCCRL
        from fedccrl_core.federation.driver import HeldOutRun, train

        alg = FedCCRL(_local(self.cfg, self.cfg.epochs, True), self.hparams)
        self.model = _model(self.cfg, self.data.num_classes, self.device)
        run = HeldOutRun(
            alg,
            self.model,
            self.clients,
            self.evalsets,
            self.cfg.rounds,
            self.cfg.seed,
            concurrent_clients=self.cfg.concurrent_clients,
        )

        def run_rounds(on_round):
            train(run, on_round=on_round, log=lambda m: None)

        return round_times(run_rounds, self.device, self.cfg.rounds)

    def eval_seconds(self) -> float:
        from fedccrl_core.learning.accuracy import accuracy

        ev = self.evalsets
        accuracy(self.model, ev.target_x, ev.target_y, ev.batch_size, fast=True)  # warm
        sync(self.device)
        t0 = time.perf_counter()
        accuracy(self.model, ev.target_x, ev.target_y, ev.batch_size, fast=True)
        return time.perf_counter() - t0


class PlainPath:
    """The plain baseline (plain.py), with the reference code's per-batch AugMix."""

    name, augment = "plain", "batch"
    augmix_impl = "batch (reference)"  # the one implementation of the reference's reading

    def __init__(self, cfg: BenchConfig, data: BenchData, device: torch.device):
        from fedccrl_benchmarks.plain import EncodedImages, FedCCRLViews, PlainClient, encode_png
        from fedccrl_core.learning.statistics import IMAGENET_MEAN, IMAGENET_STD

        self.cfg, self.data, self.device = cfg, data, device
        hp, m, s = _hp(), IMAGENET_MEAN, IMAGENET_STD
        self.clients = [
            PlainClient(
                f"client{i}", FedCCRLViews(encode_png(x), y, m, s, hp, cfg.seed + i, self.augment), *_statistics(x)
            )
            for i, (x, y) in enumerate(data.train)
        ]
        self.val = EncodedImages(
            encode_png(np.concatenate([v[0] for v in data.val])), np.concatenate([v[1] for v in data.val]), m, s
        )
        self.target = EncodedImages(encode_png(data.target[0]), data.target[1], m, s)

    def step_seconds(self) -> tuple[float, float | None, float | None]:
        from fedccrl_benchmarks.plain import plain_local_train_steps
        from fedccrl_core.algorithms.fedccrl import FedCCRL
        from fedccrl_core.learning.clients import ClientState

        cfg, device, c0 = self.cfg, self.device, self.clients[0]
        alg = FedCCRL(_local(cfg, _epochs_for(cfg.warmup + cfg.steps, c0.n_train, cfg.batch_size), False))
        payload = alg.server_payloads(
            {c.client_id: alg.client_upload(c, np.random.default_rng(i)) for i, c in enumerate(self.clients)}
        )[c0.client_id]
        c0.views.set_pool(payload["mu"], payload["sigma"])
        c0.state = ClientState()
        model = _model(cfg, self.data.num_classes, device)
        global_w = {k: v.detach().clone() for k, v in model.state_dict().items()}
        steps = plain_local_train_steps(
            alg, model, c0, global_w, c0.loader(cfg.batch_size, cfg.seed, cfg.workers), device
        )
        for _ in range(cfg.warmup):
            next(steps)
        dec0, aug0 = c0.views.decode_s, c0.views.augment_s
        step_s = time_steps(steps, 0, cfg.steps, device)
        if cfg.workers:  # items are built in worker processes: their timers are not visible here
            return step_s, None, None
        return step_s, c0.views.augment_s - aug0, c0.views.decode_s - dec0

    def round_seconds(self) -> tuple[list[float], BusySampler]:
        from fedccrl_benchmarks.plain import plain_round
        from fedccrl_core.algorithms.fedccrl import FedCCRL
        from fedccrl_core.learning.clients import ClientState

        alg = FedCCRL(_local(self.cfg, self.cfg.epochs, False))
        self.model = _model(self.cfg, self.data.num_classes, self.device)
        for c in self.clients:
            c.state = ClientState()

        def run_rounds(on_round):
            global_w = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            for rnd in range(1, self.cfg.rounds + 1):
                global_w, _ = plain_round(
                    alg,
                    self.model,
                    self.clients,
                    global_w,
                    self.val,
                    self.target,
                    rnd,
                    self.cfg.seed,
                    self.device,
                    self.cfg.workers,
                )
                on_round()

        return round_times(run_rounds, self.device, self.cfg.rounds)

    def eval_seconds(self) -> float:
        from fedccrl_benchmarks.plain import plain_accuracy

        t0 = time.perf_counter()
        plain_accuracy(self.model, self.target, self.cfg.batch_size, self.device, self.cfg.workers)
        return time.perf_counter() - t0


class PlainPerSamplePath(PlainPath):
    """The plain baseline with per-sample PIL AugMix in the Dataset (the second plain row)."""

    name, augment = "plain_per_sample", "per_sample"
    augmix_impl = "pil"


PATHS = {p.name: p for p in (FastPath, PlainPath, PlainPerSamplePath)}
