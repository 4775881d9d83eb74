"""CCST: Cross-Client Style Transfer (Chen, Jiang, Dou, Chen, WACV 2023; ccst.txt), on FedAvg.

Each client C_n is a domain. Before training (Sec. 3.2, Fig. 2), three stages, ONCE:
  3.2.1  local style computation: S_overall^{C_n} = (mu(F_all), sigma(F_all)) over all its training
         images (Eq. 8), or S_bank^{C_n} = {S_single(i_1..i_J)}, J random images (Eq. 6-7); each
         style is two 512-vectors of relu4_1 statistics (Eq. 4): no image or feature map leaves.
  3.2.2  the server concatenates them into the style bank B (Eq. 9-10) and broadcasts B.
  3.2.3  local style transfer, Alg. 1: for every image I_i, K distinct entries of B are drawn
         (K in {1..N}); the client's own entry appends I_i itself, another client's entry appends
         G(I_i, S) (Eq. 5), S = that client's overall style or one of its single styles drawn at
         random. |D^{C_n}| = K d.
Then FedAvg: each round, plain cross-entropy on D^{C_n} and aggregation weighted by n_i = |D^{C_n}|
(Eq. 2). Defaults follow Table 1 (Overall, K=3); J = ceil(n_i / 32) as Sec. 4.2 states ("the
value of M ... is ceil(dataset_size/32)"; the reference code draws one style image per batch of 32).

How "once" maps onto the engine, which calls client_upload / server_payloads every round:
  - the server asks a client for its style until the bank holds it (round 1); the server keeps the
    first upload of each client, so a client that uploads again (a restarted server) changes nothing.
  - server_payloads sends B to a client only until the client has trained once (the server learns
    that from the replies in `aggregate`), so a client not sampled in round 1 still gets B once.
    B and the set of served clients are server state (checkpointed: a resume sends nothing again).
    The engine's byte counts therefore show the bank exactly once per client.
  - the client keeps B in ClientState.extra on first receipt, draws its Alg. 1 plan (which K
    entries of B and which single style, per image) once, and keeps the plan there too. The plan
    is drawn from a numpy generator seeded by that round's augment generator's seed (no draw is
    consumed from the engine's generators).
  - D^{C_n} is built offline, once, with the frozen AdaIN networks and kept on the training device
    as uint8 in this object (like the shards); it is not checkpointed (K times the shard), but is
    rebuilt from the checkpointed plan and bank after a resume, to the same images (CPU).
Who uploads is the server half's decision (`upload_wanted`: clients not yet in the checkpointed
bank), passed to the clients by the transport (Flower: the QUERY message's skip list), so a resumed
run uploads nothing again and no client-side object holds server state. B travels as a flat dict of arrays
(`bank_to_payload`), so the Flower messages can carry it unchanged.
Departures: styles and transfer at the shard resolution (the reference stylizes at 512 px, then
trains at 222-224); per-image single-style draws (Alg. 1 line 8; the reference draws one per batch
of 32); population variance for the content statistics too (see augment/adain.py).


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from fedccrl_core.algorithm_params.ccst import CCSTParams
from fedccrl_core.algorithms.base import Algorithm, KeptState, cross_entropy_step
from fedccrl_core.augment.adain import (
    AdaINNetworks,
    images01,
    load_adain_networks,
    overall_style,
    single_image_styles,
    stylize,
    to_u8,
)
from fedccrl_core.foundation.seeding import derive_seed

TRANSFER_BATCH = 32  # images per encoder/decoder batch (the reference's batch)
STAT_KEYS = ("mu", "sigma")  # an entry of B, as uploaded, broadcast and kept: Style's fields


@dataclass(frozen=True)
class Style:
    """One client's entry of B: the relu4_1 means and stds (Eq. 4) of its styles, [J, 512] each (J = 1: overall)."""

    mu: np.ndarray
    sigma: np.ndarray


@dataclass(frozen=True)
class TransferPlan:
    """Alg. 1 lines 2-10 as indices, drawn once per client (`transfer_plan`): B's client ids, and for each of the n
    images its K entries of B (indices into bank_ids) and, in single mode, the style drawn of each (0 otherwise)."""

    bank_ids: list[str]
    clients: np.ndarray  # [n, K] int64
    styles: np.ndarray  # [n, K] int64


@dataclass
class CCSTKept(KeptState):
    """What a client keeps across rounds, as plain data for the checkpoints: B as first received ({client: {"mu",
    "sigma"}}, `payload_to_bank`) and its TransferPlan (its fields by name)."""

    ccst_style_bank: dict[str, dict[str, np.ndarray]] | None = None
    ccst_plan: dict | None = None


