"""The ClientApp: one fedccrl_core client behind Flower's Message API.

A SuperNode holds one client's shard and never sends images: only its upload (FedCCRL: F_i, Eq. 8),
its local weights, n_i, float metrics and its evaluation counts (evalsets.py). Its shard folder may hold
only its own site's files (a manifest listing only its client): nothing here reads another client's.
A site that holds only the run's held-out domain answers QUERY with n = 0 and evaluates only. Which client it is comes from the node config:
`client-id=<id>` (deployment), or `partition-id=<k>`, the k-th site of the manifest: its source clients,
then its evaluation-only sites (Flower's simulation sets partition-id). The shard and pool folders come from the node config
(`shards=... pools=...`) or, in simulation, from the run config.

Per-client state (ClientState: optimizer, LR schedule, `extra`, e.g. FedBN's local BN layers) lives
in `Context.state` across rounds (ArrayRecord + ConfigRecord, see messages.pack_tree). With
`state-dir=<folder>` it is mirrored to disk after every round, so a restarted SuperNode or a rerun
ServerApp continues from it. Two slots are kept (the newest and the one before), and round t trains
from the newest state made *before* round t: a round that is retrained after a ServerApp resume
starts from the same state as the first time.

All random draws are the in-process engine's: derive_seed(seed, "upload"|"local"|"augment"|"shuffle",
round, client id), so the same seed gives the same numbers on both engines; under train.privacy, Eq. 8's sample and
the statistics noise come from the OS instead (fedccrl_core/privacy/noise.py), and no metrics are sent.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.algorithms.base import Algorithm
from fedccrl_core.federation.loop import nbytes
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.errors import DataError
from fedccrl_core.foundation.fastpath import resolve_device
from fedccrl_core.foundation.fsio import atomic_file
from fedccrl_core.foundation.procs import die_with_parent
from fedccrl_core.foundation.seeding import derive_seed, numpy_rng, seed_everything, torch_generator
from fedccrl_core.learning.clients import ClientData, ClientState
from fedccrl_core.learning.models import FedModel
from fedccrl_flower import messages as M
from fedccrl_flower.held_out_pin import pin_held_out
from fedccrl_flower.spec import ClientSpec

app = ClientApp()
if Path(sys.argv[0]).name.startswith(("flwr-", "flower-")):  # a process Flower started to run this app:
    die_with_parent()  # it ends with the process that started it (fedccrl_core/foundation/procs.py), never orphaned

_CACHE: dict = {}  # per process: a simulation actor serves many rounds; a deployment ClientApp one message


def _say(msg: str, t0: float) -> None:
    """One line in the SuperNode's log: what was done, in how long, and how old this process is
    (in deployment Flower starts a fresh ClientApp process per message; its start-up shows here)."""
    try:
        import psutil

        age = f", process age {time.time() - psutil.Process().create_time():.1f}s"
    except Exception:
        age = ""
    print(f"{time.strftime('%H:%M:%S')} {msg} in {time.perf_counter() - t0:.1f}s (pid {os.getpid()}{age})", flush=True)


# ---- who am I, and my data ------------------------------------------------------------------------
def _setting(context: Context, node_key: str, run_key: str | None = None) -> str:
    v = context.node_config.get(node_key)
    if (v is None or v == "") and run_key is not None:
        v = context.run_config.get(run_key)
    return "" if v is None else str(v)


def resolve_client_id(context: Context, spec: ClientSpec) -> str:
    cid = _setting(context, M.NODE_CLIENT_ID)
    if cid:
        return cid
    pid = context.node_config.get(M.NODE_PARTITION_ID)
    if pid is None:
        raise ValueError(f"SuperNode node config needs '{M.NODE_CLIENT_ID}=<id>' or '{M.NODE_PARTITION_ID}=<k>'")
    from fedccrl_core.data.manifest import client_ids, evaluation_sites, load_manifest

    manifest = load_manifest(_shards_dir(context))
    ids = client_ids(manifest, spec.held_out) + evaluation_sites(manifest, spec.held_out)
    if not 0 <= int(pid) < len(ids):
        raise ValueError(f"{M.NODE_PARTITION_ID}={pid} is out of range: {len(ids)} sites {ids}")
    return ids[int(pid)]


def _shards_dir(context: Context) -> str:
    shards = _setting(context, M.NODE_SHARDS, M.RUN_SHARDS)
    if not shards:
        raise ValueError(
            f"SuperNode has no shard folder: set --node-config '{M.NODE_SHARDS}=<folder>' "
            f"(or run config '{M.RUN_SHARDS}' in simulation)"
        )
    return shards


def check_site_data(context: Context, spec: ClientSpec, cid: str, train: bool = False) -> str | None:
    """The spec's held_out, the run's first (held_out_pin.py), and this site's shard folder against the federation's
    values the spec carries (fedccrl site prepare writes them from the operator's class file and params.yaml): its
    class list (in label order), its image size, and its domain among the federation's domains; a TRAIN message to a site of the held-out domain is refused. ValueError
    naming the site's manifest and the value, before any of its images is used (the server drops the site from the
    round with this reason). Returns the held-out domain as this site's shards name it, or None when they do not
    know it: an imagefolder site's manifest lists only its own domain, and the federation's come from the spec."""
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_core.data.site import SITE_KEY

    pin_held_out(context, spec, cid)  # the first held_out of the run, or refused
    shards = _shards_dir(context)
    key = ("checked", shards, cid, train, spec.held_out, tuple(spec.classes), spec.image_size, tuple(spec.domains))
    if key in _CACHE:
        return _CACHE[key]
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
    _CACHE[key] = spec.held_out if known else None
    return _CACHE[key]


def load_client_data(context: Context, cid: str, device: torch.device, held_out: str | None) -> ClientData:
    """This client's data for a run that holds out `held_out`: a mixed-domain (feddg_bench) client drops that
    domain's rows, and its statistics pool the same rows, as the in-process engine does (pipeline/fedccrl_pipeline/train.py)."""
    from fedccrl_core.data.pools import STALE, load_pool
    from fedccrl_core.data.shards import load_client

    shards, pools = _shards_dir(context), _setting(context, M.NODE_POOLS, M.RUN_POOLS)
    key = ("data", shards, pools, cid, held_out, str(device))
    if key not in _CACHE:
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
        _CACHE[key] = ClientData.from_numpy(
            s.client_id, s.domain, s.train_x, s.train_y, s.val_x, s.val_y, device, mu, sigma
        )
    return _CACHE[key]


