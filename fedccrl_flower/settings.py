"""params.yaml `train.flower.*`: the Flower engine's settings, declared once (typed, with bounds). No torch and no
flwr here: every stage validates params.yaml with this model before it does any work (pipeline/fedccrl_pipeline/params.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fedccrl_core.foundation.hparams import Declared


def superlink_address(v: str) -> str:
    """A SuperLink's address as every setting of one spells it (train.flower.superlink, deploy.superlink, a site's
    site.toml): host:port, the port in 1-65535, without a URL prefix; ValueError otherwise."""
    host, _, port = v.rpartition(":")
    if "://" in v or not host or any(c.isspace() for c in host) or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError("must be host:port, without a URL prefix (e.g. superlink.example.org:9093)")
    return v


class FlowerSettings(Declared):
    """params.yaml `train.flower.*`."""

    mode: Literal["deployment", "simulation"] = Field("deployment", description="deployment | simulation")
    superlink: str = Field(
        "", description='"" = start a local SuperLink (and SuperNodes) on 127.0.0.1; host:port = an existing SuperLink'
    )
    root_certificates: str = Field("", description='CA certificate of an external SuperLink (TLS); "" = --insecure')
    min_clients: int = Field(2, ge=1, description="fewest clients a round may aggregate")
    num_clients: int = Field(0, ge=0, description="SuperNodes to wait for before round 1 (0 = every source client)")
    wait_for_clients_s: float = Field(120.0, gt=0)
    query_timeout_s: float = Field(300.0, gt=0, description="wait for uploads, until a query reply time is measured")
    train_timeout_s: float = Field(
        600.0, gt=0, description="wait for local training, until a train reply time is measured"
    )
    timeout_factor: float = Field(
        3.0,
        ge=1,
        description="once measured, a phase waits max(timeout_floor_s, "
        "timeout_factor x the slowest reply of that phase so far)",
    )
    timeout_floor_s: float = Field(30.0, gt=0, description="the shortest wait of a measured phase")
    run_timeout_s: float = Field(0.0, ge=0, description="whole run (0 = no limit)")
    client_cpus: int = Field(1, ge=1, description="simulation: whole CPUs per ClientApp (Ray; Flower's uint32)")
    client_gpus: float = Field(0.0, ge=0, description="simulation: GPUs per ClientApp (e.g. 0.25 = 4 per GPU)")
    ray_cpus: int = Field(0, ge=0, description="simulation: CPUs Ray may use (0 = all)")
    client_threads: int = Field(
        0, ge=0, description="local deployment: torch threads per SuperNode (0 = cores / SuperNodes)"
    )

    @field_validator("superlink")
    @classmethod
    def _superlink_address(cls, v: str) -> str:
        return superlink_address(v) if v else v  # "": a local SuperLink

    @field_validator("superlink")
    @classmethod
    def _superlink_is_for_deployment(cls, v, info):
        if v and info.data.get("mode") == "simulation":
            raise ValueError("superlink is for deployment; simulation starts its own SuperLink")
        return v

    def require_clients(self, n_sources: int, held_out: str) -> None:
        """A federation that can never reach min_clients is refused before anything starts."""
        if self.min_clients > n_sources:
            raise ValueError(
                f"params.yaml: train.flower.min_clients is {self.min_clients} but held-out {held_out} "
                f"leaves {n_sources} source clients"
            )