def bank_to_payload(bank: dict[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """B as a flat {"<client>/mu": [J, 512], "<client>/sigma": [J, 512]} (what every engine can move)."""
    return {f"{cid}/{k}": bank[cid][k] for cid in sorted(bank) for k in STAT_KEYS}


def payload_to_bank(payload: dict) -> dict[str, dict[str, np.ndarray]]:
    bank: dict[str, dict[str, np.ndarray]] = {}
    for key, v in payload.items():
        cid, k = key.rsplit("/", 1)
        bank.setdefault(cid, {})[k] = np.array(v, dtype=np.float32)
    if any(set(b) != set(STAT_KEYS) for b in bank.values()):
        raise ValueError(f"CCST: malformed style bank payload (keys {sorted(payload)[:4]} ...)")
    return bank


def single_bank_size(J: int | None, n_i: int) -> int:
    """J of Eq. 7: the given value, or ceil(n_i / 32) (Sec. 4.2), at most n_i."""
    return min(n_i, J if J is not None else math.ceil(n_i / 32))


def transfer_plan(
    n: int, bank_sizes: dict[str, int], own_id: str, K: int, rng: np.random.Generator, style_type: str = "overall"
) -> TransferPlan:
    """Alg. 1 lines 2-10 as indices: for each of n images, K distinct clients of B (line 3, without
    replacement since K <= N and |D| = K d) and, in single mode, one style of each (line 8).
    An entry equal to own_id's index means "append I_i itself" (line 6), its style index is unused (0)."""
    ids = sorted(bank_sizes)
    if own_id not in bank_sizes:
        raise ValueError(f"CCST: the style bank has no entry of client {own_id!r}")
    N = len(ids)
    if not 1 <= K <= N:
        raise ValueError(f"params.yaml: train.ccst.K={K} must be in 1..N, N = {N} clients in the style bank (Alg. 1)")
    clients = np.stack([rng.choice(N, size=K, replace=False) for _ in range(n)]) if n else np.zeros((0, K), int)
    styles = np.zeros_like(clients)
    if style_type == "single":
        sizes = np.array([bank_sizes[c] for c in ids])
        styles = rng.integers(0, sizes[clients])
    styles[clients == ids.index(own_id)] = 0
    return TransferPlan(ids, clients.astype(np.int64), styles.astype(np.int64))


class CCST(Algorithm):
    name = "ccst"
    Params = CCSTParams
    hp: CCSTParams
    pads_partial_batch = True  # its loss reads ctx.real_rows only (learning/static_batch.py)

    def __init__(self, local, hparams=None):
        super().__init__(local, hparams)
        self.style_bank: dict[str, dict[str, np.ndarray]] = {}  # server: B (Eq. 9-10)
        self.served: set[str] = set()  # server: clients that have trained with B
        self._datasets: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # client side: D^{C_n} (uint8, labels)
        self._nets: AdaINNetworks | None = None

    def networks(self, device) -> AdaINNetworks:
        """The frozen AdaIN Phi and Psi, loaded and verified on first use, on `device`."""
        if self._nets is None:
            self._nets = load_adain_networks(self.hp.adain_weights, self.hp.adain_sha256)
        return self._nets.to(device)

    # ---- 3.2.1: local style computation, uploaded once --------------------------------------
    def upload_wanted(self, client_id):  # server half; Sec. 4.4: styles are sent "for once"
        return client_id not in self.style_bank

    def client_upload(self, data, rng):
        data = data.resident()  # its images, read for this upload only (lazy clients)
        nets = self.networks(data.train_x.device)
        if self.hp.style_type == "overall":  # Eq. 8
            mu, sigma = overall_style(nets, data.train_x, TRANSFER_BATCH)
        else:  # Eq. 6-7: J random images of its own
            J = single_bank_size(self.hp.J, data.n_train)
            idx = torch.from_numpy(np.sort(rng.choice(data.n_train, size=J, replace=False))).to(data.train_x.device)
            mu, sigma = single_image_styles(nets, data.train_x[idx], TRANSFER_BATCH)
        return {"mu": mu.cpu().numpy().astype(np.float32), "sigma": sigma.cpu().numpy().astype(np.float32)}

    # ---- 3.2.2: the server's style bank, broadcast once per client --------------------------
    def server_payloads(self, uploads):
        for cid, u in uploads.items():  # Eq. 9-10; the first upload of a client is kept
            if u is not None and cid not in self.style_bank:
                self.style_bank[cid] = {k: np.asarray(u[k], dtype=np.float32) for k in STAT_KEYS}
        bank = bank_to_payload(self.style_bank)
        return {cid: (None if cid in self.served else bank) for cid in uploads}

    def sample_count(self, data):  # D^{C_n}: every image in K styles (3.2.3)
        return data.n_train * self.hp.K

    def after_aggregate(self, global_weights, averaged, client_ids, uploads=None):
        self.served.update(client_ids)
        return averaged

    def server_state(self):  # tensors, not numpy arrays: checkpoints hold tensors and plain data only
        bank = {cid: {k: torch.from_numpy(v) for k, v in s.items()} for cid, s in self.style_bank.items()}
        return {"style_bank": bank, "served": sorted(self.served)}

    def load_server_state(self, state):
        bank = state.get("style_bank") or {}
        self.style_bank = {
            cid: {k: np.asarray(v.cpu(), dtype=np.float32) for k, v in s.items()} for cid, s in bank.items()
        }
        self.served = set(state.get("served") or ())

    # ---- 3.2.3: local style transfer (Alg. 1), then FedAvg on D^{C_n} ------------------------
    @torch.no_grad()
    def augmented_dataset(self, data, bank: dict[str, Style], plan: TransferPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """D^{C_n} (Alg. 1) as uint8 [n K, 3, S, S] (image-major: entry i K + k) and labels [n K]."""
        x_u8, dev = data.train_x, data.train_x.device
        n, K = plan.clients.shape
        ids = plan.bank_ids
        own = ids.index(data.client_id)
        mu_table = torch.as_tensor(np.concatenate([bank[c].mu for c in ids]), device=dev)
        sigma_table = torch.as_tensor(np.concatenate([bank[c].sigma for c in ids]), device=dev)
        offsets = np.cumsum([0] + [len(bank[c].mu) for c in ids])[:-1]
        rows = offsets[plan.clients] + plan.styles  # [n, K] rows of the tables
        nets = self.networks(dev)
        out = torch.empty((n * K, *x_u8.shape[1:]), dtype=torch.uint8, device=dev)
        for s in range(0, n, TRANSFER_BATCH):
            e = min(n, s + TRANSFER_BATCH)
            f_c = None
            for k in range(K):
                dst = out[s * K + k : e * K : K]  # entries (i, k) for i in [s, e)
                is_own = torch.from_numpy(plan.clients[s:e, k] == own).to(dev)
                dst[is_own] = x_u8[s:e][is_own]  # Alg. 1 line 6: the image itself
                other = (~is_own).nonzero().squeeze(1)
                if other.numel() == 0:
                    continue
                if f_c is None:
                    f_c = nets.encoder(images01(x_u8[s:e]))  # Eq. 1, once per image
                r = torch.from_numpy(rows[s:e, k]).to(dev)[other]
                dst[other] = to_u8(stylize(nets, f_c[other], mu_table[r], sigma_table[r], x_u8.shape[-2:]))  # Eq. 5
        return out, data.train_y.repeat_interleave(K)

    def local_dataset(self, data, state, payload, generator, shuffle_rng):
        """The local loop trains on D^{C_n} (Alg. 1) instead of the client's own images."""
        cid = data.client_id
        kept = CCSTKept.of(state.extra)
        if payload is not None and kept.ccst_style_bank is None:  # first receipt of B: the client's own copy
            kept.ccst_style_bank = payload_to_bank(payload)
        if kept.ccst_style_bank is None:
            raise RuntimeError(f"CCST: client {cid} has no style bank (the server never sent B)")
        bank = {c: Style(**b) for c, b in kept.ccst_style_bank.items()}
        if kept.ccst_plan is None:  # Alg. 1's random draws, once, kept for a resume
            seed = generator.initial_seed() if generator is not None else int(shuffle_rng.integers(2**62))
            rng = np.random.default_rng(derive_seed(seed, "ccst-plan", cid))
            sizes = {c: len(b.mu) for c, b in bank.items()}
            kept.ccst_plan = dataclasses.asdict(
                transfer_plan(data.n_train, sizes, cid, self.hp.K, rng, self.hp.style_type)
            )
        kept.save_into(state.extra)
        if cid not in self._datasets:
            self._datasets[cid] = self.augmented_dataset(data, bank, TransferPlan(**kept.ccst_plan))
        d_x, d_y = self._datasets[cid]
        return dataclasses.replace(data, train_x=d_x, train_y=d_y)

    def train_step(self, model, x, y, ctx):
        return cross_entropy_step(model, x, y, ctx.real_rows)