def is_source(context: Context, cid: str, held_out: str | None) -> bool:
    """Whether this site trains in a run that holds out `held_out` (it holds rows of another domain); a site that
    holds only the held-out domain evaluates only (evalsets.py)."""
    from fedccrl_core.data.manifest import client_ids, load_manifest

    return cid in client_ids(load_manifest(_shards_dir(context)), held_out)


def load_eval_data(context: Context, cid: str, device: torch.device, held_out: str | None):
    """(val_x, val_y, target_x, target_y) of this site for a run that holds out `held_out`: its val split outside
    the held-out domain when it is a source (the in-process engine's EvalSets rows), and its rows of the held-out
    domain, train + val (its share of `load_domain_test`; none when its shards do not know that domain)."""
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_core.data.shards import load_client_domain

    shards = _shards_dir(context)
    key = ("eval", shards, cid, held_out, str(device))
    if key not in _CACHE:
        if held_out is None:  # its shards do not know the held-out domain: it holds none of it
            size = load_manifest(shards).image_size
            tx, ty = np.zeros((0, size, size, 3), np.uint8), np.zeros(0, np.int64)
        else:
            tx, ty = load_client_domain(shards, cid, held_out)
        target = ClientData.from_numpy("target", "target", tx, ty, tx[:0], ty[:0], device)
        if is_source(context, cid, held_out):
            d = load_client_data(context, cid, device, held_out)
            val_x, val_y = d.val_x, d.val_y
        else:
            val_x, val_y = target.train_x[:0], target.train_y[:0]
        _CACHE[key] = (val_x, val_y, target.train_x, target.train_y)
    return _CACHE[key]


def _device(context: Context, spec: ClientSpec) -> torch.device:
    return resolve_device(_setting(context, M.NODE_DEVICE) or spec.device)


def build_client_algorithm(spec: ClientSpec, device: torch.device) -> tuple[Algorithm, FedModel]:
    """The algorithm and a model of the server's architecture (weights always come from the server)."""
    key = ("alg", spec.to_json(), str(device))
    if key not in _CACHE:
        alg = build_algorithm(spec.algorithm, spec.local, spec.hparams)
        model = alg.build_model(spec.backbone, spec.num_classes, "none", alg.hp).to(device)
        _CACHE[key] = (alg, model)
    return _CACHE[key]


def read_config(msg: Message) -> tuple[ClientSpec, int, ConfigRecord]:
    """The CONFIG record's spec (parsed and checked here, once), round and the record itself."""
    cfg = M.record(msg.content, M.CONFIG, ConfigRecord)
    return ClientSpec.from_json(str(cfg[M.F_SPEC]), f"CONFIG record '{M.F_SPEC}'"), int(cfg[M.F_ROUND]), cfg  # type: ignore[arg-type]  # the server's int


