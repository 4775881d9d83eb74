"""The settings of `fedccrl-bench speed` (`BenchConfig`, each default written once: speed_cli.py's options read
them), the PACS sweep it projects to, and its stderr log.

Floor 5 (docs/architecture.md, "Layers"): research tooling, imported by no product module."""

from __future__ import annotations

import sys
from dataclasses import dataclass

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


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)
