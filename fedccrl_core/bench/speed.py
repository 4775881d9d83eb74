"""`fedccrl bench`: the fast engine path against the plain baseline (plain.py), in one process on one
device, on generated data (the embedded synthetic dataset's renderer, resized to `size`).

For each path (fast, then plain, alternating `repeats` times; the fastest repeat of each timing is
reported, since on a shared machine other load only ever adds time):
  1. a FedCCRL local step on client 0: `warmup` untimed steps, then `steps` timed ones
     -> images/s (source images per second: each step also forwards the two augmented views);
     the share of that time spent augmenting (fast: the two device-side M(X) of the same batches,
     timed alone; plain: the Dataset's own timer around its host augmentation) and decoding;
  2. one round of Algorithm 1 over every client (`epochs` local epochs each), aggregation and the
     evaluation of the source validation set and the target -> seconds per round;
  3. the evaluation alone on the target images -> images/s;
  4. the peak memory over 1-3: CUDA torch.cuda.max_memory_allocated; CPU the peak resident set size
     of the process while the path runs (/proc/self/statm sampled every 5 ms).
The projection of a full PACS sweep (4 held-out domains x `PACS_ROUNDS` rounds x `PACS_EPOCHS`
epochs, the registry's per-domain counts, 90/10 train/val split) uses the step and evaluation
images/s measured here, i.e. at THIS image size and backbone on THIS device: it is a projection
for a 224 px sweep only when the bench ran with --size 224.
"""
from __future__ import annotations

import gc
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
            img = img.resize((size, size), Image.BILINEAR)
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
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """Peak memory while the block runs: CUDA allocated bytes, or the CPU process's resident set size."""

    def __init__(self, device: torch.device):
        self.device, self.peak_mib, self.what = device, None, ""
        self._stop = threading.Event()

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        peak = 0
        while True:
            peak = max(peak, self._rss())
            if self._stop.wait(0.005):
                break
        self._peak = max(peak, self._rss())

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.what = "CUDA max_memory_allocated"
        elif os.path.exists("/proc/self/statm"):
            self.what = "peak RSS of the process while the path ran"
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        else:
            self.what = "n/a"
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak_mib = torch.cuda.max_memory_allocated(self.device) / 2**20
        elif self.what != "n/a":
            self._stop.set()
            self._thread.join()
            self.peak_mib = self._peak / 2**20
        return False


def _time_steps(steps, n_warm: int, n_timed: int, device) -> float:
    """Seconds for n_timed next() of a step generator after n_warm untimed ones."""
    for _ in range(n_warm):
        next(steps)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n_timed):
        next(steps)
    _sync(device)
    seconds = time.perf_counter() - t0
    steps.close()
    return seconds


def _epochs_for(n_steps: int, n: int, bs: int) -> int:
    per_epoch = sum(1 for s in range(0, n, bs) if min(bs, n - s) >= 2)
    return max(1, math.ceil(n_steps / max(per_epoch, 1)))


# ---------------------------------------------------------------------------------------------
# The two paths
# ---------------------------------------------------------------------------------------------
def _hp() -> dict:
    from fedccrl_core.algorithms.fedccrl import FedCCRL

    return dict(FedCCRL.defaults)


def _local(cfg: BenchConfig, epochs: int, fast: bool):
    from fedccrl_core.algorithms import LocalConfig

    return LocalConfig(rounds=1, local_epochs=epochs, batch_size=cfg.batch_size, fast=fast)


def _model(cfg: BenchConfig, num_classes: int, device):
    from fedccrl_core.models import build_model

    torch.manual_seed(cfg.seed)
    return build_model(cfg.backbone, num_classes, "none").to(device)


def _statistics(images_u8: np.ndarray):
    from fedccrl_core.data.pools import compute_statistics
    from fedccrl_core.statistics import IMAGENET_MEAN, IMAGENET_STD

    return compute_statistics(images_u8, IMAGENET_MEAN, IMAGENET_STD)


