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

The modules: speed_config.py (BenchConfig), speed_data.py (the data), speed_paths.py (the three paths),
speed_timing.py (steps, rounds, the GPU's busy share), speed_table.py (figures, ratios, the PACS projection);
this one runs each path in its child process, keeps the fastest repeats and builds the result.

Floor 5 (docs/architecture.md, "Layers"): research tooling, imported by no product module."""

from __future__ import annotations

import os
import resource
from dataclasses import asdict

import numpy as np
import torch

from fedccrl_benchmarks import children
from fedccrl_benchmarks.speed_config import BenchConfig, log
from fedccrl_benchmarks.speed_data import make_data
from fedccrl_benchmarks.speed_paths import PATHS
from fedccrl_benchmarks.speed_table import figures, render_table


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
            log(
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


def bench(cfg: BenchConfig) -> dict:
    from fedccrl_core.foundation.fastpath import resolve_device

    device = resolve_device(cfg.device, "--device")
    log(
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
