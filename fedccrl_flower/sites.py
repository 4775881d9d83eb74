"""The federation file: what the operator of a deployment knows about its sites without holding their data
(`fedccrl federate --federation <file>`). One JSON object:

    dataset, domains (in the dataset's order), classes (in label order), image_size, resize_policy: the values every
        site's shards share (a site's shards/manifest.json has the same ones);
    sites: [{"id": <client id>, "domain": <domain>}, ...]: one entry per SuperNode (its node config's client-id);
        optionally "node_id": the SuperLink's node id of the site's registered key (`flwr supernode register`
        prints it), which `fedccrl federation status` looks up; it is not part of a run's key (run_description).

For a run that holds out domain D, the sites of the other domains are its sources (they train and validate) and
the sites of D its evaluation sites (they evaluate the held-out domain and never train): ServerSpec.sources and
.evaluators. `federation_of(manifest)` writes the file of a central partition (the one-machine rehearsal)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import field_validator, model_validator

from fedccrl_core.foundation.errors import DataError
from fedccrl_core.foundation.records import Record, parse_record


class Site(Record):
    id: str
    domain: str
    node_id: str | None = None  # the SuperLink's node id of the site's registered public key

    @field_validator("node_id")
    @classmethod
    def _digits(cls, v: str | None) -> str | None:
        if v is not None and not v.isdigit():
            raise ValueError(f"a node id is a number as `flwr supernode register` prints it, got {v!r}")
        return v


class FederationFile(Record):
    dataset: str
    domains: list[str]
    classes: list[str]
    image_size: int
    resize_policy: str
    sites: list[Site]

    @model_validator(mode="after")
    def _sites_of_known_domains(self) -> FederationFile:
        ids = [s.id for s in self.sites]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a site id appears twice in {ids}")
        for s in self.sites:
            if s.domain not in self.domains:
                raise ValueError(f"site {s.id}: domain '{s.domain}' is not one of {self.domains}")
        return self

    def held_out(self, entry: str | int) -> str:
        """A held-out domain given by name or by index (as train.held_out gives it) -> its name."""
        if isinstance(entry, int) or entry.isdigit():
            i = int(entry)
            if not 0 <= i < len(self.domains):
                raise ValueError(f"held-out index {i} is out of range: domains {self.domains}")
            return self.domains[i]
        if entry not in self.domains:
            raise ValueError(f"held-out domain '{entry}' is not one of {self.domains}")
        return entry

    def run_description(self) -> dict:
        """The file as a run's key sees it: what the sites train on, without who connects (their node ids)."""
        return self.model_dump(by_alias=True, exclude_unset=True, exclude={"sites": {"__all__": {"node_id"}}})

    def sources(self, held_out: str) -> list[str]:
        return [s.id for s in self.sites if s.domain != held_out]

    def evaluators(self, held_out: str) -> list[str]:
        return [s.id for s in self.sites if s.domain == held_out]


def read_federation(path: str | Path) -> FederationFile:
    """The federation file at `path`; DataError naming the file (and the key) when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: federation file not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not JSON ({e})") from e
    return parse_record(FederationFile, data, str(path))


def federation_of(manifest) -> FederationFile:
    """The federation file of a central partition's ShardManifest: one site per client (single-domain clients)."""
    if any(c.domain not in manifest.domains for c in manifest.clients):
        raise DataError("a federation file names one domain per site; this partition has mixed-domain clients")
    return FederationFile(
        dataset=manifest.dataset,
        domains=list(manifest.domains),
        classes=list(manifest.classes),
        image_size=manifest.image_size,
        resize_policy=manifest.resize,
        sites=[Site(id=c.id, domain=c.domain) for c in manifest.clients],
    )


def federation_sites(shards: str | Path, held_out: str) -> tuple[list[str], list[str]]:
    """(source clients, evaluation-only sites) of a run that holds out `held_out`, from a shard manifest (the
    research rehearsal's central partition, mixed-domain clients included): ServerSpec.sources and .evaluators."""
    from fedccrl_core.data.manifest import client_ids, evaluation_sites, load_manifest

    manifest = load_manifest(shards)
    return client_ids(manifest, held_out), evaluation_sites(manifest, held_out)
