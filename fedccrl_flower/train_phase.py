"""The TRAIN phase (Algorithm 1 lines 8-22 over Flower): a TRAIN message per sampled client (global weights + its
payload, line 7; FedCCRL: F_pool minus F_i), every reply checked against the global weights (replies.py) - a
malformed reply is refused, never aggregated - and the valid replies returned in client-id order for `alg.aggregate`
(line 23, Eq. 2). A sampled client without a reply is dropped (the ledger)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from fedccrl_core.algorithms.base import Reply
from fedccrl_core.foundation import contract
from fedccrl_flower import messages as M
from fedccrl_flower.replies import BAD_REPLY, Ledger, matching_train_uploads, read_train_reply
from fedccrl_flower.transport import Exchanged, PhaseTimer, error_reason, phase_config


def train_messages(
    rnd: int, client_spec_json: str, global_w: dict, sampled: list[str], payloads: dict, node_of: dict[str, int]
) -> list[Message]:
    """One TRAIN message per sampled client: the global weights and, where it has one, its payload."""
    weights_rec = M.arrays_to_record(global_w)
    msgs = []
    for cid in sampled:
        content = RecordDict({M.CONFIG: phase_config(client_spec_json, rnd, cid), M.WEIGHTS: weights_rec})
        if payloads.get(cid) is not None:
            content[M.PAYLOAD] = M.arrays_to_record(payloads[cid])
        msgs.append(Message(content, dst_node_id=node_of[cid], message_type=M.TRAIN, group_id=str(rnd)))
    return msgs


def exchange_train(
    grid: Grid,
    timer: PhaseTimer,
    rnd: int,
    msgs: list[Message],
    cid_of: dict[int, str],
    global_w: dict,
    need_train_acc: bool,
    device: torch.device,
    ledger: Ledger,
    log: Callable[[str], None],
) -> tuple[list[Reply], Exchanged]:
    """The TRAIN messages over the Grid (`cid_of`: node -> client); returns the valid replies in client-id order
    (weights and uploads on `device`) and the exchange."""
    ex = timer.exchange(grid, rnd, msgs, "train")
    for node in sorted(ex.missing):
        ledger.drop(rnd, cid_of[node], node, "train", *ex.missing[node])
    reference = {k: v.detach().cpu() for k, v in global_w.items()}
    valid = []
    for node, r in ex.replies.items():
        cid = cid_of[node]
        if r.has_error():
            ledger.drop(rnd, cid, node, "train", *error_reason(r))
            continue
        try:
            n, weights, metrics, upload = read_train_reply(r, cid, reference, need_train_acc)
        except BAD_REPLY as e:
            ledger.refuse(rnd, cid, str(e))
            continue
        up_t = None if upload is None else {k: torch.from_numpy(v).to(device) for k, v in upload.items()}
        valid.append(Reply(cid, {k: v.to(device) for k, v in weights.items()}, n, metrics, up_t))
        log(f"round {rnd}: {cid}: {contract.reply_summary(metrics)}")
    return sorted(matching_train_uploads(rnd, valid, ledger), key=lambda r: r.client_id), ex
