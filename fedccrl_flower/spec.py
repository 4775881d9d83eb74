"""The ServerApp's run description (`ServerSpec`), sent as JSON in the Flower run config, and the part of it
every client receives in each CONFIG record (`client_spec`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fedccrl_core.foundation import contract
from fedccrl_core.foundation.runkey import params_hash
from fedccrl_flower.settings import FlowerSettings


@dataclass
class ServerSpec:
    """Everything the ServerApp needs; travels as JSON in the run config (`spec`)."""

    algorithm: str
    local: dict  # LocalConfig fields
    hparams: dict
    backbone: str
    num_classes: int
    seed: int
    held_out: str  # the held-out (target) domain
    shards: str  # server-side copy of the shards, for evaluation
    work_dir: str
    pretrained: str = "none"
    client_fraction: float = 1.0
    device: str = "auto"
    eval_batch_size: int = 256
    # params.yaml train.flower's waits (fedccrl_flower/settings.py declares each, with its default and meaning)
    min_clients: int = FlowerSettings.model_fields["min_clients"].default
    num_clients: int = FlowerSettings.model_fields["num_clients"].default  # 0: min_clients
    wait_for_clients_s: float = FlowerSettings.model_fields["wait_for_clients_s"].default
    query_timeout_s: float = FlowerSettings.model_fields["query_timeout_s"].default
    train_timeout_s: float = FlowerSettings.model_fields["train_timeout_s"].default
    timeout_factor: float = FlowerSettings.model_fields["timeout_factor"].default
    timeout_floor_s: float = FlowerSettings.model_fields["timeout_floor_s"].default
    checkpoint: str = ""  # "" = <work_dir>/checkpoint.pt
    client_state: str = "persistent"  # params.yaml train.client_state: persistent | stateless
    run_info: dict = field(default_factory=dict)

    FROM_SETTINGS = (
        "min_clients",
        "num_clients",
        "wait_for_clients_s",
        "query_timeout_s",
        "train_timeout_s",
        "timeout_factor",
        "timeout_floor_s",
    )  # the fields above, as train.flower gives them

    @property
    def rounds(self) -> int:
        return int(self.local["rounds"])

    @classmethod
    def from_dict(cls, d: dict) -> ServerSpec:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"server spec: unknown field(s) {unknown}")
        return cls(**d)

    def client_spec(self) -> dict:
        """The part a client needs (sent in every CONFIG record; no paths of the server). `state_key` names the
        clients' saved state: the params hash (fedccrl_core/foundation/runkey.py) of this part and the run info."""
        core = {
            "algorithm": self.algorithm,
            "local": self.local,
            "hparams": self.hparams,
            "backbone": self.backbone,
            "num_classes": self.num_classes,
            "seed": self.seed,
            "held_out": self.held_out,
            "device": self.device,
            "client_state": self.client_state,
        }
        return {**core, "state_key": params_hash({**core, "run_info": self.run_info})}


def report_dir(work_dir: str | Path, run_id: int) -> Path:
    """<work_dir>/run-<run id>/: one Flower run's rounds.jsonl, status.json, server.log and result.pt."""
    return contract.flower_report_dir(work_dir, run_id)
