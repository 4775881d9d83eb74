"""`fedccrl-bench int8`: the INT8 copy of an export (pipeline/fedccrl_pipeline/quantize.py, what `fedccrl export`
writes with export.int8) against its float32 model, side by side in one run on this CPU: file size, batch-1 latency,
batch-32 images/s and held-out accuracy, for the trained default model and for torchvision's MobileNetV3-Large.

MobileNetV3-Large has seeded random weights (no network here: no ImageNet download), so its accuracy is chance
and its row measures size and speed; its inputs are the held-out images resized to --size. Both models are
calibrated as export calibrates: on the shards' source-domain training images. The float32 and INT8 sessions are
timed alternately (a shared machine's load falls on both), and the time of each operator type at batch 32 says
what limits the INT8 model.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import click
import numpy as np

BATCH = 32
TARGET_SPEED, TARGET_SIZE = 2.0, 1 / 3  # the target on MobileNetV3-Large: >= 2x images/s, <= 1/3 the size


def machine() -> str:
    """The CPU's model name, its SIMD extensions that INT8 kernels use, and its core count."""
    name, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    isa: list[str] = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    isa = isa or ["no AVX2"]
    return f"{name} ({', '.join(isa)}), {os.cpu_count()} cores"


def _batch_seconds(session, x: np.ndarray, runs: int = 1) -> float:
    """Seconds per run of `runs` runs in a row (a small model's run is too short to time alone)."""
    t0 = time.perf_counter()
    for _ in range(runs):
        session.run(None, {"images": x})
    return (time.perf_counter() - t0) / runs


def timings(sessions: dict, x32: np.ndarray, repeats: int) -> dict:
    """Median batch-1 latency (ms) and batch-32 images/s of each session, the sessions timed in turn each round."""
    one = x32[:1]
    runs = {}
    for k, s in sessions.items():  # warm-up (first-run allocations, kernel choice); each sample lasts >= 0.1 s
        _batch_seconds(s, one)
        runs[k] = max(1, int(0.1 / _batch_seconds(s, x32, 2)))
    b32: dict = {k: [] for k in sessions}
    b1: dict = {k: [] for k in sessions}
    for _ in range(repeats):
        for k, s in sessions.items():
            b32[k].append(_batch_seconds(s, x32, runs[k]))
            b1[k] += [_batch_seconds(s, one) for _ in range(10)]
    return {
        k: {"batch1_ms": 1e3 * statistics.median(b1[k]), "batch32_ips": BATCH / statistics.median(b32[k])}
        for k in sessions
    }