# ---- ClientState: Context.state, mirrored to disk ---------------------------------------------
def _state_file(context: Context, state_key: str, cid: str) -> Path | None:
    d = _setting(context, M.NODE_STATE_DIR, M.RUN_STATE_DIR)
    return Path(d) / state_key / f"{cid}.npz" if d else None


def _book_from_context(context: Context, state_key: str, cid: str) -> dict | None:
    if M.STATE_TREE not in context.state or M.STATE_ARRAYS not in context.state:
        return None
    book = M.unpack_tree(
        M.record(context.state, M.STATE_ARRAYS, ArrayRecord), M.record(context.state, M.STATE_TREE, ConfigRecord)
    )
    return book if (book.get("state_key"), book.get("client_id")) == (state_key, cid) else None


def _book_from_disk(path: Path | None, state_key: str, cid: str) -> dict | None:
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            book = M.decode_tree({k[1:]: z[k] for k in z.files if k.startswith("a")}, str(z["tree"]))
    except Exception as e:  # a torn or foreign file: start fresh, say so
        print(f"client {cid}: state file {path} unreadable ({e.__class__.__name__}); ignoring it", flush=True)
        return None
    return book if (book.get("state_key"), book.get("client_id")) == (state_key, cid) else None


def load_client_state(context: Context, state_key: str, cid: str, rnd: int) -> tuple[ClientState, dict | None]:
    """The newest saved state (of the run `state_key` names) made before round `rnd` (fresh if none) and its slot."""
    books = [
        b
        for b in (
            _book_from_context(context, state_key, cid),
            _book_from_disk(_state_file(context, state_key, cid), state_key, cid),
        )
        if b
    ]
    books.sort(key=lambda b: max((s["round"] for s in b["slots"]), default=0), reverse=True)
    for book in books[:1]:
        for slot in sorted(book["slots"], key=lambda s: -s["round"]):
            if slot["round"] < rnd:  # a copy: the optimizer updates its loaded tensors in place
                return ClientState.from_dict(copy.deepcopy(slot["state"])), slot
    return ClientState(), None


def save_client_state(
    context: Context, state_key: str, cid: str, rnd: int, state: ClientState, base: dict | None
) -> None:
    book = {
        "state_key": state_key,
        "client_id": cid,
        "slots": [{"round": rnd, "state": state.to_dict()}] + ([base] if base else []),
    }
    arrays, tree = M.pack_tree(book)
    context.state[M.STATE_ARRAYS] = arrays
    context.state[M.STATE_TREE] = tree
    path = _state_file(context, state_key, cid)
    if path is not None:  # npz, no pickle: written to a temp file, fsynced, renamed
        arrays_np, skeleton = M.encode_tree(book)
        with atomic_file(path, "wb") as f:  # fedccrl_core.foundation.fsio
            np.savez(f, tree=np.array(skeleton), **{f"a{k}": v for k, v in arrays_np.items()})  # type: ignore[arg-type]  # keys a<k>, never allow_pickle


# ---- the two message handlers -----------------------------------------------------------------
def handle_query(msg: Message, context: Context) -> Message:
    """Algorithm 1 lines 3-6: this client's upload (FedCCRL: ceil(r n_i) of its statistics, Eq. 8)."""
    t0 = time.perf_counter()
    spec, rnd, _ = read_config(msg)
    device = _device(context, spec)
    cid = resolve_client_id(context, spec)
    try:
        held_out = check_site_data(context, spec, cid)
    except ValueError as e:  # this site's data does not fit the run: it refuses by its client id, with the reason
        _say(f"client {cid} round {rnd}: refuses the run: {e}", t0)
        refusal = ConfigRecord({M.F_CLIENT_ID: cid, M.F_REFUSAL: str(e)})
        return Message(RecordDict({M.INFO: refusal}), reply_to=msg)
    if not is_source(context, cid, held_out):  # an evaluation-only site: n = 0, no upload
        _say(f"client {cid} round {rnd}: evaluation-only (holds only {spec.held_out})", t0)
        return Message(RecordDict({M.INFO: ConfigRecord({M.F_CLIENT_ID: cid, M.F_N: 0})}), reply_to=msg)
    data = load_client_data(context, cid, device, held_out)
    alg, _ = build_client_algorithm(spec, device)
    skip = json.loads(str(msg.content[M.CONFIG].get(M.F_SKIP_UPLOAD, "[]")))  # the server half's decision
    upload = None if cid in skip else alg.client_upload(data, numpy_rng(spec.seed, "upload", rnd, cid))
    _say(f"client {cid} round {rnd}: upload of {nbytes(upload)} B", t0)
    content = RecordDict({M.INFO: ConfigRecord({M.F_CLIENT_ID: cid, M.F_N: alg.sample_count(data)})})
    if upload is not None:
        content[M.UPLOAD] = M.arrays_to_record(upload)
    return Message(content, reply_to=msg)