class FastPath:
    """The in-process engine as `fedccrl train` runs it (train.fast on)."""

    name = "fast"

    def __init__(self, cfg: BenchConfig, data: BenchData, device: torch.device):
        from fedccrl_core.algorithms.fedccrl import FedCCRL
        from fedccrl_core.federation.client import ClientData
        from fedccrl_core.federation.engine import EvalSets, concurrent_width

        self.cfg, self.data, self.device = cfg, data, device
        self.clients = [ClientData.from_numpy(f"client{i}", f"d{i % 3}", x, y, vx, vy, device, *_statistics(x))
                        for i, ((x, y), (vx, vy)) in enumerate(zip(data.train, data.val))]
        tx, ty = data.target
        self.target = ClientData.from_numpy("target", "sketch", tx, ty, tx[:0], ty[:0], device)
        self.evalsets = EvalSets(torch.cat([c.val_x for c in self.clients]), torch.cat([c.val_y for c in self.clients]),
                                 self.target.train_x, self.target.train_y, cfg.eval_batch_size)
        self.concurrent = concurrent_width(cfg.concurrent_clients, device, len(self.clients),
                                           FedCCRL(_local(cfg, 1, True)))

    def step_seconds(self) -> tuple[float, float, float]:
        """(seconds of cfg.steps local steps on client 0, seconds of their augmentation alone, decoding)."""
        from fedccrl_core.algorithms.base import StepContext
        from fedccrl_core.algorithms.fedccrl import FedCCRL
        from fedccrl_core.federation.client import ClientState
        from fedccrl_core.seeding import torch_generator
        from fedccrl_core.statistics import normalize_u8

        cfg, device, c0 = self.cfg, self.device, self.clients[0]
        alg = FedCCRL(_local(cfg, _epochs_for(cfg.warmup + cfg.steps, c0.n_train, cfg.batch_size), True))
        payload = alg.server_payloads({c.client_id: alg.client_upload(c, np.random.default_rng(i))
                                       for i, c in enumerate(self.clients)})[c0.client_id]
        model = _model(cfg, self.data.num_classes, device)
        global_w = {k: v.detach().clone() for k, v in model.state_dict().items()}
        steps = alg.local_train_steps(model, c0, ClientState(), global_w, payload,
                                      torch_generator(cfg.seed, "bench", device=device), np.random.default_rng(0))
        step_s = _time_steps(steps, cfg.warmup, cfg.steps, device)
        # the augmentation of as many batches, alone (the same device-side M(X) the step runs twice)
        ctx = StepContext(payload, [], torch_generator(cfg.seed, "bench-aug", device=device))
        order = torch.from_numpy(np.random.default_rng(1).permutation(c0.n_train)).to(device)
        bs = min(cfg.batch_size, c0.n_train)
        batches = [order[st:st + bs] for st in ((s * bs) % (c0.n_train - bs + 1) for s in range(cfg.steps))]
        alg.augmented_views(normalize_u8(c0.train_x[batches[0]]), ctx)  # warm
        _sync(device)
        t0 = time.perf_counter()
        for idx in batches:
            alg.augmented_views(normalize_u8(c0.train_x[idx]), ctx)
        _sync(device)
        return step_s, time.perf_counter() - t0, 0.0  # decoded once, before training

    def round_seconds(self) -> float:
        from fedccrl_core.algorithms.fedccrl import FedCCRL
        from fedccrl_core.federation.engine import InProcessEngine

        alg = FedCCRL(_local(self.cfg, self.cfg.epochs, True))
        self.model = _model(self.cfg, self.data.num_classes, self.device)
        engine = InProcessEngine(alg, self.model, self.clients, self.evalsets, 1, self.cfg.seed, log=lambda m: None,
                                 concurrent_clients=self.cfg.concurrent_clients)
        _sync(self.device)
        t0 = time.perf_counter()
        engine.run()
        _sync(self.device)
        return time.perf_counter() - t0

    def eval_seconds(self) -> float:
        from fedccrl_core.evaluation import accuracy

        t = self.target
        accuracy(self.model, t.train_x, t.train_y, self.cfg.eval_batch_size, fast=True)  # warm
        _sync(self.device)
        t0 = time.perf_counter()
        accuracy(self.model, t.train_x, t.train_y, self.cfg.eval_batch_size, fast=True)
        return time.perf_counter() - t0


