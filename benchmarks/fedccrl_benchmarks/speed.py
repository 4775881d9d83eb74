"""`fedccrl-bench speed`: the fast engine path against the plain baseline (plain.py), in one process on one
device, on generated data (the embedded synthetic dataset's renderer, resized to `size`).

Three paths: fast (the engine), plain (the baseline with the reference code's per-batch AugMix) and
plain per-sample (the baseline with per-sample PIL AugMix); see plain.py. Each path runs in its own
child process (`python -m fedccrl_benchmarks.speed --child ...`), once per repeat, the paths
alternating; the fastest repeat of each timing is reported, since on a shared machine other load only
ever adds time. In each child:
  1. a FedCCRL local step on client 0: `warmup` untimed steps, then `steps` timed ones
     -> images/s (source images per second: each step also forwards the two augmented views);
     the share of that time spent augmenting (fast: the two device-side M(X) of the same batches,
     timed alone; plain: the Dataset's own timer around its host augmentation) and decoding;
  2. `rounds` rounds of Algorithm 1 over every client (`epochs` local epochs each), aggregation and the
     evaluation of the source validation set and the target -> seconds of the first round and of the later
     ones (their median): the first pays the start-up (cuDNN autotuning of each new shape, lazy kernel loading);
     the fast path also reports FedAvg's local step, and on CUDA the GPU's busy share during these rounds
     (NVML's utilization, sampled every 0.1 s by a thread: torch.cuda.utilization);
  3. the evaluation alone on the target images -> images/s;
  4. the peak memory: the child's peak resident set size (getrusage ru_maxrss: data generation,
     the path's set-up and 1-3, the same for every path), and on CUDA torch.cuda.max_memory_allocated
     over 1-3.
The projection of a full PACS sweep (4 held-out domains x `PACS_ROUNDS` rounds x `PACS_EPOCHS`
epochs, the registry's per-domain counts, 90/10 train/val split) uses the step and evaluation
images/s measured here, i.e. at THIS image size and backbone on THIS device, plus once per held-out
domain (each is its own training process) the first round's excess over a later one: it is a
projection for a 224 px sweep only when the bench ran with --size 224.
"""

from __future__ import annotations

import itertools
import math
import os
import platform
import resource
import sys
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from fedccrl_benchmarks import children

PACS_ROUNDS, PACS_EPOCHS, PACS_VAL_FRACTION = 10, 3, 0.1


@dataclass
class BenchConfig:
    size: int = 32
    images_per_client: int = 64
    clients: int = 3
    steps: int = 10
    warmup: int = 2
    batch_size: int = 32
    epochs: int = 1
    rounds: int = 3  # the first round against the later ones
    backbone: str = "small_cnn"
    device: str = "auto"
    workers: int = 0  # DataLoader workers of the plain path
    concurrent_clients: int | str = "auto"
    eval_batch_size: int = 256
    repeats: int = 3  # alternating fast/plain; the fastest repeat of each timing is reported
    threads: int = 0  # torch intra-op threads (0: torch's default); 1 is steadier on a shared CPU
    seed: int = 0