def handle_train(msg: Message, context: Context) -> Message:
    """Algorithm 1 lines 8-22 with the server's global weights and this client's payload."""
    t0 = time.perf_counter()
    spec, rnd, cfg = read_config(msg)
    device = _device(context, spec)
    cid = resolve_client_id(context, spec)
    if str(cfg[M.F_CLIENT_ID]) != cid:
        raise ValueError(f"the server addressed client {cfg[M.F_CLIENT_ID]!s} but this SuperNode holds {cid}")
    data = load_client_data(context, cid, device, check_site_data(context, spec, cid, train=True))
    alg, model = build_client_algorithm(spec, device)
    reference = model.state_dict()
    received = M.record_to_arrays(M.record(msg.content, M.WEIGHTS, ArrayRecord), "global weights")
    global_w = {k: v.to(device) for k, v in M.validate_weights(received, reference, "global weights").items()}
    payload = (
        M.record_to_arrays(M.record(msg.content, M.PAYLOAD, ArrayRecord), "payload")
        if M.PAYLOAD in msg.content
        else None
    )
    stateless = spec.client_state == "stateless"  # a fresh optimizer every round
    state, base = (ClientState(), None) if stateless else load_client_state(context, spec.state_key, cid, rnd)
    seed = spec.seed
    seed_everything(derive_seed(seed, "local", rnd, cid))
    gen = torch_generator(seed, "augment", rnd, cid, device=device)
    reply = alg.local_train(model, data, state, global_w, payload, gen, numpy_rng(seed, "shuffle", rnd, cid))
    if not stateless:
        save_client_state(context, spec.state_key, cid, rnd, state, base)
    _say(f"client {cid} round {rnd}: trained, {contract.reply_summary(reply.metrics)}", t0)
    content = RecordDict(
        {
            M.INFO: ConfigRecord({M.F_CLIENT_ID: cid, M.F_N: int(reply.n)}),
            M.WEIGHTS: M.arrays_to_record(reply.weights),
            M.METRICS: MetricRecord({k: float(v) for k, v in reply.metrics.items()}),
        }
    )
    if reply.upload is not None:  # what the server half aggregates besides the weights (FedIIR: g_i)
        content[M.UPLOAD] = M.arrays_to_record(reply.upload)
    return Message(content, reply_to=msg)


def handle_evaluate(msg: Message, context: Context) -> Message:
    """The aggregated global weights on this site's own images: counts, never images (evalsets.py)."""
    from fedccrl_flower.evalsets import site_counts

    t0 = time.perf_counter()
    spec, rnd, _ = read_config(msg)
    device = _device(context, spec)
    cid = resolve_client_id(context, spec)
    held_out = check_site_data(context, spec, cid)
    val_x, val_y, target_x, target_y = load_eval_data(context, cid, device, held_out)
    alg, _ = build_client_algorithm(spec, device)
    key = ("eval-model", spec.to_json(), str(device))
    if key not in _CACHE:  # a model of its own: the training model keeps its state between messages
        _CACHE[key] = alg.build_model(spec.backbone, spec.num_classes, "none", alg.hp).to(device)
    model = _CACHE[key]
    received = M.record_to_arrays(M.record(msg.content, M.WEIGHTS, ArrayRecord), "global weights")
    model.load_state_dict(M.validate_weights(received, model.state_dict(), "global weights"))
    counts = site_counts(model, val_x, val_y, target_x, target_y, spec.num_classes, spec.eval_batch_size, alg.local)
    _say(f"client {cid} round {rnd}: evaluated {len(val_y)} val and {len(target_y)} held-out images", t0)
    return Message(RecordDict({M.INFO: ConfigRecord({M.F_CLIENT_ID: cid}), M.EVAL: counts.to_record()}), reply_to=msg)


@app.query()
def _query(msg: Message, context: Context) -> Message:
    return handle_query(msg, context)


@app.train()
def _train(msg: Message, context: Context) -> Message:
    return handle_train(msg, context)


@app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    return handle_evaluate(msg, context)


from fedccrl_flower import site_eval_client  # noqa: E402,F401  # registers the evaluation-only run's two actions