class PlainPath:
    """The plain baseline (plain.py)."""

    name = "plain"

    def __init__(self, cfg: BenchConfig, data: BenchData, device: torch.device):
        from fedccrl_core.bench.plain import EncodedImages, FedCCRLViews, PlainClient, encode_png
        from fedccrl_core.statistics import IMAGENET_MEAN, IMAGENET_STD

        self.cfg, self.data, self.device = cfg, data, device
        hp, m, s = _hp(), IMAGENET_MEAN, IMAGENET_STD
        self.clients = [PlainClient(f"client{i}", FedCCRLViews(encode_png(x), y, m, s, hp, cfg.seed + i),
                                    *_statistics(x)) for i, (x, y) in enumerate(data.train)]
        self.val = EncodedImages(encode_png(np.concatenate([v[0] for v in data.val])),
                                 np.concatenate([v[1] for v in data.val]), m, s)
        self.target = EncodedImages(encode_png(data.target[0]), data.target[1], m, s)

    def step_seconds(self) -> tuple[float, float | None, float | None]:
        from fedccrl_core.algorithms.fedccrl import FedCCRL
        from fedccrl_core.bench.plain import plain_local_train_steps
        from fedccrl_core.federation.client import ClientState

        cfg, device, c0 = self.cfg, self.device, self.clients[0]
        alg = FedCCRL(_local(cfg, _epochs_for(cfg.warmup + cfg.steps, c0.n_train, cfg.batch_size), False))
        payload = alg.server_payloads({c.client_id: alg.client_upload(c, np.random.default_rng(i))
                                       for i, c in enumerate(self.clients)})[c0.client_id]
        c0.views.set_pool(payload["mu"], payload["sigma"])
        c0.state = ClientState()
        model = _model(cfg, self.data.num_classes, device)
        global_w = {k: v.detach().clone() for k, v in model.state_dict().items()}
        steps = plain_local_train_steps(alg, model, c0, global_w, c0.loader(cfg.batch_size, cfg.seed, cfg.workers),
                                        device)
        for _ in range(cfg.warmup):
            next(steps)
        dec0, aug0 = c0.views.decode_s, c0.views.augment_s
        step_s = _time_steps(steps, 0, cfg.steps, device)
        if cfg.workers:  # items are built in worker processes: their timers are not visible here
            return step_s, None, None
        return step_s, c0.views.augment_s - aug0, c0.views.decode_s - dec0

    def round_seconds(self) -> float:
        from fedccrl_core.algorithms.fedccrl import FedCCRL
        from fedccrl_core.bench.plain import plain_round
        from fedccrl_core.federation.client import ClientState

        alg = FedCCRL(_local(self.cfg, self.cfg.epochs, False))
        self.model = _model(self.cfg, self.data.num_classes, self.device)
        for c in self.clients:
            c.state = ClientState()
        global_w = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        _sync(self.device)
        t0 = time.perf_counter()
        plain_round(alg, self.model, self.clients, global_w, self.val, self.target, 1, self.cfg.seed, self.device,
                    self.cfg.workers)
        _sync(self.device)
        return time.perf_counter() - t0

    def eval_seconds(self) -> float:
        from fedccrl_core.bench.plain import plain_accuracy

        t0 = time.perf_counter()
        plain_accuracy(self.model, self.target, self.cfg.batch_size, self.device, self.cfg.workers)
        return time.perf_counter() - t0


def measure(paths: list, cfg: BenchConfig, device: torch.device) -> dict[str, dict]:
    """Every figure of every path, `cfg.repeats` times with the paths alternating; the fastest repeat
    of each timing is kept (on a shared machine the other load only ever adds time)."""
    runs = {p.name: [] for p in paths}
    peaks = {p.name: [] for p in paths}
    for rep in range(cfg.repeats):
        for p in paths:
            with PeakMemory(device) as mem:
                step_s, aug_s, dec_s = p.step_seconds()
                round_s = p.round_seconds()
                eval_s = p.eval_seconds()
            runs[p.name].append((step_s, aug_s, dec_s, round_s, eval_s))
            peaks[p.name].append(mem)
            _log(f"{p.name} (repeat {rep + 1}/{cfg.repeats}): local step {cfg.steps * cfg.batch_size / step_s:.1f} "
                 f"images/s, round {round_s:.2f}s")
    out = {}
    for p in paths:
        best = min(runs[p.name], key=lambda r: r[0])  # the shares come from the fastest step repeat
        step_s, aug_s, dec_s = best[:3]
        n_target = len(p.data.target[1])
        mems = [m.peak_mib for m in peaks[p.name] if m.peak_mib is not None]
        out[p.name] = {
            "step_ips": cfg.steps * cfg.batch_size / step_s,
            "augment_share": None if aug_s is None else min(aug_s / step_s, 1.0),
            "decode_share": None if dec_s is None else min(dec_s / step_s, 1.0),
            "round_s": min(r[3] for r in runs[p.name]),
            "eval_ips": n_target / min(r[4] for r in runs[p.name]),
            "peak_mib": max(mems) if mems else None,
            "memory": peaks[p.name][0].what,
            "repeats": [dict(zip(("step_s", "augment_s", "decode_s", "round_s", "eval_s"), r)) for r in runs[p.name]],
        }
    out["fast"]["concurrent_clients"] = next(p for p in paths if p.name == "fast").concurrent
    return out


