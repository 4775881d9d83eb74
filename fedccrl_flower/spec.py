"""The ServerApp's run description (`ServerSpec`), sent as JSON in the Flower run config, and the part of it
every client receives in each CONFIG record (`ClientSpec`). Each is parsed from its JSON once (`from_json`), where
it arrives, and handed on typed: the local training settings as a LocalConfig, the hyperparameters as the
algorithm's Params."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import Field, SerializeAsAny, ValidationInfo, field_validator, model_validator

from fedccrl_core.algorithm_params import PARAMS
from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.hparams import HParams
from fedccrl_core.foundation.records import Record, parse_record
from fedccrl_core.foundation.runkey import params_hash
from fedccrl_flower.settings import FlowerSettings

S = TypeVar("S", bound="_Spec")
_FLOWER = FlowerSettings()  # params.yaml train.flower's defaults


class _Spec(Record):
    """What both specs share: the algorithm, its local training settings and its hyperparameters."""

    algorithm: str
    local: LocalConfig  # train.* and preprocess mean, std
    hparams: SerializeAsAny[HParams]  # train.<algorithm>: the algorithm's Params

    @field_validator("algorithm")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in PARAMS:
            raise ValueError(f"one of {', '.join(PARAMS)}")
        return name

    @field_validator("hparams", mode="before")
    @classmethod
    def _the_algorithms_params(cls, v: object, info: ValidationInfo) -> HParams:
        params = PARAMS.get(info.data.get("algorithm", ""))
        if params is None:  # the algorithm itself is reported
            return HParams()
        return v if type(v) is params else params.model_validate(v)

    @classmethod
    def from_json(cls: type[S], text: str, where: str) -> S:
        """The spec in `text` (from `where`: a run config, a message); ValueError naming `where` and the key."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        return parse_record(cls, data, where, ValueError)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"))


class ClientSpec(_Spec):
    """The part of the ServerSpec a client needs (sent in every CONFIG record; no paths of the server)."""

    backbone: str
    num_classes: int
    seed: int
    held_out: str  # the held-out (target) domain
    device: str
    client_state: Literal["persistent", "stateless"]  # params.yaml train.client_state
    eval_batch_size: int  # a site's evaluation batches (evalsets.py)
    state_key: str  # names the clients' saved state (ServerSpec.client_spec)
    run_key: str = ""  # names the run: the hash of the ServerSpec's run_info (a site pins its held_out by it)
    classes: list[str] = Field(default_factory=list)  # the federation's, which a site's data must have ([]: any)
    image_size: int = Field(0, ge=0)  # the federation's, which a site's data must have (0: any)
    domains: list[str] = Field(default_factory=list)  # the federation's, one of which is a site's ([]: unchecked)


class ReportTo(Record):
    """Where the ServerApp reports a run besides its work folder (tracked_report.py): the team's MLflow tracking
    server, which the operator and the SuperLink's host both reach, and the MLflow run (the operator's child run)."""

    tracking_uri: str = Field(min_length=1)
    run_id: str = Field(min_length=1)

    @field_validator("tracking_uri")
    @classmethod
    def _absolute_store(cls, uri: str) -> str:
        """A local store named by a relative path (`sqlite:///mlflow.db`, `./mlruns`) made absolute where the spec is
        made, the operator's folder: the ServerApp reads the spec in a folder of its own. Idempotent."""
        sqlite = "sqlite:///"
        if uri.startswith(sqlite) and not uri.startswith(sqlite + "/") and uri != sqlite + ":memory:":
            return sqlite + str(Path(uri.removeprefix(sqlite)).resolve())
        if "://" not in uri and not uri.startswith("file:"):
            return str(Path(uri).resolve())
        return uri


