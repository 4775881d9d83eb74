"""A site's data behind the ClientApp: which client this SuperNode is (`resolve_client_id`, from the node config or
Flower's partition-id), its data checked against the federation's values the spec carries (`check_site_data`), and
its rows loaded (`load_client_data` for training, `load_eval_data` for the evaluation; `is_source`: whether it trains),
and its statistics release checked against what the server's pre-round check charged (`release_refusal`).
Its shard folder may hold only its own site's files (a manifest listing only its client): nothing here reads another
client's.

`CACHE` is the ClientApp process's one cache (a simulation actor serves many rounds; a deployment ClientApp one
message): checked sites, loaded data, and the handlers' algorithm and models (client_app.py).
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Context

from fedccrl_core.algorithms.base import Algorithm
from fedccrl_core.algorithms.fedccrl import StatisticsExchange
from fedccrl_core.foundation.errors import DataError
from fedccrl_core.learning.clients import ClientData
from fedccrl_core.privacy.charged import ChargedRelease
from fedccrl_flower import messages as M
from fedccrl_flower.held_out_pin import pin_held_out
from fedccrl_flower.site_ceiling import check_ceiling
from fedccrl_flower.spec import ClientSpec

CACHE: dict = {}  # per process: a simulation actor serves many rounds; a deployment ClientApp one message


def setting(context: Context, node_key: str, run_key: str | None = None) -> str:
    """A node config value, else (in simulation) the run config's `run_key`; "" when neither is set."""
    v = context.node_config.get(node_key)
    if (v is None or v == "") and run_key is not None:
        v = context.run_config.get(run_key)
    return "" if v is None else str(v)


def resolve_client_id(context: Context, spec: ClientSpec) -> str:
    cid = setting(context, M.NODE_CLIENT_ID)
    if cid:
        return cid
    pid = context.node_config.get(M.NODE_PARTITION_ID)
    if pid is None:
        raise ValueError(f"SuperNode node config needs '{M.NODE_CLIENT_ID}=<id>' or '{M.NODE_PARTITION_ID}=<k>'")
    from fedccrl_core.data.manifest import client_ids, evaluation_sites, load_manifest

    manifest = load_manifest(shards_dir(context))
    ids = client_ids(manifest, spec.held_out) + evaluation_sites(manifest, spec.held_out)
    if not 0 <= int(pid) < len(ids):
        raise ValueError(f"{M.NODE_PARTITION_ID}={pid} is out of range: {len(ids)} sites {ids}")
    return ids[int(pid)]


def shards_dir(context: Context) -> str:
    shards = setting(context, M.NODE_SHARDS, M.RUN_SHARDS)
    if not shards:
        raise ValueError(
            f"SuperNode has no shard folder: set --node-config '{M.NODE_SHARDS}=<folder>' "
            f"(or run config '{M.RUN_SHARDS}' in simulation)"
        )
    return shards


def check_site_data(
    context: Context, spec: ClientSpec, cid: str, train: bool = False, evaluation_only: bool = False
) -> str | None:
    """The spec's held_out, the run's first (held_out_pin.py), a training run's privacy against the site's ceiling
    (site_ceiling.py; `evaluation_only`: fedccrl evaluate-sites), and this site's shard folder against the federation's
    values the spec carries (fedccrl site prepare writes them from the operator's class file and params.yaml): its
    class list (in label order), its image size, and its domain among the federation's domains; a TRAIN message to a site of the held-out domain is refused. ValueError
    naming the site's manifest and the value, before any of its images is used (the server drops the site from the
    round with this reason). Returns the held-out domain as this site's shards name it, or None when they do not
    know it: an imagefolder site's manifest lists only its own domain, and the federation's come from the spec."""
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_core.data.site import SITE_KEY

    pin_held_out(context, spec, cid)  # the first held_out of the run, or refused
    if not evaluation_only:  # a training run's privacy against the site's own ceiling, or refused
        check_ceiling(context, spec.local, cid)
    shards = shards_dir(context)
    key = ("checked", shards, cid, train, spec.held_out, tuple(spec.classes), spec.image_size, tuple(spec.domains))
    if key in CACHE:
        return CACHE[key]
    try:
        manifest = load_manifest(shards)
    except DataError as e:  # the hint a site needs: its own command
        raise ValueError(f"{e}; at a site, `fedccrl site prepare --out SITE` writes it (shards=SITE/shards)") from None
    where, fix = f"{shards}/manifest.json", "prepare the site with the federation's"
    if spec.classes and list(manifest.classes) != list(spec.classes):
        raise ValueError(
            f"{where}: classes {list(manifest.classes)} are not the federation's {list(spec.classes)} (in label "
            f"order): {fix} class file (fedccrl site prepare --classes)"
        )
    if spec.image_size and manifest.image_size != spec.image_size:
        raise ValueError(
            f"{where}: image_size {manifest.image_size} is not the federation's {spec.image_size}: {fix} "
            "params.yaml (fedccrl site prepare --params)"
        )
    entry = next((c for c in manifest.clients if c.id == cid), None)
    own = [] if entry is None else list(entry.domain_counts or [entry.domain])
    stray = [d for d in own if spec.domains and d not in spec.domains]
    if stray:
        raise ValueError(
            f"{where}: client {cid}'s domain '{stray[0]}' is not one of the federation's domains "
            f"({', '.join(spec.domains)}): {fix} domain name (fedccrl site prepare --domain)"
        )
    if train and own == [spec.held_out]:
        raise ValueError(
            f"{where}: client {cid} holds domain '{spec.held_out}', the run's held-out domain: a site never trains "
            "on it (it evaluates it); the federation file names this site under another domain"
        )
    known = spec.held_out in manifest.domains
    if not known and not (spec.domains or SITE_KEY in manifest.params):  # a central partition: the old error
        raise ValueError(f"{where}: the held-out domain '{spec.held_out}' is not one of {manifest.domains}")
    CACHE[key] = spec.held_out if known else None
    return CACHE[key]


