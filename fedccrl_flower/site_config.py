"""A site's join config, `site.toml`: everything its SuperNode needs, in one file (`fedccrl site join --config
site.toml`; `fedccrl site prepare --join-config site.toml` writes it), and the `flower-supernode` command line built
from it. Relative paths are read from the file's own folder, so the file works from any working directory:

    client_id = "art_c0"                     # the site's client id (its node config's client-id)
    site = "prepared"                        # its folder, `fedccrl site prepare --out`: shards/ and pools/
    state_dir = "state"                      # its optimizer state across rounds (a restarted SuperNode resumes)
    superlink = "superlink.example.org:8000" # the SuperLink's Fleet API, host:port
    root_certificates = "certs/ca.crt"       # the CA that signed the SuperLink's certificate (TLS) ...
    # insecure = true                        # ... or no TLS (loopback rehearsals only): exactly one of the two
    auth_private_key = "keys/site_art"       # optional: SuperNode authentication (the operator registers its .pub)
    port = 9094                              # optional: the SuperNode's own Runtime API port on 127.0.0.1
    device = "cpu"                           # optional: auto | cpu | cuda (default: the run's train.device)
    max_epsilon = 8.0                        # optional: answer only runs under train.privacy with max_epsilon <= 8
    max_delta = 1e-5                         # optional, with max_epsilon: at delta <= this (default 1e-5)
    max_study_epsilon = 24.0                 # optional, with max_epsilon: the sum of the max_epsilon of the runs it trains in

Every bad value is refused, naming the file and the key, before anything starts (`load_site_config`)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from fedccrl_core.foundation.errors import DataError
from fedccrl_core.foundation.records import Record, parse_record
from fedccrl_flower.node_config import (
    NODE_CLIENT_ID,
    NODE_DEVICE,
    NODE_MAX_DELTA,
    NODE_MAX_EPSILON,
    NODE_MAX_STUDY_EPSILON,
    NODE_POOLS,
    NODE_SHARDS,
    NODE_STATE_DIR,
    node_config_arg,
    unsafe_value,
)
from fedccrl_flower.settings import superlink_address

PATH_KEYS = ("site", "state_dir", "root_certificates", "auth_private_key")  # read from the file's folder
HEADER = "# This site's SuperNode: fedccrl site join --config <this file> (docs/flower.md); paths from this folder\n"


class SiteConfig(Record):
    client_id: str = Field(min_length=1)
    site: str = Field(min_length=1)
    state_dir: str = Field(min_length=1)
    superlink: str
    root_certificates: str | None = None
    insecure: bool = Field(False, validate_default=True)  # checked against root_certificates, given or not
    auth_private_key: str | None = None
    port: int | None = Field(None, ge=1, le=65535)
    device: Literal["auto", "cpu", "cuda"] | None = None
    max_epsilon: float | None = Field(
        None, gt=0, allow_inf_nan=False
    )  # the site's ceiling on a run's privacy (site_ceiling.py)
    max_delta: float | None = Field(None, gt=0, lt=1, allow_inf_nan=False)
    max_study_epsilon: float | None = Field(None, gt=0, allow_inf_nan=False)  # over runs (site_budget.py)

    @field_validator("client_id", "site", "state_dir")
    @classmethod
    def _fits_the_node_config(cls, v: str) -> str:
        why = unsafe_value(v)
        if why:
            raise ValueError(f"it {why}: the SuperNode's --node-config cannot carry it")
        return v

    @field_validator("superlink")
    @classmethod
    def _host_and_port(cls, v: str) -> str:
        return superlink_address(v)

    @field_validator("insecure")
    @classmethod
    def _tls_or_insecure(cls, v: bool, info: ValidationInfo) -> bool:
        if v == (info.data.get("root_certificates") is not None):
            raise ValueError(
                "give exactly one of root_certificates (TLS: the CA of the SuperLink's certificate) and "
                "insecure = true (no TLS: loopback rehearsals only)"
            )
        return v

    @field_validator("auth_private_key")
    @classmethod
    def _auth_over_tls(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("insecure"):  # Flower refuses it too, with exit code 303
            raise ValueError("SuperNode authentication needs TLS: give root_certificates, not insecure = true")
        return v

    @field_validator("max_delta", "max_study_epsilon")
    @classmethod
    def _with_epsilon(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v is not None and info.data.get("max_epsilon") is None:
            raise ValueError(f"{info.field_name} goes with max_epsilon, the ceiling of each run: give max_epsilon too")
        return v

    def resolved(self, base: Path) -> SiteConfig:
        """This config with its paths read from `base` (the config file's folder), absolute."""
        paths = {k: str(base / Path(v).expanduser()) for k in PATH_KEYS if (v := getattr(self, k)) is not None}
        return self.model_copy(update={k: os.path.normpath(v) for k, v in paths.items()})


def load_site_config(path: str | Path) -> SiteConfig:
    """The join config at `path`, its paths resolved from its folder and checked: the site folder holds the
    client's shard and statistics, the certificate and key are files, the state folder lies outside the site folder
    (`fedccrl site prepare` replaces that whole). DataError naming the file and the key otherwise."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: site config not found")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not TOML ({e})") from None
    cfg = parse_record(SiteConfig, data, str(path)).resolved(path.resolve().parent)
    check_site_files(cfg, str(path))
    return cfg


def check_site_files(cfg: SiteConfig, where: str, prepared: bool = True) -> None:
    """The files a resolved config names (`prepared=False`: the site folder is not written yet)."""
    site, cid = Path(cfg.site), cfg.client_id
    fix = f"prepare it with `fedccrl site prepare --client-id {cid} --out {site}`"
    for rel in ("shards/manifest.json", f"shards/{cid}.npz", f"pools/{cid}.npz") if prepared else ():
        if not (site / rel).is_file():
            raise DataError(f"{where}: key 'site': {site} has no {rel} (client_id {cid}): {fix}")
    for key in ("root_certificates", "auth_private_key"):
        value = getattr(cfg, key)
        if value is not None and not Path(value).is_file():
            raise DataError(f"{where}: key '{key}': {value} is not a file")
    state = Path(cfg.state_dir)
    if state.exists() and not state.is_dir():
        raise DataError(f"{where}: key 'state_dir': {state} exists and is not a folder")
    if state.resolve().is_relative_to(site.resolve()):
        raise DataError(f"{where}: key 'state_dir': {state} lies inside the site folder {site}, which prepare replaces")


def supernode_argv(cfg: SiteConfig, program: str = "flower-supernode") -> list[str]:
    """Flower's `flower-supernode` command line for a resolved config (docs/flower.md's TLS and walkthrough commands)."""
    argv = [program, "--superlink", cfg.superlink]
    argv += ["--insecure"] if cfg.insecure else ["--root-certificates", str(cfg.root_certificates)]
    if cfg.auth_private_key is not None:
        argv += ["--auth-supernode-private-key", cfg.auth_private_key]
    if cfg.port is not None:
        argv += ["--port", str(cfg.port)]
    node: dict[str, str | int | float | bool] = {
        NODE_CLIENT_ID: cfg.client_id,
        NODE_SHARDS: str(Path(cfg.site) / "shards"),
        NODE_POOLS: str(Path(cfg.site) / "pools"),
        NODE_STATE_DIR: cfg.state_dir,
    }
    if cfg.device is not None:
        node[NODE_DEVICE] = cfg.device
    if cfg.max_epsilon is not None:
        node[NODE_MAX_EPSILON] = cfg.max_epsilon
    if cfg.max_delta is not None:
        node[NODE_MAX_DELTA] = cfg.max_delta
    if cfg.max_study_epsilon is not None:
        node[NODE_MAX_STUDY_EPSILON] = cfg.max_study_epsilon
    return [*argv, "--node-config", node_config_arg(node)]


def site_config_text(cfg: SiteConfig, base: Path) -> str:
    """The TOML of a resolved `cfg` as a file in folder `base` (absolute) holds it: a path inside `base` relative."""
    import tomli_w

    data = cfg.model_dump(exclude_defaults=True)
    for key in PATH_KEYS:
        if key in data and Path(data[key]).is_relative_to(base):  # inside the folder: relative, else absolute
            data[key] = os.path.relpath(data[key], base)
    return HEADER + tomli_w.dumps(data)
