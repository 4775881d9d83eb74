"""Several clients' local training interleaved step by step (DESIGN 'Speed': run several clients
concurrently when one client's batch of 32 cannot fill the GPU).

Each client of a wave gets its own model copy, its own CUDA stream (None on the CPU) and its own
copy of the global random states (torch CPU and CUDA, numpy, Python `random`). The driver runs
`Algorithm.local_train_steps` generators round-robin, one optimizer step at a time: while the host
enqueues client B's step on stream B, the GPU still runs client A's kernels on stream A. A client's
global random state is swapped in before each of its steps and saved after, so every client sees
exactly the draws it would see running alone: on the CPU the interleaved replies equal the
sequential ones bit for bit (tests/test_bench.py), which is how this code is tested without a GPU.

Streams: a wave's streams first wait for the current stream (the global weights and the shards were
written there) and the current stream waits for all of them at the end of the wave (aggregation
reads the replies there). Every tensor that crosses streams is written before one of these waits
and freed only after the next one, so the caching allocator never hands out memory still in use.


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass

import numpy as np
import torch

from fedccrl_core.foundation.seeding import seed_everything


@dataclass
class GlobalRng:
    """The global random states a training step may draw from."""

    torch_cpu: torch.Tensor
    torch_cuda: torch.Tensor | None
    numpy: tuple | dict  # np.random.get_state()
    python: tuple

    @classmethod
    def capture(cls, device: torch.device) -> GlobalRng:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None  # host-side state: no sync
        return cls(torch.get_rng_state(), cuda, np.random.get_state(), random.getstate())

    def restore(self, device: torch.device) -> None:
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda is not None:
            torch.cuda.set_rng_state(self.torch_cuda, device)
        np.random.set_state(self.numpy)
        random.setstate(self.python)


@dataclass
class Task:
    """One client's local training: `start(model)` returns its `local_train_steps` generator;
    `seed` seeds the global random states first (as the sequential engine does)."""

    client_id: str
    seed: int
    start: Callable[[torch.nn.Module], Generator]


@dataclass
class _Slot:
    task: Task
    steps: Generator
    stream: torch.cuda.Stream | None
    rng: GlobalRng
    done: bool = False
    reply: object = None


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class Interleaver:
    """Runs tasks `width` at a time; keeps its model replicas and streams across rounds."""

    def __init__(self, model: torch.nn.Module, width: int, device: torch.device):
        if width < 1:
            raise ValueError(f"concurrent clients must be >= 1, got {width}")
        self.device = torch.device(device)
        self.models = [model] + [copy.deepcopy(model) for _ in range(width - 1)]
        cuda = self.device.type == "cuda"
        self.streams = [torch.cuda.Stream(self.device) if cuda else None for _ in range(width)]

    @property
    def width(self) -> int:
        return len(self.models)

    def run(self, tasks: list[Task]) -> list:
        """Replies in the order of `tasks` (the order aggregation sums them in)."""
        replies = {}
        for w in range(0, len(tasks), self.width):
            for slot in self._run_wave(tasks[w : w + self.width]):
                replies[slot.task.client_id] = slot.reply
        return [replies[t.client_id] for t in tasks]

    def _run_wave(self, wave: list[Task]) -> list[_Slot]:
        current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        slots = []
        for task, model, stream in zip(wave, self.models, self.streams):
            if stream is not None and current is not None:  # both exist on CUDA only
                stream.wait_stream(current)
            seed_everything(task.seed)
            slots.append(_Slot(task, task.start(model), stream, GlobalRng.capture(self.device)))
        active = slots
        while active:
            for slot in active:
                slot.rng.restore(self.device)
                with _on(slot.stream):
                    try:
                        next(slot.steps)
                    except StopIteration as finished:
                        slot.done, slot.reply = True, finished.value
                slot.rng = GlobalRng.capture(self.device)
            active = [s for s in active if not s.done]
        if current is not None:
            for slot in slots:
                if slot.stream is not None:  # always on CUDA
                    current.wait_stream(slot.stream)
        slots[-1].rng.restore(self.device)  # what the sequential engine leaves: the last client's final state
        return slots
