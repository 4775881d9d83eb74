"""The ServerApp's evaluation data: every source client's val split and the held-out domain's test set, read
from the server's copy of the shards (the research setting; clients never send images)."""

from __future__ import annotations

from fedccrl_core.data.shards import client_ids, load_client, load_domain_test, load_manifest
from fedccrl_core.federation.loop import EvalSets
from fedccrl_core.learning.clients import ClientData


def load_evalsets(shards: str, held_out: str, batch_size: int, device) -> EvalSets:
    """Source validation (every source client's val split) and the held-out domain's test set, as the
    in-process engine's runs build them (EvalSets.for_target)."""
    manifest = load_manifest(shards)
    vals = [load_client(shards, cid, exclude_domain=held_out) for cid in client_ids(manifest, held_out)]
    val = [
        ClientData.from_numpy(s.client_id, s.domain, s.train_x[:0], s.train_y[:0], s.val_x, s.val_y, device)
        for s in vals
    ]
    tx, ty = load_domain_test(shards, held_out)
    return EvalSets.for_target(val, tx, ty, batch_size, device)
