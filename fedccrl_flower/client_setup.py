"""What every ClientApp handler sets up from its message (client_app.py, site_eval_client.py): the spec of the CONFIG
record, the device, the algorithm and a model of the server's architecture (cached per process: site_data.py CACHE),
and its line in the SuperNode's log."""

from __future__ import annotations

import os
import time

import torch
from flwr.app import ConfigRecord, Context, Message

from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.algorithms.base import Algorithm
from fedccrl_core.foundation.fastpath import resolve_device
from fedccrl_core.learning.models import FedModel
from fedccrl_flower import messages as M
from fedccrl_flower.site_data import CACHE, setting
from fedccrl_flower.spec import ClientSpec


def say(msg: str, t0: float) -> None:
    """One line in the SuperNode's log: what was done, in how long, and how old this process is
    (in deployment Flower starts a fresh ClientApp process per message; its start-up shows here)."""
    try:
        import psutil

        age = f", process age {time.time() - psutil.Process().create_time():.1f}s"
    except Exception:
        age = ""
    print(f"{time.strftime('%H:%M:%S')} {msg} in {time.perf_counter() - t0:.1f}s (pid {os.getpid()}{age})", flush=True)


def device_of(context: Context, spec: ClientSpec) -> torch.device:
    return resolve_device(setting(context, M.NODE_DEVICE) or spec.device)


def build_client_algorithm(spec: ClientSpec, device: torch.device) -> tuple[Algorithm, FedModel]:
    """The algorithm and a model of the server's architecture (weights always come from the server)."""
    key = ("alg", spec.to_json(), str(device))
    if key not in CACHE:
        alg = build_algorithm(spec.algorithm, spec.local, spec.hparams)
        model = alg.build_model(spec.backbone, spec.num_classes, "none", alg.hp).to(device)
        CACHE[key] = (alg, model)
    return CACHE[key]


def read_config(msg: Message) -> tuple[ClientSpec, int, ConfigRecord]:
    """The CONFIG record's spec (parsed and checked here, once), round and the record itself."""
    cfg = M.record(msg.content, M.CONFIG, ConfigRecord)
    return ClientSpec.from_json(str(cfg[M.F_SPEC]), f"CONFIG record '{M.F_SPEC}'"), int(cfg[M.F_ROUND]), cfg  # type: ignore[arg-type]  # the server's int
