"""The ClientApp: one fedccrl_core client behind Flower's Message API.

A SuperNode holds one client's shard and never sends images: only its upload (FedCCRL: F_i, Eq. 8),
its local weights, n_i, float metrics and its evaluation counts (evalsets.py). Its data is checked and loaded by
site_data.py, and its state kept by client_state.py.
A site that holds only the run's held-out domain answers QUERY with n = 0 and evaluates only. Which client it is comes from the node config:
`client-id=<id>` (deployment), or `partition-id=<k>`, the k-th site of the manifest: its source clients,
then its evaluation-only sites (Flower's simulation sets partition-id). The shard and pool folders come from the node config
(`shards=... pools=...`) or, in simulation, from the run config.

Per-client state (ClientState: optimizer, LR schedule, `extra`) lives in `Context.state` across rounds, mirrored
to `state-dir=<folder>` when the node config sets one (client_state.py).

All random draws are the in-process engine's: derive_seed(seed, "upload"|"local"|"augment"|"shuffle",
round, client id), so the same seed gives the same numbers on both engines; under train.privacy, Eq. 8's sample and
the statistics noise come from the OS instead (fedccrl_core/privacy/noise.py), and no metrics are sent.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedccrl_core.federation.loop import nbytes
from fedccrl_core.foundation import contract
from fedccrl_core.foundation.procs import die_with_parent
from fedccrl_core.foundation.seeding import derive_seed, numpy_rng, seed_everything, torch_generator
from fedccrl_core.learning.clients import ClientState
from fedccrl_flower import messages as M
from fedccrl_flower.client_setup import build_client_algorithm, device_of, read_config, say
from fedccrl_flower.client_state import load_client_state, save_client_state
from fedccrl_flower.site_budget import admit_run
from fedccrl_flower.site_data import (
    CACHE,
    check_site_data,
    is_source,
    load_client_data,
    load_eval_data,
    release_refusal,
    resolve_client_id,
)
from fedccrl_flower.site_eval_client import handle_site_evaluate, handle_site_query

app = ClientApp()
if Path(sys.argv[0]).name.startswith(("flwr-", "flower-")):  # a process Flower started to run this app:
    die_with_parent()  # it ends with the process that started it (fedccrl_core/foundation/procs.py), never orphaned


# ---- the two message handlers -----------------------------------------------------------------
def handle_query(msg: Message, context: Context) -> Message:
    """Algorithm 1 lines 3-6: this client's upload (FedCCRL: ceil(r n_i) of its statistics, Eq. 8), or its refusal
    of the round's release when that would exceed what the server's pre-round check charged (its size changed)."""
    t0 = time.perf_counter()
    spec, rnd, cfg = read_config(msg)
    device = device_of(context, spec)
    cid = resolve_client_id(context, spec)
    try:
        held_out = check_site_data(context, spec, cid)
        source = is_source(context, cid, held_out)
        if source:  # a site that trains: the run within its budget over runs, or refused
            admit_run(context, spec.local, spec.run_key, cid)
    except ValueError as e:  # this site's data does not fit the run: it refuses by its client id, with the reason
        say(f"client {cid} round {rnd}: refuses the run: {e}", t0)
        refusal = ConfigRecord({M.F_CLIENT_ID: cid, M.F_REFUSAL: str(e)})
        return Message(RecordDict({M.INFO: refusal}), reply_to=msg)
    if not source:  # an evaluation-only site: n = 0, no upload
        say(f"client {cid} round {rnd}: evaluation-only (holds only {spec.held_out})", t0)
        return Message(RecordDict({M.INFO: ConfigRecord({M.F_CLIENT_ID: cid, M.F_N: 0})}), reply_to=msg)
    data = load_client_data(context, cid, device, held_out)
    alg, _ = build_client_algorithm(spec, device)
    skip = json.loads(str(cfg.get(M.F_SKIP_UPLOAD, "[]")))  # the server half's decision
    n = alg.sample_count(data)
    why = "" if cid in skip else release_refusal(alg, n, M.read_charged(cfg))
    if why:  # its size changed since it announced it: it refuses the round's release, telling its n_i now
        say(f"client {cid} round {rnd}: refuses the round's release: {why}", t0)
        refusal = ConfigRecord({M.F_CLIENT_ID: cid, M.F_REFUSAL: why, M.F_N: n})
        return Message(RecordDict({M.INFO: refusal}), reply_to=msg)
    upload = None if cid in skip else alg.client_upload(data, numpy_rng(spec.seed, "upload", rnd, cid))
    say(f"client {cid} round {rnd}: upload of {nbytes(upload)} B", t0)
    content = RecordDict({M.INFO: ConfigRecord({M.F_CLIENT_ID: cid, M.F_N: n})})
    if upload is not None:
        content[M.UPLOAD] = M.arrays_to_record(upload)
    return Message(content, reply_to=msg)


def handle_train(msg: Message, context: Context) -> Message:
    """Algorithm 1 lines 8-22 with the server's global weights and this client's payload."""
    t0 = time.perf_counter()
    spec, rnd, cfg = read_config(msg)
    device = device_of(context, spec)
    cid = resolve_client_id(context, spec)
    if str(cfg[M.F_CLIENT_ID]) != cid:
        raise ValueError(f"the server addressed client {cfg[M.F_CLIENT_ID]!s} but this SuperNode holds {cid}")
    held_out = check_site_data(context, spec, cid, train=True)
    admit_run(context, spec.local, spec.run_key, cid)  # admitted at its QUERY; a TRAIN without one is checked here
    data = load_client_data(context, cid, device, held_out)
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
    say(f"client {cid} round {rnd}: trained, {contract.reply_summary(reply.metrics)}", t0)
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
    device = device_of(context, spec)
    cid = resolve_client_id(context, spec)
    held_out = check_site_data(context, spec, cid)
    val_x, val_y, target_x, target_y = load_eval_data(context, cid, device, held_out, spec.local.private)
    alg, _ = build_client_algorithm(spec, device)
    key = ("eval-model", spec.to_json(), str(device))
    if key not in CACHE:  # a model of its own: the training model keeps its state between messages
        CACHE[key] = alg.build_model(spec.backbone, spec.num_classes, "none", alg.hp).to(device)
    model = CACHE[key]
    received = M.record_to_arrays(M.record(msg.content, M.WEIGHTS, ArrayRecord), "global weights")
    model.load_state_dict(M.validate_weights(received, model.state_dict(), "global weights"))
    counts = site_counts(model, val_x, val_y, target_x, target_y, spec.num_classes, spec.eval_batch_size, alg.local)
    say(f"client {cid} round {rnd}: evaluated {len(val_y)} val and {len(target_y)} held-out images", t0)
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


# the evaluation-only run's two actions (`fedccrl evaluate-sites`: site_eval_client.py)
app.query(M.SITE_EVAL_ACTION)(handle_site_query)
app.evaluate(M.SITE_EVAL_ACTION)(handle_site_evaluate)