# ---------------------------------------------------------------------------------------------
# Projection and table
# ---------------------------------------------------------------------------------------------
def pacs_sweep_seconds(step_ips: float, eval_ips: float, rounds: int = PACS_ROUNDS, epochs: int = PACS_EPOCHS) -> float:
    """A PACS sweep at the given speeds: for each held-out domain, `rounds` x (`epochs` passes over the
    90% training split of the three source domains + one evaluation of their 10% validation split
    and of the held-out domain). Counts from fedccrl_core.data.registry (P 1670, A 2048, C 2344, S 3929)."""
    from fedccrl_core.data.registry import REGISTRY

    counts = REGISTRY["pacs"].domain_counts
    total = 0.0
    for held_out, n_target in enumerate(counts):
        n_source = sum(n for d, n in enumerate(counts) if d != held_out)
        n_val = round(PACS_VAL_FRACTION * n_source)
        total += rounds * (epochs * (n_source - n_val) / step_ips + (n_val + n_target) / eval_ips)
    return total


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def figures(fast: dict, plain: dict) -> list[dict]:
    rows = [
        ("FedCCRL local step, images/s", "step_ips", "{:.1f}"),
        ("seconds per round", "round_s", "{:.2f}"),
        ("evaluation, images/s", "eval_ips", "{:.1f}"),
        ("share of step time in augmentation", "augment_share", "{:.0%}"),
        ("share of step time in decoding", "decode_share", "{:.0%}"),
        ("peak memory, MiB", "peak_mib", "{:.0f}"),
        ("projected PACS sweep, hours", "pacs_h", "{:.2f}"),
    ]
    for p in (fast, plain):
        p["pacs_h"] = pacs_sweep_seconds(p["step_ips"], p["eval_ips"]) / 3600
    return [{"figure": name, "key": key, "fast": fast.get(key), "plain": plain.get(key),
             "ratio": _ratio(fast.get(key), plain.get(key)), "fmt": fmt} for name, key, fmt in rows]


def render_table(cfg: BenchConfig, device: torch.device, fast: dict, plain: dict, rows: list[dict]) -> str:
    def cell(v, fmt):
        return "n/a" if v is None else fmt.format(v)

    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    lines = [
        f"fedccrl bench: FedCCRL, {cfg.backbone} (pretrained none), {cfg.size} px, batch {cfg.batch_size}, "
        f"{cfg.clients} clients x {cfg.images_per_client} images, {cfg.steps} timed steps, {cfg.epochs} epoch(s) "
        f"per round, on {device} ({dev}; torch {torch.__version__}, {platform.machine()}), best of {cfg.repeats} "
        f"alternating repeats, load average {os.getloadavg()[0]:.1f} at the end",
        f"fast: shards uint8 on the device, device-side per-sample CCDT+AugMix, fast switches "
        f"{'on (bf16 autocast, channels_last)' if device.type == 'cuda' else 'no-ops on the CPU'}, "
        f"{fast['concurrent_clients']} client(s) at once, eval batch {cfg.eval_batch_size}",
        f"plain: PNG decoded by a DataLoader ({cfg.workers} workers) every step, host per-sample MixStyle+AugMix "
        f"(numpy/PIL), fp32, clients in sequence, eval batch {cfg.batch_size}",
        "",
        "| figure | fast | plain | fast/plain |",
        "|---|---|---|---|",
    ]
    for r in rows:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['figure']} | {cell(r['fast'], r['fmt'])} | {cell(r['plain'], r['fmt'])} | {ratio} |")
    lines += [
        "",
        f"images/s count source images (each step also forwards their two augmented views); memory: {fast['memory']}",
        f"projected PACS sweep: 4 held-out domains x {PACS_ROUNDS} rounds x {PACS_EPOCHS} epochs, 6 clients, registry "
        f"counts, at the speeds measured here ({cfg.size} px, {cfg.backbone}, {device.type})"
        + ("" if cfg.size == 224 else "; NOT a 224 px figure unless run with --size 224"),
    ]
    for r in rows:
        if r["ratio"] is not None:
            lines.append(f"ratio fast/plain, {r['figure']}: {r['ratio']:.2f}")
    return "\n".join(lines)


def bench(cfg: BenchConfig) -> dict:
    from fedccrl_core.federation.engine import resolve_device

    device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    _log(f"generating {cfg.clients} clients x {cfg.images_per_client} images at {cfg.size} px")
    data = make_data(cfg)
    paths = [FastPath(cfg, data, device), PlainPath(cfg, data, device)]
    _log(f"measuring on {device}, {cfg.repeats} repeat(s)")
    results = measure(paths, cfg, device)
    fast, plain = results["fast"], results["plain"]
    rows = figures(fast, plain)
    table = render_table(cfg, device, fast, plain, rows)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"config": asdict(cfg), "device": str(device), "torch": torch.__version__, "loadavg": os.getloadavg(),
            "threads": torch.get_num_threads(), "fast": fast, "plain": plain,
            "figures": [{k: v for k, v in r.items() if k != "fmt"} for r in rows],
            "process_peak_rss_mib": peak_rss_mib, "table": table}
