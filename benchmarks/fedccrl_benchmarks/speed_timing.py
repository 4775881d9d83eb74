"""Timing of `fedccrl-bench speed`: seconds of local steps and of rounds, ending on the device's queued work, and
the GPU's busy share while rounds run (NVML).

Floor 5 (docs/architecture.md, "Layers"): research tooling, imported by no product module."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA): timings end on it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(steps, n_warm: int, n_timed: int, device) -> float:
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


def round_times(run_rounds, device, rounds: int) -> tuple[list[float], BusySampler]:
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
