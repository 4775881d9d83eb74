"""`fedccrl-bench dispatch`: what one local step of the fast path asks of the host, from torch.profiler.

A GPU waits while the host dispatches operators, so the step's host cost is counted, not guessed:
  * operators dispatched per step: the aten operators that the Python code, autograd's backward and the optimizer
    call (the aten operators those call in turn are counted apart);
  * host milliseconds per step: the wall time of the step loop without the profiler, on CUDA without waiting for
    the device (the time the host needs to enqueue one step);
  * values read back per step (aten::_local_scalar_dense: `.item()`, `float(t)`, a Python `if` on a tensor). On an
    accelerator each one waits for the device. On the CPU, Adam's per-tensor loop reads its step counter, a CPU
    tensor, once per parameter (`fused` Adam on CUDA does not);
  * on CUDA: kernels launched per step, the GPU's kernel time per step and its busy share, kernel time over the
    wall time of the profiled steps.
FedCCRL's step is measured against FedAvg's on the same data, model and batch (cross-entropy on the clean view
only), in the same run: the ratio FedCCRL/FedAvg is what Eq. 3-16 (two augmented views, three forwards, three
losses) add. Each algorithm runs in its own child process (`python -m fedccrl_benchmarks.dispatch --child`).

`--code-path cuda` runs, on the CPU, the code the CUDA fast path runs (fastpath.enabled on: static batch shapes,
FedCCRL's views in one call, fused Adam, bf16 autocast; AugMix without the CPU's compaction), to count the
operators a GPU step dispatches where no GPU is. Its times are the CPU's, not a GPU's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import platform
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from fedccrl_benchmarks import children
from fedccrl_benchmarks.speed_timing import sync

ALGORITHMS = ("fedccrl", "fedavg")
READBACK = "aten::_local_scalar_dense"
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


@dataclass
class DispatchConfig:
    size: int = 32
    batch_size: int = 32
    images_per_client: int = 64
    backbone: str = "small_cnn"
    device: str = "auto"
    steps: int = 10
    warmup: int = 3
    threads: int = 0
    seed: int = 0
    code_path: str = "device"  # device: the device's own | cuda: the CUDA fast path's code on this device


def _log(msg: str) -> None:
    print(f"bench dispatch: {msg}", file=sys.stderr, flush=True)


def _steps(cfg: DispatchConfig, alg_name: str, device: torch.device):
    """An endless local-step generator of `alg_name` on client 0 of the speed bench's generated data, with
    train.fast on, every step a full batch (the epochs outnumber the steps asked for)."""
    from fedccrl_benchmarks.speed_config import BenchConfig
    from fedccrl_benchmarks.speed_data import make_data
    from fedccrl_benchmarks.speed_paths import fast_clients
    from fedccrl_core.algorithm_params.train import LocalConfig
    from fedccrl_core.algorithms import build_algorithm
    from fedccrl_core.foundation.seeding import torch_generator
    from fedccrl_core.learning.clients import ClientState

    data = make_data(
        BenchConfig(
            size=cfg.size, images_per_client=cfg.images_per_client, clients=3, batch_size=cfg.batch_size, seed=cfg.seed
        )
    )
    clients = fast_clients(data, device)
    per_epoch = clients[0].n_train // cfg.batch_size  # >= 1: checked before any child starts (bench)
    epochs = (cfg.warmup + 3 * cfg.steps) // per_epoch + 1  # warm-up, host, wall and profiled steps
    alg = build_algorithm(alg_name, LocalConfig(rounds=1, local_epochs=epochs, batch_size=cfg.batch_size, fast=True))
    payloads = alg.server_payloads(
        {c.client_id: alg.client_upload(c, np.random.default_rng(i)) for i, c in enumerate(clients)}
    )
    torch.manual_seed(cfg.seed)
    model = alg.build_model(cfg.backbone, data.num_classes, "none").to(device)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    keep = per_epoch * cfg.batch_size  # n_train a multiple of the batch: every measured step is a full one
    c0 = dataclasses.replace(clients[0], train_x=clients[0].train_x[:keep], train_y=clients[0].train_y[:keep])
    return alg.local_train_steps(
        model,
        c0,
        ClientState(),
        weights,
        payloads[c0.client_id],
        torch_generator(cfg.seed, "dispatch", device=device),
        np.random.default_rng(0),
    )


def child(cfg: DispatchConfig, alg_name: str) -> dict:
    from fedccrl_core.foundation import fastpath
    from fedccrl_core.foundation.fastpath import resolve_device

    device = resolve_device(cfg.device, "--device")
    # the CUDA fast path's code on this device (module docstring)
    on_cuda_code = cfg.code_path == "cuda" and device.type != "cuda"
    with fastpath.cuda_code_path() if on_cuda_code else contextlib.nullcontext():
        return _measure(cfg, alg_name, device)


def _measure(cfg: DispatchConfig, alg_name: str, device: torch.device) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    steps = _steps(cfg, alg_name, device)
    for _ in range(cfg.warmup):
        next(steps)
    sync(device)
    host = []
    for _ in range(cfg.steps):  # host time: enqueueing one step, without waiting for the device
        t0 = time.perf_counter()
        next(steps)
        host.append(time.perf_counter() - t0)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(cfg.steps):
        next(steps)
    sync(device)
    wall = time.perf_counter() - t0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(cfg.steps):
            next(steps)
        sync(device)
        profiled_wall = time.perf_counter() - t0
    steps.close()
    events = prof.events()
    n = cfg.steps
    every = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
    # dispatched by Python, autograd's backward or the optimizer: an aten operator not inside another one
    top = [e for e in every if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    counts: dict[str, int] = {}
    for e in top:
        counts[e.name] = counts.get(e.name, 0) + 1
    out = {
        "ops_per_step": len(top) / n,
        "nested_ops_per_step": (len(every) - len(top)) / n,
        "host_ms_per_step": 1e3 * float(np.median(host)),
        "readbacks_per_step": sum(1 for e in every if e.name == READBACK) / n,
        "images_per_s": n * cfg.batch_size / wall,
        "top_ops": sorted(((k, v / n) for k, v in counts.items()), key=lambda kv: -kv[1])[:12],
        "threads": torch.get_num_threads(),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
    }
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]  # kernels, copies and fills on the GPU
        kernel_s = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
        out.update(
            launches_per_step=sum(1 for e in events if e.name in LAUNCHES) / n,
            kernel_ms_per_step=1e3 * kernel_s / n,
            busy_share=min(kernel_s / profiled_wall, 1.0),
        )
    return out


def run_child(cfg: DispatchConfig, alg_name: str) -> dict:
    return children.run_child(
        "fedccrl_benchmarks.dispatch", {"cfg": asdict(cfg), "alg": alg_name}, f"bench dispatch child ({alg_name})"
    )


ROWS = (
    ("aten operators dispatched per step (forward, backward, optimizer)", "ops_per_step", "{:.0f}"),
    ("aten operators those call, per step", "nested_ops_per_step", "{:.0f}"),
    ("host ms per step (enqueueing, median)", "host_ms_per_step", "{:.2f}"),
    ("values read back to the host per step (aten::_local_scalar_dense)", "readbacks_per_step", "{:.1f}"),
    ("source images/s", "images_per_s", "{:.1f}"),
    ("CUDA kernels launched per step", "launches_per_step", "{:.0f}"),
    ("GPU kernel ms per step", "kernel_ms_per_step", "{:.2f}"),
    ("GPU busy share (kernel time / wall time)", "busy_share", "{:.0%}"),
)


def render(cfg: DispatchConfig, device: torch.device, results: dict[str, dict]) -> str:
    a, b = (results[n] for n in ALGORITHMS)
    lines = [
        f"fedccrl-bench dispatch: one local step, {cfg.backbone} (pretrained none), {cfg.size} px, batch "
        f"{cfg.batch_size}, train.fast on, {cfg.steps} steps after {cfg.warmup} warm-up steps, on {device} "
        + ("" if cfg.code_path == "device" or device.type == "cuda" else "running the CUDA fast path's code ")
        + f"({a['device_name']}, {a['threads']} threads; torch {torch.__version__}, {platform.machine()}), each "
        f"algorithm in its own child process",
        "",
        "| figure | FedCCRL | FedAvg | FedCCRL/FedAvg |",
        "|---|---|---|---|",
    ]
    for name, key, fmt in ROWS:
        if key not in a:
            continue
        ratio = "n/a" if not b.get(key) else f"{a[key] / b[key]:.2f}"
        lines.append(f"| {name} | {fmt.format(a[key])} | {fmt.format(b[key])} | {ratio} |")
    lines += ["", "FedCCRL's most dispatched operators per step: " + ", ".join(f"{k} {v:.0f}" for k, v in a["top_ops"])]
    for name, key, _ in ROWS:
        if key in a and b.get(key):
            lines.append(f"ratio FedCCRL/FedAvg, {name}: {a[key] / b[key]:.2f}")
    return "\n".join(lines)


def bench(cfg: DispatchConfig) -> dict:
    from fedccrl_core.foundation.fastpath import resolve_device

    device = resolve_device(cfg.device, "--device")
    if cfg.images_per_client < cfg.batch_size:
        raise ValueError(
            f"--images-per-client {cfg.images_per_client} holds no full batch of --batch-size "
            f"{cfg.batch_size}: every measured step is a full batch"
        )
    results = {}
    for name in ALGORITHMS:
        _log(f"{name}: {cfg.warmup} + 3 x {cfg.steps} steps on {device} in a child process")
        results[name] = run_child(cfg, name)
    return {
        "config": asdict(cfg),
        "device": str(device),
        "torch": torch.__version__,
        **results,
        "table": render(cfg, device, results),
    }


if __name__ == "__main__":
    children.child_main(
        "fedccrl_benchmarks.dispatch",
        "fedccrl-bench dispatch",
        lambda spec: child(DispatchConfig(**spec["cfg"]), spec["alg"]),
    )