class ServerSpec(_Spec):
    """Everything the ServerApp needs; travels as JSON in the run config (`spec`)."""

    backbone: str
    num_classes: int
    seed: int
    held_out: str  # the held-out (target) domain
    sources: list[str] = Field(min_length=1)  # the run's source clients (sites that train), in manifest order
    evaluators: list[str] = Field(default_factory=list)  # sites holding only the held-out domain: evaluate only
    work_dir: str
    pretrained: str = "none"
    client_fraction: float = 1.0
    device: str = "auto"
    eval_batch_size: int = 256
    # params.yaml train.flower's waits (fedccrl_flower/settings.py declares each, with its default and meaning)
    min_clients: int = _FLOWER.min_clients
    num_clients: int = _FLOWER.num_clients  # 0: min_clients
    wait_for_clients_s: float = _FLOWER.wait_for_clients_s
    query_timeout_s: float = _FLOWER.query_timeout_s
    train_timeout_s: float = _FLOWER.train_timeout_s
    timeout_factor: float = _FLOWER.timeout_factor
    timeout_floor_s: float = _FLOWER.timeout_floor_s
    checkpoint: str = ""  # "" = <work_dir>/checkpoint.pt
    client_state: Literal["persistent", "stateless"] = "persistent"  # params.yaml train.client_state
    run_info: dict[str, Any] = Field(default_factory=dict)
    classes: list[str] = Field(default_factory=list)  # the federation's class list, in label order ([]: unchecked)
    image_size: int = Field(0, ge=0)  # the federation's image size (0: unchecked); each site checks its data
    domains: list[str] = Field(default_factory=list)  # the federation file's domains ([]: unchecked), held_out one
    report_to: ReportTo | None = None  # None: the launcher reads the work folder (it shares the ServerApp's disk)

    FROM_SETTINGS: ClassVar[tuple[str, ...]] = (
        "min_clients",
        "num_clients",
        "wait_for_clients_s",
        "query_timeout_s",
        "train_timeout_s",
        "timeout_factor",
        "timeout_floor_s",
    )  # the fields above, as train.flower gives them

    @model_validator(mode="after")
    def _held_out_of_the_federation(self) -> ServerSpec:
        if self.domains and self.held_out not in self.domains:
            raise ValueError(f"held_out '{self.held_out}' is not one of the federation's domains {self.domains}")
        return self

    @property
    def rounds(self) -> int:
        return self.local.rounds

    def client_spec(self) -> ClientSpec:
        """The part a client needs. `state_key` names the clients' saved state: the params hash
        (fedccrl_core/foundation/runkey.py) of this part and the run info; `run_key` the run, whatever this part
        says: the params hash of the run info alone."""
        spec = ClientSpec(
            algorithm=self.algorithm,
            local=self.local,
            hparams=self.hparams,
            backbone=self.backbone,
            num_classes=self.num_classes,
            seed=self.seed,
            held_out=self.held_out,
            device=self.device,
            client_state=self.client_state,
            eval_batch_size=self.eval_batch_size,
            state_key="",
            classes=self.classes,
            image_size=self.image_size,
            domains=self.domains,
        )
        core = spec.model_dump(exclude={"state_key", "run_key"})
        return spec.model_copy(
            update={
                "state_key": params_hash({**core, "run_info": self.run_info}),
                "run_key": params_hash(self.run_info),
            }
        )


class SiteEvalSpec(Record):
    """What the ServerApp of an evaluation-only run needs; travels as JSON in the run config (RUN_SPEC). The model
    file comes one of two ways: `model_file`, a path the ServerApp reads (it shares the operator's disk: one
    machine), or `model_artifact`, an artifact of the MLflow run `report_to` names on the team's tracking server
    (the operator logged it there; site_evaluation.py read_model downloads it). Either way its bytes must have `model_sha256`;
    with `report_to`, the ServerApp also reports its status and outcome to that run (tracked_report.py)."""

    model_file: str = ""
    model_artifact: str = ""  # the model file's path among the artifacts of report_to's run
    model_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    client_spec: str  # the ClientSpec JSON every site receives: the model's architecture, classes, image size, ...
    splits: dict[str, str] = Field(min_length=1)  # {client id asked: "val" | "all"}
    work_dir: str
    wait_for_clients_s: float
    reply_timeout_s: float
    report_to: ReportTo | None = None  # None: the launcher reads the work folder (it shares the ServerApp's disk)

    @model_validator(mode="after")
    def _one_model(self) -> SiteEvalSpec:
        if bool(self.model_file) == bool(self.model_artifact):
            raise ValueError("give exactly one of model_file (a path) and model_artifact (an MLflow artifact)")
        if self.model_artifact and self.report_to is None:
            raise ValueError("model_artifact names an artifact of report_to's MLflow run, but report_to is not given")
        return self

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"))


def report_dir(work_dir: str | Path, run_id: int) -> Path:
    """<work_dir>/run-<run id>/: one Flower run's rounds.jsonl, status.json, server.log and result.pt."""
    return contract.flower_report_dir(work_dir, run_id)
