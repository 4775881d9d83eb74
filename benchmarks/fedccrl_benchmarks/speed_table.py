"""The figures and table of `fedccrl-bench speed`: each path's figures, the fast path's ratios to the plain ones,
and the projection of a full PACS sweep at the measured speeds.

Floor 5 (docs/architecture.md, "Layers"): research tooling, imported by no product module."""

from __future__ import annotations

import os
import platform

import torch

from fedccrl_benchmarks.speed_config import PACS_EPOCHS, PACS_ROUNDS, PACS_VAL_FRACTION, BenchConfig


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
