"""The ClientApp's part of an evaluation-only run (`fedccrl evaluate-sites`, site_evaluation.py): a site evaluates a
trained model on its own images and returns counts, never images.

Two named actions of the ClientApp (messages.py; client_app.py registers them):
  - SITE_EVAL_QUERY: the site names itself by its client id (a training's QUERY reply with n = 0 and no upload),
    after its data check against the model (the training run's `check_site_data`: the model's classes in label
    order, its image size, the site's domain among the federation's); a site whose data does not fit refuses by its
    client id with the reason (replies.py SiteRefusal), before any weight is sent;
  - SITE_EVAL: the model's weights (an ArrayRecord, checked against the model the site builds from the spec, as a
    training's EVALUATE) and the split the server chose for this site: "val" (its val split: the site trained the
    model on the rest) or "all" (train + val: a site that never trained it). The reply: per class k, the images of
    class k, how many the model gets right and how many it predicts as k (evalsets.py SiteCounts, in its val
    fields; target-n 0).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedccrl_flower import messages as M
from fedccrl_flower.client_setup import build_client_algorithm, device_of, read_config, say
from fedccrl_flower.site_ceiling import check_eval_split
from fedccrl_flower.site_data import CACHE, check_site_data, resolve_client_id, shards_dir

SPLITS = ("val", "all")  # what a site counts: its val split, or its whole folder (train + val)


def site_images(shards: str, cid: str, split: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This site's images (uint8 NCHW on `device`) and labels: its val split, or train + val."""
    from fedccrl_core.data.shards import load_client
    from fedccrl_core.learning.clients import ClientData

    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
    s = load_client(shards, cid)
    x = s.val_x if split == "val" else np.concatenate([np.asarray(s.train_x), s.val_x])
    y = s.val_y if split == "val" else np.concatenate([s.train_y, s.val_y])
    d = ClientData.from_numpy(cid, s.domain, x, y, x[:0], y[:0], device)
    return d.train_x, d.train_y


def handle_site_query(msg: Message, context: Context) -> Message:
    """Who this site is, and whether its data fits the model (its refusal otherwise, by its client id)."""
    t0 = time.perf_counter()
    spec, _, _ = read_config(msg)
    cid = resolve_client_id(context, spec)
    try:
        check_site_data(context, spec, cid, evaluation_only=True)
    except ValueError as e:  # as a training's QUERY refuses (replies.py SiteRefusal): by client id, with the reason
        say(f"client {cid}: refuses the evaluation: {e}", t0)
        return Message(RecordDict({M.INFO: ConfigRecord({M.F_CLIENT_ID: cid, M.F_REFUSAL: str(e)})}), reply_to=msg)
    say(f"client {cid}: takes part in the evaluation of run {spec.run_key}", t0)
    return Message(RecordDict({M.INFO: ConfigRecord({M.F_CLIENT_ID: cid, M.F_N: 0})}), reply_to=msg)


def handle_site_evaluate(msg: Message, context: Context) -> Message:
    """The model's weights on this site's images of the split the server chose: counts."""
    from fedccrl_flower.evalsets import site_counts

    t0 = time.perf_counter()
    spec, _, cfg = read_config(msg)
    cid = resolve_client_id(context, spec)
    if str(cfg[M.F_CLIENT_ID]) != cid:
        raise ValueError(f"the server addressed client {cfg[M.F_CLIENT_ID]!s} but this SuperNode holds {cid}")
    check_site_data(context, spec, cid, evaluation_only=True)
    check_eval_split(context, str(cfg[M.F_SPLIT]), cid)
    device = device_of(context, spec)
    x, y = site_images(shards_dir(context), cid, str(cfg[M.F_SPLIT]), device)
    alg, _ = build_client_algorithm(spec, device)
    key = ("site-eval-model", spec.to_json(), str(device))
    if key not in CACHE:
        CACHE[key] = alg.build_model(spec.backbone, spec.num_classes, "none", alg.hp).to(device)
    model = CACHE[key]
    received = M.record_to_arrays(M.record(msg.content, M.WEIGHTS, ArrayRecord), "model weights")
    model.load_state_dict(M.validate_weights(received, model.state_dict(), "model weights"))
    counts = site_counts(model, x, y, x[:0], y[:0], spec.num_classes, spec.eval_batch_size, alg.local)
    say(f"client {cid}: evaluated the model on {len(y)} images ({cfg[M.F_SPLIT]!s})", t0)
    return Message(RecordDict({M.INFO: ConfigRecord({M.F_CLIENT_ID: cid}), M.EVAL: counts.to_record()}), reply_to=msg)
