"""`fedccrl-bench scale`: the cost of a round against the number of clients, the total data fixed
(FedDG-Bench sweeps the client count; the goal is at most 1.2x time and memory at 120
clients against 6).

Each (algorithm, client count) runs in its own child process (`python -m fedccrl_benchmarks.scale
--child ...`), so its peak RSS (getrusage ru_maxrss) is its own. The data is generated in memory:
`total` images of 6 classes at `size` px, dealt round-robin over 3 source domains and split evenly
over the clients (the partition stage and its lambda partition are not used here). Every client
trains each round (client_fraction 1.0): the work per round is the same at every client count,
so what grows with the count is per-client overhead. A child reports, per round, seconds split
into phases (uploads, local training incl. streamed Eq. 2, evaluation, checkpoint), the process's CPU
seconds per round (user + system: steadier than wall time on a shared machine), peak RSS and
the RSS after start-up (torch imported, data built), the checkpoint bytes of its last round and
the bytes sent.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import psutil

from fedccrl_benchmarks import children

CLIENT_COUNTS = (6, 30, 120, 300)
ALGORITHMS = ("fedavg", "fedccrl")


def _rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _synthetic_clients(spec: dict, local):
    """`spec["clients"]` clients of `spec["total"]` synthetic images (a class signal, three domains, each client one
    domain's images, with their statistics), and the evaluation sets of the first 256 images."""
    import numpy as np

    from fedccrl_core.data.pools import compute_statistics
    from fedccrl_core.federation.loop import EvalSets
    from fedccrl_core.learning.clients import ClientData

    rng = np.random.default_rng(0)
    n, size, k = spec["total"], spec["size"], spec["clients"]
    y = np.arange(n) % 6
    x = rng.integers(0, 120, (n, size, size, 3), dtype=np.uint8)
    x[np.arange(n), : size // 2, :, y % 3] += 100  # a class signal, so training is not pure noise
    domain = (np.arange(n) // 6) % 3
    order = np.argsort(domain, kind="stable")  # clients of one domain hold that domain's images
    mu, sigma = compute_statistics(x, local.mean, local.std)
    clients = []
    for i, idx in enumerate(np.array_split(order, k)):
        clients.append(
            ClientData.from_numpy(
                f"c{i:03d}", f"d{domain[idx[0]]}", x[idx], y[idx], x[idx[:1]], y[idx[:1]], "cpu", mu[idx], sigma[idx]
            )
        )
    return clients, EvalSets.for_target(clients, x[:256], y[:256], 256, "cpu")


def _timed_engine(phases: dict[str, float], written: dict[str, int]):
    """InProcessEngine with its parts timing their phase of the round into `phases` (seconds, summed) and the last
    checkpoint's bytes into `written`."""
    from fedccrl_core.federation.checkpoints import RoundCheckpoints
    from fedccrl_core.federation.engine import InProcessEngine, InProcessTransport
    from fedccrl_core.federation.loop import RoundLoop

    @contextlib.contextmanager
    def timed(name):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0

    # InProcessEngine's parts, each timing its phase of the round in an override of its own method (driver.py)
    class Transport(InProcessTransport):
        def collect_uploads(self, rnd, charged=None):
            with timed("uploads"):
                return super().collect_uploads(rnd, charged)

        def train(self, *args):
            with timed("train"):
                return super().train(*args)

    class Checkpoints(RoundCheckpoints):
        def save(self, *args):
            with timed("checkpoint"):
                written["bytes"] = super().save(*args)
            return written["bytes"]

    class Loop(RoundLoop):
        def evaluate(self, rnd, global_w):
            with timed("evaluate"):
                return super().evaluate(rnd, global_w)

    class Engine(InProcessEngine):
        transport_class, checkpoints_class, loop_class = Transport, Checkpoints, Loop

    return Engine


def child(spec: dict) -> dict:
    """One measurement, in this process: build the clients, run `rounds` rounds, report."""
    import torch

    from fedccrl_core.algorithm_params.train import LocalConfig
    from fedccrl_core.algorithms import build_algorithm
    from fedccrl_core.federation.driver import HeldOutRun, build_seeded_model, train

    torch.set_num_threads(spec["threads"])
    local = LocalConfig(rounds=spec["rounds"], local_epochs=1, batch_size=spec["batch_size"])
    clients, ev = _synthetic_clients(spec, local)
    alg = build_algorithm(spec["algorithm"], local)
    model = build_seeded_model(alg, "small_cnn", 6, "none", 0)
    rss_start = _rss_mib()
    phases: dict[str, float] = {}
    written = {"bytes": 0}  # the checkpoint bytes of the last round
    engine = _timed_engine(phases, written)

    with tempfile.TemporaryDirectory(prefix="fedccrl-bench-scale-") as tmp:
        run = HeldOutRun(
            alg,
            model,
            clients,
            ev,
            spec["rounds"],
            0,
            checkpoint_path=Path(tmp) / "ck.pt",
            client_state=spec["client_state"],
        )
        t0, c0 = time.perf_counter(), time.process_time()
        res = train(run, log=lambda m: None, engine=engine)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        ckpt_bytes = written["bytes"]
    h = res.history
    return {
        "seconds_per_round": seconds / len(h),
        "cpu_seconds_per_round": cpu / len(h),
        "phases": {k: v / len(h) for k, v in phases.items()},
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_start_mib": rss_start,
        "checkpoint_bytes": ckpt_bytes,
        "bytes_per_round": sum(r.bytes_up + r.bytes_down for r in h) / len(h),
    }


def measure(
    algorithm: str, clients: int, total: int, size: int, rounds: int, batch_size: int, threads: int, client_state: str
) -> dict:
    spec = {
        "algorithm": algorithm,
        "clients": clients,
        "total": total,
        "size": size,
        "rounds": rounds,
        "batch_size": batch_size,
        "threads": threads,
        "client_state": client_state,
    }
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return children.run_child(
        "fedccrl_benchmarks.scale", spec, f"bench scale child ({algorithm}, {clients} clients)", env
    )


def table(results: dict) -> str:
    head = (
        "| algorithm | clients | s/round | x6 | CPU s/round | x6 | train | uploads | eval | ckpt | peak RSS MiB "
        "| x6 | RSS above start MiB | ckpt bytes/round | bytes sent/round |"
    )
    lines = [head, "|---" * 15 + "|"]
    for alg, per in results.items():
        base = per[min(per)]
        for k, r in sorted(per.items()):
            ph = r["phases"]
            lines.append(
                f"| {alg} | {k} | {r['seconds_per_round']:.2f} | {r['seconds_per_round'] / base['seconds_per_round']:.2f} "
                f"| {r['cpu_seconds_per_round']:.2f} | {r['cpu_seconds_per_round'] / base['cpu_seconds_per_round']:.2f} "
                f"| {ph.get('train', 0):.2f} | {ph.get('uploads', 0):.2f} | {ph.get('evaluate', 0):.2f} "
                f"| {ph.get('checkpoint', 0):.2f} | {r['peak_rss_mib']:.0f} | {r['peak_rss_mib'] / base['peak_rss_mib']:.2f} "
                f"| {r['peak_rss_mib'] - r['rss_start_mib']:.0f} | {r['checkpoint_bytes']} "
                f"| {r['bytes_per_round']:.0f} |"
            )
    return "\n".join(lines)


def bench_scale(
    algorithms=ALGORITHMS,
    client_counts=CLIENT_COUNTS,
    total: int = 3840,
    size: int = 32,
    rounds: int = 2,
    batch_size: int = 32,
    threads: int = 1,
    client_state: str = "persistent",
    log=lambda m: print(m, file=sys.stderr, flush=True),
) -> dict:
    if total < max(client_counts):
        raise ValueError(f"--total {total} must be at least the largest client count {max(client_counts)}")
    results: dict = {}
    for alg in algorithms:
        for k in client_counts:
            t0 = time.perf_counter()
            results.setdefault(alg, {})[k] = measure(alg, k, total, size, rounds, batch_size, threads, client_state)
            log(
                f"bench scale: {alg} {k} clients: {results[alg][k]['seconds_per_round']:.2f} s/round "
                f"({time.perf_counter() - t0:.0f}s with start-up)"
            )
    return results


if __name__ == "__main__":
    children.child_main("fedccrl_benchmarks.scale", "fedccrl-bench scale", child)