def operator_shares(path: Path, x32: np.ndarray, threads: int) -> list[tuple[str, float]]:
    """Share of kernel time by operator type of a warm batch-32 run (onnxruntime's profiler), largest first."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = threads
    opts.enable_profiling = True
    opts.profile_file_prefix = str(path.parent / "profile")
    session = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    for _ in range(3):
        session.run(None, {"images": x32})
    events = json.loads(Path(session.end_profiling()).read_text())
    last = max(e["ts"] for e in events if e.get("name") == "model_run")  # the last run: warm
    times: collections.Counter = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= last:
            times[e["args"]["op_name"]] += e["dur"]
    total = sum(times.values()) or 1
    return [(op, t / total) for op, t in times.most_common()]


def measure(model, meta, test, calibration, workdir: Path, threads: int, repeats: int) -> dict:
    """Export `model` (float32), quantize it as export does, and measure both."""
    from fedccrl_pipeline.onnx_export import export_onnx
    from fedccrl_pipeline.onnx_parity import cpu_session
    from fedccrl_pipeline.quantize import accuracy, quantize, read_metadata

    f32, i8 = workdir / f"{meta.backbone}.onnx", workdir / f"{meta.backbone}.int8.onnx"
    export_onnx(model, meta, f32)
    quantize(f32, i8, *calibration)
    sessions = {"float32": cpu_session(f32, threads), "int8": cpu_session(i8, threads)}
    smeta = read_metadata(f32)
    x32 = np.random.default_rng(0).standard_normal((BATCH, 3, meta.image_size, meta.image_size)).astype(np.float32)
    out = timings(sessions, x32, repeats)
    for k, path in (("float32", f32), ("int8", i8)):
        out[k]["mb"] = path.stat().st_size / 1e6
        out[k]["accuracy"] = 100 * accuracy(sessions[k], test[0], test[1], smeta, BATCH)
        out[k]["ops"] = operator_shares(path, x32, threads)
    return out


def _resized(images: np.ndarray, size: int) -> np.ndarray:
    from PIL import Image

    from fedccrl_core.data.images import resize_u8

    return np.stack([resize_u8(Image.fromarray(im), size) for im in images]) if images.shape[1] != size else images


def rows(model_path: Path, shards: Path, size: int, n_calib: int, threads: int, repeats: int) -> dict:
    """{(backbone, weights, size): measure(...)} for the trained model and for MobileNetV3-Large."""
    import torch

    from fedccrl_core.algorithms import load_model
    from fedccrl_core.data.shards import load_domain_test
    from fedccrl_core.learning.models import build_model
    from fedccrl_pipeline.quantize import calibration_set

    model, meta = load_model(model_path)
    meta.require(model_path, "held_out_domain")
    assert meta.held_out_domain is not None
    test = load_domain_test(shards, meta.held_out_domain)
    calib, domains = calibration_set(shards, meta.held_out_domain, n_calib)
    results = {}
    with tempfile.TemporaryDirectory(prefix="fedccrl-bench-int8-") as tmp:
        trained = f"trained ({model_path.parent})"
        results[(meta.backbone, trained, meta.image_size)] = measure(
            model, meta, test, (calib, domains), Path(tmp), threads, repeats
        )
        torch.manual_seed(0)
        mnv3 = build_model("mobilenet_v3_large", meta.num_classes, "none")
        meta3 = meta.model_copy(update={"backbone": "mobilenet_v3_large", "image_size": size})
        resized = (_resized(test[0], size), test[1])
        results[("mobilenet_v3_large", "random, seed 0", size)] = measure(
            mnv3, meta3, resized, (_resized(calib, size), domains), Path(tmp), threads, repeats
        )
    return results


def _per_image_ms(side: dict, ops: tuple[str, ...]) -> float:
    """Milliseconds per image at batch 32 spent in `ops` (their profiled share of the timed batch)."""
    return 1e3 / side["batch32_ips"] * sum(share for op, share in side["ops"] if op in ops)


def report(results: dict, threads: int, n_calib: int) -> list[str]:
    import onnxruntime

    lines = [
        f"INT8 (QDQ, per channel, {n_calib} source-domain calibration images) against float32: onnxruntime "
        f"{onnxruntime.__version__} CPUExecutionProvider, {threads} thread(s), {machine()}",
        "| backbone | input | weights | precision | file MB | batch-1 ms | batch-32 images/s | held-out accuracy % |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for (backbone, weights, size), r in results.items():
        for k in ("float32", "int8"):
            m = r[k]
            lines.append(
                f"| {backbone} | {size} px | {weights} | {k} | {m['mb']:.3f} | {m['batch1_ms']:.2f} | "
                f"{m['batch32_ips']:.1f} | {m['accuracy']:.2f} |"
            )
    for (backbone, _, _), r in results.items():
        f, q = r["float32"], r["int8"]
        lines.append(
            f"ratio int8/float32, {backbone}: file size {q['mb'] / f['mb']:.2f}x  batch-32 images/s "
            f"{q['batch32_ips'] / f['batch32_ips']:.2f}x  batch-1 latency {q['batch1_ms'] / f['batch1_ms']:.2f}x  "
            f"accuracy {q['accuracy'] - f['accuracy']:+.2f} points"
        )
    for (backbone, _, _), r in results.items():
        for k in ("float32", "int8"):
            top = ", ".join(f"{op} {100 * share:.0f} %" for op, share in r[k]["ops"][:6])
            lines.append(f"time by operator at batch 32, {backbone} {k}: {top}")
    for (backbone, _, _), r in results.items():
        conv = {k: _per_image_ms(r[k], ("Conv", "QLinearConv", "FusedConv")) for k in ("float32", "int8")}
        rest = {k: 1e3 / r[k]["batch32_ips"] - conv[k] for k in conv}
        lines.append(
            f"ms per image at batch 32, {backbone}: convolutions float32 {conv['float32']:.3f} / int8 "
            f"{conv['int8']:.3f}, everything else float32 {rest['float32']:.3f} / int8 {rest['int8']:.3f}"
        )
    r = next(r for (b, _, _), r in results.items() if b == "mobilenet_v3_large")
    speed = r["int8"]["batch32_ips"] / r["float32"]["batch32_ips"]
    size_ratio = r["int8"]["mb"] / r["float32"]["mb"]
    lines.append(
        f"target on mobilenet_v3_large: images/s at batch 32 >= {TARGET_SPEED:g}x "
        f"({'met' if speed >= TARGET_SPEED else 'not met'}: {speed:.2f}x), size <= 1/3 "
        f"({'met' if size_ratio <= TARGET_SIZE else 'not met'}: {size_ratio:.2f}x)"
    )
    return lines


@click.command("int8")
@click.option(
    "--model",
    "model_path",
    type=click.Path(path_type=Path),
    default=Path("models/fedccrl/s0/d3/model.pt"),
    show_default=True,
    help="a trained model.pt (make repro's FedCCRL run, held-out sketch)",
)
@click.option("--shards", type=click.Path(path_type=Path), default=Path("data/shards"), show_default=True)
@click.option("--size", type=click.IntRange(min=32), default=224, show_default=True, help="MobileNetV3-Large input px")
@click.option("--calibration-images", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="onnxruntime intra-op")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True)
def command(model_path, shards, size, calibration_images, threads, repeats):
    """INT8 against float32 on this CPU: size, latency, images/s, held-out accuracy (default model, MobileNetV3-L)."""
    from fedccrl_core.foundation.errors import FedCCRLError

    if model_path.is_dir():
        model_path = model_path / "model.pt"
    if not model_path.is_file():
        raise click.UsageError(f"{model_path}: no trained model (run `make repro` first, or give --model)")
    try:
        results = rows(model_path, shards, size, calibration_images, threads, repeats)
    except FedCCRLError as e:
        raise click.ClickException(str(e)) from e
    click.echo("\n".join(report(results, threads, calibration_images)))
