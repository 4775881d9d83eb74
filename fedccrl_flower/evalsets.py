"""The ServerApp's evaluation data: every source client's val split and the held-out domain's test set, read
from the server's copy of the shards (the research setting; clients never send images)."""

from __future__ import annotations

import numpy as np
import torch

from fedccrl_core.data.shards import client_ids, load_client, load_domain_test, load_manifest
from fedccrl_core.federation.loop import EvalSets
from fedccrl_core.learning.clients import ClientData


def load_evalsets(shards: str, held_out: str, batch_size: int, device) -> EvalSets:
    """Source validation (every source client's val split) and the held-out domain's test set."""
    manifest = load_manifest(shards)
    vals = [load_client(shards, cid, exclude_domain=held_out) for cid in client_ids(manifest, held_out)]
    val = [
        ClientData.from_numpy(s.client_id, s.domain, s.val_x, s.val_y, s.val_x[:0], s.val_y[:0], device) for s in vals
    ]
    tx, ty = load_domain_test(shards, held_out)
    target = ClientData.from_numpy("target", held_out, tx, ty, tx[:0], ty[:0], device)
    return EvalSets(
        torch.cat([c.train_x for c in val]),
        torch.cat([c.train_y for c in val]),
        target.train_x,
        torch.from_numpy(np.asarray(ty, dtype=np.int64)).to(device),
        batch_size,
    )