def _log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
def generate(n: int, domain_index: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n synthetic images of one domain (classes in turn), uint8 NHWC at size x size, and labels."""
    from PIL import Image

    from fedccrl_core.data.synthetic import CLASSES, DOMAINS, image_rng, render

    images, labels = np.empty((n, size, size, 3), dtype=np.uint8), np.empty(n, dtype=np.int64)
    for i in range(n):
        c = i % len(CLASSES)
        img = render(DOMAINS[domain_index], CLASSES[c], image_rng(seed, domain_index, c, i))
        if img.size != (size, size):
            img = img.resize((size, size), Image.Resampling.BILINEAR)
        images[i], labels[i] = np.asarray(img), c
    return images, labels


@dataclass
class BenchData:
    train: list[tuple[np.ndarray, np.ndarray]]  # per client
    val: list[tuple[np.ndarray, np.ndarray]]
    target: tuple[np.ndarray, np.ndarray]
    num_classes: int


def make_data(cfg: BenchConfig) -> BenchData:
    """Client i draws from source domain i mod 3 (photo, art, cartoon); the target is sketch."""
    from fedccrl_core.data.synthetic import CLASSES

    n_val = max(2, math.ceil(cfg.images_per_client * PACS_VAL_FRACTION))
    train, val = [], []
    for i in range(cfg.clients):
        x, y = generate(cfg.images_per_client + n_val, i % 3, cfg.size, cfg.seed + 1000 * (i // 3))
        train.append((x[n_val:], y[n_val:]))
        val.append((x[:n_val], y[:n_val]))
    return BenchData(train, val, generate(cfg.images_per_client, 3, cfg.size, cfg.seed), len(CLASSES))


# ---------------------------------------------------------------------------------------------
# Timing and memory
# ---------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA): timings end on it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(steps, n_warm: int, n_timed: int, device) -> float:
    """Seconds for n_timed next() of a step generator after n_warm untimed ones."""
    for _ in range(n_warm):
        next(steps)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n_timed):
        next(steps)
    sync(device)
    seconds = time.perf_counter() - t0
    steps.close()
    return seconds


class BusySampler:
    """The GPU's busy share while the block runs: NVML's utilization (the share of its last sample period, 1/6 s
    to 1 s, in which a kernel ran), read every `every` seconds by a thread. `share` is None off CUDA, and None with
    `why` set when NVML cannot be read (nvidia-ml-py missing, no driver library)."""

    def __init__(self, device: torch.device, every: float = 0.1):
        self.device, self.every, self.why = device, every, None
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if device.type != "cuda":
            self.why = "not a CUDA device"
            return
        try:
            torch.cuda.utilization(device)
        except Exception as e:  # ModuleNotFoundError (no pynvml) or an NVML error: reported, not fatal
            self.why = f"NVML unreadable: {type(e).__name__}: {e}"

    def _run(self):
        while not self._stop.wait(self.every):
            self.samples.append(torch.cuda.utilization(self.device))

    def __enter__(self):
        if self.why is None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    @property
    def share(self) -> float | None:
        return None if not self.samples else float(np.mean(self.samples)) / 100.0


def _round_times(run_rounds, device, rounds: int) -> tuple[list[float], BusySampler]:
    """Seconds of each of `rounds` rounds: run_rounds(on_round) runs them and calls on_round after each."""
    marks = []

    def on_round(_record=None):
        sync(device)
        marks.append(time.perf_counter())

    sync(device)
    with BusySampler(device) as busy:
        marks.append(time.perf_counter())
        run_rounds(on_round)
    if len(marks) != rounds + 1:
        raise RuntimeError(f"bench: expected {rounds} rounds, timed {len(marks) - 1}")
    return [b - a for a, b in itertools.pairwise(marks)], busy


def _epochs_for(n_steps: int, n: int, bs: int) -> int:
    per_epoch = sum(1 for s in range(0, n, bs) if min(bs, n - s) >= 2)
    return max(1, math.ceil(n_steps / max(per_epoch, 1)))


# ---------------------------------------------------------------------------------------------
# The two paths
# ---------------------------------------------------------------------------------------------
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
        _log(
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
        return _time_steps(steps, cfg.warmup, cfg.steps, device)

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

        return _round_times(run_rounds, self.device, self.cfg.rounds)

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
        step_s = _time_steps(steps, 0, cfg.steps, device)
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

        return _round_times(run_rounds, self.device, self.cfg.rounds)

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


def child(cfg: BenchConfig, name: str) -> dict:
    """One path, measured in this (child) process: timings, the peak RSS of the process, CUDA peak."""
    from fedccrl_core.foundation.fastpath import resolve_device

    device = resolve_device(cfg.device, "--device")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    path = PATHS[name](cfg, make_data(cfg), device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_s, aug_s, dec_s = path.step_seconds()
    fedavg_step_s = path.fedavg_step_seconds() if hasattr(path, "fedavg_step_seconds") else None
    rounds_s, busy = path.round_seconds()
    eval_s = path.eval_seconds()
    return {
        "step_s": step_s,
        "augment_s": aug_s,
        "decode_s": dec_s,
        "rounds_s": rounds_s,
        "eval_s": eval_s,
        "fedavg_step_s": fedavg_step_s,
        "busy_share": busy.share,
        "busy_why": busy.why,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cuda_peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "concurrent_clients": getattr(path, "concurrent", 1),
        "threads": torch.get_num_threads(),
        "augmix_impl": path.augmix_impl,
        "augmix_probe_s": getattr(path, "augmix_probe_s", None),
    }


def run_child(cfg: BenchConfig, name: str) -> dict:
    return children.run_child("fedccrl_benchmarks.speed", {"cfg": asdict(cfg), "path": name}, f"bench child ({name})")


def measure(names: list[str], cfg: BenchConfig) -> dict[str, dict]:
    """Every figure of every path, `cfg.repeats` times with the paths alternating, each run in its own
    child process; the fastest repeat of each timing is kept, the largest peak memory."""
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(cfg.repeats):
        for n in names:
            r = run_child(cfg, n)
            runs[n].append(r)
            _log(
                f"{n} (repeat {rep + 1}/{cfg.repeats}): local step {cfg.steps * cfg.batch_size / r['step_s']:.1f} "
                f"images/s, rounds "
                + ", ".join(f"{t:.2f}" for t in r["rounds_s"])
                + f" s, peak RSS {r['peak_rss_mib']:.0f} MiB"
            )
    n_target = cfg.images_per_client
    out = {}
    for n in names:
        best = min(runs[n], key=lambda r: r["step_s"])  # the shares come from the fastest step repeat
        cuda = [r["cuda_peak_mib"] for r in runs[n] if r["cuda_peak_mib"] is not None]
        fedavg = [r["fedavg_step_s"] for r in runs[n] if r["fedavg_step_s"] is not None]
        busy = [r["busy_share"] for r in runs[n] if r["busy_share"] is not None]
        first = min(r["rounds_s"][0] for r in runs[n])
        later = min(float(np.median(r["rounds_s"][1:])) for r in runs[n])
        out[n] = {
            "step_ips": cfg.steps * cfg.batch_size / best["step_s"],
            "fedavg_step_ips": cfg.steps * cfg.batch_size / min(fedavg) if fedavg else None,
            "first_round_s": first,
            "later_round_s": later,
            "first_over_later": first / later,
            "busy_share": max(busy) if busy else None,
            "busy_why": best["busy_why"],
            "augment_share": None if best["augment_s"] is None else min(best["augment_s"] / best["step_s"], 1.0),
            "decode_share": None if best["decode_s"] is None else min(best["decode_s"] / best["step_s"], 1.0),
            "round_s": later,
            "eval_ips": n_target / min(r["eval_s"] for r in runs[n]),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in runs[n]),
            "cuda_peak_mib": max(cuda) if cuda else None,
            "concurrent_clients": best["concurrent_clients"],
            "threads": best["threads"],
            "augmix_impl": best["augmix_impl"],
            "augmix_probe_s": best["augmix_probe_s"],
            "repeats": runs[n],
        }
    return out


# ---------------------------------------------------------------------------------------------
# Projection and table
# ---------------------------------------------------------------------------------------------
def pacs_sweep_seconds(
    step_ips: float, eval_ips: float, rounds: int = PACS_ROUNDS, epochs: int = PACS_EPOCHS, startup_s: float = 0.0
) -> float:
    """A PACS sweep at the given speeds: for each held-out domain, `startup_s` (a training process's first-round
    excess) + `rounds` x (`epochs` passes over the 90% training split of the three source domains + one
    evaluation of their 10% validation split and of the held-out domain). Counts from fedccrl_core.data.registry
    (P 1670, A 2048, C 2344, S 3929)."""
    from fedccrl_core.data.registry import REGISTRY

    counts = REGISTRY["pacs"].domain_counts
    assert counts is not None  # the registry checks PACS per domain
    total = 0.0
    for held_out, n_target in enumerate(counts):
        n_source = sum(n for d, n in enumerate(counts) if d != held_out)
        n_val = round(PACS_VAL_FRACTION * n_source)
        total += startup_s + rounds * (epochs * (n_source - n_val) / step_ips + (n_val + n_target) / eval_ips)
    return total


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


COLUMNS = (
    ("fast", "fast"),
    ("plain", "plain (per-batch AugMix, reference)"),
    ("plain_per_sample", "plain (per-sample PIL AugMix)"),
)


def figures(results: dict[str, dict], cuda: bool) -> list[dict]:
    rows = [
        ("FedCCRL local step on client 0, source images/s", "step_ips", "{:.1f}"),
        ("FedAvg local step on client 0, source images/s", "fedavg_step_ips", "{:.1f}"),
        ("seconds per round (every client, Eq. 2, source validation and target evaluation)", "round_s", "{:.2f}"),
        ("seconds of the first round", "first_round_s", "{:.2f}"),
        ("first round / later round", "first_over_later", "{:.2f}"),
        *([("GPU busy share during the rounds (NVML, sampled)", "busy_share", "{:.0%}")] if cuda else []),
        ("evaluation of the target, images/s", "eval_ips", "{:.1f}"),
        ("share of step time in augmentation (X1, X2)", "augment_share", "{:.0%}"),
        ("share of step time in decoding", "decode_share", "{:.0%}"),
        ("peak RSS of the child process, MiB", "peak_rss_mib", "{:.0f}"),
        *([("CUDA max_memory_allocated, MiB", "cuda_peak_mib", "{:.0f}")] if cuda else []),
        ("projected PACS sweep, hours", "pacs_h", "{:.2f}"),
    ]
    for p in results.values():
        startup = max(p["first_round_s"] - p["later_round_s"], 0.0)
        p["pacs_h"] = pacs_sweep_seconds(p["step_ips"], p["eval_ips"], startup_s=startup) / 3600
    fast = results["fast"]
    return [
        {
            "figure": name,
            "key": key,
            **{n: results[n].get(key) for n in results},
            **{f"fast/{n}": _ratio(fast.get(key), results[n].get(key)) for n in results if n != "fast"},
            "fmt": fmt,
        }
        for name, key, fmt in rows
    ]


def render_table(cfg: BenchConfig, device: torch.device, results: dict, rows: list[dict]) -> str:
    def cell(v, fmt):
        return "n/a" if v is None else fmt.format(v)

    fast = results["fast"]
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {fast['threads']} threads"
    names = [n for n, _ in COLUMNS if n in results]
    lines = [
        f"fedccrl-bench speed: FedCCRL, {cfg.backbone} (pretrained none), {cfg.size} px, batch {cfg.batch_size}, "
        f"{cfg.clients} clients x {cfg.images_per_client} images, {cfg.steps} timed steps, {cfg.epochs} epoch(s) "
        f"per round, on {device} ({dev}; torch {torch.__version__}, {platform.machine()}), each path in its own "
        f"child process, best of {cfg.repeats} alternating repeats, load average {os.getloadavg()[0]:.1f} at the end",
        f"fast: shards uint8 on the device, per-sample CCDT+AugMix (Alg. 3) with the AugMix implementation "
        f"{fast['augmix_impl']} (train.fedccrl.augmix_impl), the faster on this device in a probe of one "
        f"{cfg.batch_size}-image batch ("
        + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in (fast["augmix_probe_s"] or {}).items())
        + "), fast switches "
        f"{'on (bf16 autocast, channels_last)' if device.type == 'cuda' else 'no-ops on the CPU'}, "
        f"{fast['concurrent_clients']} client(s) at once, eval batch {cfg.eval_batch_size}",
        f"plain: PNG decoded by a DataLoader ({cfg.workers} workers) every step, fp32, clients in sequence, eval "
        f"batch {cfg.batch_size}; augmentation on the host: per batch as the reference FedCCRL code (MixStyle, "
        f"8-bit levels, torchvision's AugMix on the batch tensor), or per sample (numpy MixStyle, PIL AugMix)",
        "",
        "| figure | "
        + " | ".join(dict(COLUMNS)[n] for n in names)
        + " | "
        + " | ".join(f"fast/{n}" for n in names if n != "fast")
        + " |",
        "|---" * (2 * len(names)) + "|",
    ]
    for r in rows:
        ratios = ["n/a" if r[f"fast/{n}"] is None else f"{r[f'fast/{n}']:.2f}" for n in names if n != "fast"]
        lines.append(
            f"| {r['figure']} | " + " | ".join(cell(r[n], r["fmt"]) for n in names) + " | " + " | ".join(ratios) + " |"
        )
    lines += [
        "",
        "images/s count source images (each step also forwards their two augmented views); peak RSS: the child "
        "process's ru_maxrss (data generation, set-up and the three measurements)",
        f"seconds per round: the median of rounds 2-{cfg.rounds}; the first round's excess over it is the start-up "
        f"(cuDNN autotuning of new shapes, lazy kernel loading, first allocations)",
        f"projected PACS sweep: 4 held-out domains x ({PACS_ROUNDS} rounds x ({PACS_EPOCHS} epochs over the source "
        f"domains' 90% training split at the FedCCRL step's images/s + one evaluation of their 10% and of the "
        f"held-out domain at the evaluation's images/s) + the first round's excess once per held-out domain), "
        f"6 clients, registry counts, at the speeds measured here ({cfg.size} px, {cfg.backbone}, {device.type})"
        + ("" if cfg.size == 224 else "; NOT a 224 px figure unless run with --size 224"),
    ]
    if device.type == "cuda" and fast["busy_share"] is None:
        lines.append(f"GPU busy share: n/a ({fast['busy_why']})")
    for r in rows:
        for n in names:
            if n != "fast" and r[f"fast/{n}"] is not None:
                lines.append(f"ratio fast/{n}, {r['figure']}: {r[f'fast/{n}']:.2f}")
    return "\n".join(lines)


def bench(cfg: BenchConfig) -> dict:
    from fedccrl_core.foundation.fastpath import resolve_device

    device = resolve_device(cfg.device, "--device")
    _log(
        f"measuring on {device}: {len(PATHS)} paths x {cfg.repeats} repeat(s), each in a child process "
        f"({cfg.clients} clients x {cfg.images_per_client} images at {cfg.size} px)"
    )
    results = measure(list(PATHS), cfg)
    rows = figures(results, device.type == "cuda")
    table = render_table(cfg, device, results, rows)
    return {
        "config": asdict(cfg),
        "device": str(device),
        "torch": torch.__version__,
        "loadavg": os.getloadavg(),
        "threads": results["fast"]["threads"],
        **results,
        "figures": [{k: v for k, v in r.items() if k != "fmt"} for r in rows],
        "table": table,
    }


if __name__ == "__main__":
    children.child_main(
        "fedccrl_benchmarks.speed", "fedccrl-bench speed", lambda spec: child(BenchConfig(**spec["cfg"]), spec["path"])
    )