def load_client_data(context: Context, cid: str, device: torch.device, held_out: str | None) -> ClientData:
    """This client's data for a run that holds out `held_out`: a mixed-domain (feddg_bench) client drops that
    domain's rows, and its statistics pool the same rows, as the in-process engine does (pipeline/fedccrl_pipeline/train.py)."""
    from fedccrl_core.data.pools import STALE, load_pool
    from fedccrl_core.data.shards import load_client

    shards, pools = shards_dir(context), setting(context, M.NODE_POOLS, M.RUN_POOLS)
    key = ("data", shards, pools, cid, held_out, str(device))
    if key not in CACHE:
        s = load_client(shards, cid, exclude_domain=held_out)
        if not len(s.train_y):
            raise ValueError(
                f"{shards}: client {cid} holds only the held-out domain {held_out}; it is not a "
                f"source client of this run"
            )
        mu = sigma = None
        if pools:
            mu, sigma = load_pool(pools, cid)
            if s.train_rows is not None:
                mu, sigma = mu[s.train_rows], sigma[s.train_rows]
            if len(mu) != len(s.train_y):
                raise ValueError(
                    f"{pools}/{cid}.npz: {len(mu)} statistics for {len(s.train_y)} training samples ({STALE}; "
                    "at a site: prepare it again with `fedccrl site prepare`)"
                )
        CACHE[key] = ClientData.from_numpy(
            s.client_id, s.domain, s.train_x, s.train_y, s.val_x, s.val_y, device, mu, sigma
        )
    return CACHE[key]


def release_refusal(alg: Algorithm, n: int, charged: ChargedRelease | None) -> str:
    """Why this site must not release its statistics this round ("" when it may): its k_i of n_i rows (Eq. 8,
    `released_rows`) at a larger ratio than the release the pre-round check charged (privacy/charged.py), which read
    the n_i the site announced before; its image folder may have changed since. Asked before any row is drawn."""
    if charged is None:
        return ""
    if not isinstance(alg, StatisticsExchange):
        raise ValueError(f"QUERY config '{M.F_CHARGED}' for {alg.name}, which uploads no statistics rows")
    return charged.refusal(n, alg.released_rows(n))


def is_source(context: Context, cid: str, held_out: str | None) -> bool:
    """Whether this site trains in a run that holds out `held_out` (it holds rows of another domain); a site that
    holds only the held-out domain evaluates only (evalsets.py)."""
    from fedccrl_core.data.manifest import client_ids, load_manifest

    return cid in client_ids(load_manifest(shards_dir(context)), held_out)


def load_eval_data(context: Context, cid: str, device: torch.device, held_out: str | None, private: bool):
    """(val_x, val_y, target_x, target_y) of this site for a run that holds out `held_out`: its val split outside
    the held-out domain when it is a source (the in-process engine's EvalSets rows), and its rows of the held-out
    domain, train + val, under train.privacy (`private`) val only (its share of `load_domain_test`; none when its
    shards do not know that domain)."""
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_core.data.shards import load_client_domain

    shards = shards_dir(context)
    key = ("eval", shards, cid, held_out, private, str(device))
    if key not in CACHE:
        if held_out is None:  # its shards do not know the held-out domain: it holds none of it
            size = load_manifest(shards).image_size
            tx, ty = np.zeros((0, size, size, 3), np.uint8), np.zeros(0, np.int64)
        else:
            tx, ty = load_client_domain(shards, cid, held_out, private)
        target = ClientData.from_numpy("target", "target", tx, ty, tx[:0], ty[:0], device)
        if is_source(context, cid, held_out):
            d = load_client_data(context, cid, device, held_out)
            val_x, val_y = d.val_x, d.val_y
        else:
            val_x, val_y = target.train_x[:0], target.train_y[:0]
        CACHE[key] = (val_x, val_y, target.train_x, target.train_y)
    return CACHE[key]
