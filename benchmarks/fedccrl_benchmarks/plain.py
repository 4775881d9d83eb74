"""The plain baseline of `fedccrl-bench speed`: FedCCRL as a straightforward implementation runs it.

DESIGN 'Speed' asks to measure every change of the fast path as a ratio against "the plain
version". This module is that version, used only by the benchmark and its tests:

  * images stay ENCODED (PNG bytes in memory, as a folder of image files would be) and a torch
    DataLoader decodes them with PIL for every batch of every epoch;
  * the augmentation runs on the host (fp32 CPU tensors / numpy / PIL), in one of two forms:
    - per batch (`augment="batch"`, the default baseline): as the reference FedCCRL code does it, on the
      decoded batch after the DataLoader: MixStyle with one pool row per sample, the cast to 8-bit levels,
      then torchvision's AugMix on the batch tensor (one op chain per batch; augment/augmix_batch.py
      `augmix_batch`, torchvision's draws and magnitudes), twice for X1 and X2 (Eq. 3);
    - per sample (`augment="per_sample"`, a second row): inside the Dataset, one sample at a time,
      MixStyle with numpy (Alg. 2) then AugMix with PIL ImageOps / Image.transform on the 8-bit image
      (Alg. 3, the AugMix reference code's structure and magnitudes, per sample);
  * float32, contiguous NCHW, no autocast; a per-step `loss.item()` for the running loss;
  * clients one after another; evaluation through a DataLoader at the training batch size.
The loss is the same: `fedccrl_core.learning.losses.fedccrl_loss` on one concatenated forward of the three
views (the fast path's FedCCRL.loss_from_views does the same), with the same Adam, cosine schedule
and per-client optimizer state. tests/test_bench.py checks that both paths give the same losses on
the same views and augmented batches with the same per-channel statistics.

One numeric difference, inherent to a PIL pipeline: the image is quantized to 8 bits before AugMix
(the device path keeps float precision outside its pixel ops).
"""

from __future__ import annotations

import copy
import io
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from fedccrl_core.algorithms.base import Reply
from fedccrl_core.augment.augmix_pil import host_augmix
from fedccrl_core.foundation import contract
from fedccrl_core.learning.aggregation import weighted_average
from fedccrl_core.learning.clients import ClientState
from fedccrl_core.learning.losses import fedccrl_loss


# ---------------------------------------------------------------------------------------------
# Host-side, per-sample augmentation
# ---------------------------------------------------------------------------------------------
def host_mixstyle(
    x: np.ndarray,
    pool_mu: np.ndarray,
    pool_sigma: np.ndarray,
    alpha: float,
    rng: np.random.Generator,
    eps: float = 1e-6,
) -> np.ndarray:
    """Alg. 2 on ONE normalized sample x [C, H, W]: a pool row and lambda ~ Beta(alpha, alpha)."""
    mu = x.mean(axis=(1, 2))
    sigma = np.sqrt(x.var(axis=(1, 2)) + eps)
    j = rng.integers(len(pool_mu))
    lam = rng.beta(alpha, alpha)
    mu_mix = lam * pool_mu[j] + (1 - lam) * mu
    sigma_mix = lam * pool_sigma[j] + (1 - lam) * sigma
    return (sigma_mix[:, None, None] * (x - mu[:, None, None]) / sigma[:, None, None] + mu_mix[:, None, None]).astype(
        np.float32
    )


def host_batch_augment(
    x: torch.Tensor,
    pool_mu: np.ndarray,
    pool_sigma: np.ndarray,
    hp,
    mean: np.ndarray,
    std: np.ndarray,
    rng: np.random.Generator,
    generator: torch.Generator,
) -> torch.Tensor:
    """M on a normalized host batch [B, C, H, W] as the reference code runs it: MixStyle (one pool row
    and one lambda per sample), 8-bit levels, torchvision's AugMix on the whole batch."""
    from fedccrl_core.augment.augmix_batch import augmix_batch, to_uint8_levels

    m = torch.from_numpy(np.asarray(mean, np.float32))[None, :, None, None]
    s = torch.from_numpy(np.asarray(std, np.float32))[None, :, None, None]
    b = x.shape[0]
    if hp.ccdt:
        mu = x.mean(dim=(2, 3), keepdim=True)
        sigma = (x.var(dim=(2, 3), keepdim=True, unbiased=False) + 1e-6).sqrt()
        j = rng.integers(len(pool_mu), size=b)
        lam = torch.from_numpy(rng.beta(hp.alpha, hp.alpha, size=(b, 1, 1, 1)).astype(np.float32))
        mu_mix = lam * torch.from_numpy(pool_mu[j])[:, :, None, None] + (1 - lam) * mu
        sigma_mix = lam * torch.from_numpy(pool_sigma[j])[:, :, None, None] + (1 - lam) * sigma
        x = sigma_mix * (x - mu) / sigma + mu_mix
    if hp.difp:
        levels = to_uint8_levels((x * s + m).clamp(0.0, 1.0))
        x = (augmix_batch(levels, hp.beta, hp.severity, generator=generator) - m) / s
    return x


def host_fedccrl_augment(
    x: np.ndarray, pool_mu, pool_sigma, hp, mean: np.ndarray, std: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """M = AugMix . MixStyle (Eq. 3) on ONE normalized sample [C, H, W] -> normalized [C, H, W]."""
    if hp.ccdt:
        x = host_mixstyle(x, pool_mu, pool_sigma, hp.alpha, rng)
    if hp.difp:
        x01 = np.clip(x * std[:, None, None] + mean[:, None, None], 0.0, 1.0)
        u8 = np.round(x01 * 255.0).astype(np.uint8).transpose(1, 2, 0)  # the PIL image
        aug = host_augmix(np.ascontiguousarray(u8), hp.beta, hp.severity, rng).transpose(2, 0, 1)
        x = ((aug - mean[:, None, None]) / std[:, None, None]).astype(np.float32)
    return x


# ---------------------------------------------------------------------------------------------
# Data: encoded images, decoded per step
# ---------------------------------------------------------------------------------------------
def encode_png(images_u8: np.ndarray) -> list[bytes]:
    """uint8 NHWC -> PNG bytes per image."""
    out = []
    for img in images_u8:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def decode_png(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


class EncodedImages(torch.utils.data.Dataset):
    """Decodes and normalizes one image per item (evaluation)."""

    def __init__(self, encoded: list[bytes], labels, mean, std):
        self.encoded, self.labels = encoded, np.asarray(labels, dtype=np.int64)
        self.mean, self.std = np.asarray(mean, np.float32), np.asarray(std, np.float32)

    def __len__(self):
        return len(self.encoded)

    def normalized(self, i: int) -> np.ndarray:
        img = decode_png(self.encoded[i]).astype(np.float32) / 255.0
        return ((img - self.mean) / self.std).transpose(2, 0, 1).astype(np.float32)

    def __getitem__(self, i):
        return torch.from_numpy(self.normalized(i)), int(self.labels[i])


AUGMENT_FORMS = ("batch", "per_sample")


class FedCCRLViews(EncodedImages):
    """augment "per_sample": (X, X1, X2, y) per item: decode, then Eq. 3 twice on the host; "batch":
    (X, y) per item, and `batch_views` makes X1, X2 of a whole batch. Times its decoding and its
    augmentation (meaningful with num_workers=0, where items are built in this process)."""

    def __init__(self, encoded, labels, mean, std, hp, seed: int, augment: str = "batch"):
        super().__init__(encoded, labels, mean, std)
        if augment not in AUGMENT_FORMS:
            raise ValueError(f"plain baseline: augment must be one of {AUGMENT_FORMS}, got {augment!r}")
        self.hp, self.rng, self.augment = hp, np.random.default_rng(seed), augment
        self.generator = torch.Generator().manual_seed(seed)
        self.pool_mu: np.ndarray | None = None  # set_pool
        self.pool_sigma: np.ndarray | None = None
        self.decode_s = self.augment_s = 0.0

    def batch_views(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.pool_mu is not None and self.pool_sigma is not None  # set_pool comes first
        t0 = time.perf_counter()
        first, second = (
            host_batch_augment(x, self.pool_mu, self.pool_sigma, self.hp, self.mean, self.std, self.rng, self.generator)
            for _ in range(2)
        )
        self.augment_s += time.perf_counter() - t0
        return first, second

    def set_pool(self, mu: np.ndarray, sigma: np.ndarray) -> None:
        self.pool_mu, self.pool_sigma = np.asarray(mu, np.float32), np.asarray(sigma, np.float32)

    def __getitem__(self, i):
        t0 = time.perf_counter()
        x = self.normalized(i)
        t1 = time.perf_counter()
        self.decode_s += t1 - t0
        if self.augment == "batch":
            return torch.from_numpy(x), int(self.labels[i])
        views = [
            host_fedccrl_augment(x, self.pool_mu, self.pool_sigma, self.hp, self.mean, self.std, self.rng)
            for _ in range(2)
        ]
        self.augment_s += time.perf_counter() - t1
        return torch.from_numpy(x), torch.from_numpy(views[0]), torch.from_numpy(views[1]), int(self.labels[i])


def _worker_init(worker_id: int) -> None:  # a distinct numpy stream per DataLoader worker
    info = torch.utils.data.get_worker_info()
    assert info is not None and isinstance(info.dataset, FedCCRLViews)  # a worker of a FedCCRLViews loader
    info.dataset.rng = np.random.default_rng([info.seed % 2**32, worker_id])


@dataclass
class PlainClient:
    """A client of the plain baseline: encoded training images and its Eq. 6-7 statistics (the pools
    stage's output; `client_upload` draws Eq. 8 from them as for the fast path)."""

    client_id: str
    views: FedCCRLViews
    stats_mu: np.ndarray
    stats_sigma: np.ndarray
    state: ClientState = field(default_factory=ClientState)

    @property
    def n_train(self) -> int:
        return len(self.views)

    def loader(self, batch_size: int, seed: int, workers: int = 0) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            self.views,
            batch_size=batch_size,
            shuffle=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(seed),
            worker_init_fn=_worker_init if workers else None,
        )


# ---------------------------------------------------------------------------------------------
# Training and evaluation
# ---------------------------------------------------------------------------------------------
def plain_fedccrl_loss(model, x, x1, x2, y, hp):
    """Eq. 4-5 and 12-16: one forward of cat(X, X1, X2), then fedccrl_loss. Returns (L, terms, logits on X)."""
    b = y.shape[0]
    z_all = model.h(torch.cat([x, x1, x2]))
    logits_all = model.g(z_all)
    z, z1, z2 = z_all.split(b)
    lo, lo1, lo2 = logits_all.split(b)
    loss, terms = fedccrl_loss(
        lo, lo1, lo2, z, z1, z2, y, lambda1=hp.lambda1, lambda2=hp.lambda2, tau=hp.tau, l_ra=hp.l_ra, l_js=hp.l_js
    )
    return loss, terms, lo


def plain_local_train_steps(alg, model, client: PlainClient, global_weights: dict, loader, device):
    """Algorithm 1 lines 9-21 for one client, fp32, batches from `loader`; yields after every step and
    returns the Reply (same optimizer, schedule and state handling as Algorithm.local_train)."""
    model.load_state_dict(global_weights)
    model.train()
    opt, state = alg.make_optimizer(model), client.state
    sched = alg.make_scheduler(opt)
    if state.optimizer is not None:
        opt.load_state_dict(state.optimizer)
    if state.scheduler is not None:
        sched.load_state_dict(state.scheduler)
    running = 0.0
    correct = seen = steps = 0
    for _ in range(alg.local.local_epochs):
        for item in loader:
            if item[-1].shape[0] < 2:
                continue
            if len(item) == 2:  # per-batch augmentation, on the host batch (the reference's form)
                x, y = item
                x1, x2 = client.views.batch_views(x)
            else:
                x, x1, x2, y = item
            x, x1, x2, y = (t.to(device) for t in (x, x1, x2, y))
            loss, _, logits = plain_fedccrl_loss(model, x, x1, x2, y, alg.hp)
            opt.zero_grad()
            loss.backward()
            opt.step()
            running += loss.item()
            correct += (logits.argmax(1) == y).sum().item()
            seen += y.shape[0]
            steps += 1
            yield
        sched.step()
    state.optimizer = copy.deepcopy(opt.state_dict())
    state.scheduler = sched.state_dict()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Reply(
        client.client_id,
        weights,
        client.n_train,
        {contract.LOSS: running / max(steps, 1), contract.TRAIN_ACC: correct / max(seen, 1)},
    )


def run_to_end(steps):
    while True:
        try:
            next(steps)
        except StopIteration as finished:
            return finished.value


@torch.no_grad()
def plain_accuracy(model, images: EncodedImages, batch_size: int, device, workers: int = 0) -> float:
    model.eval()
    correct = 0
    for x, y in torch.utils.data.DataLoader(images, batch_size=batch_size, num_workers=workers):
        correct += (model(x.to(device)).argmax(1) == y.to(device)).sum().item()
    model.train()
    return correct / max(len(images), 1)


def plain_round(
    alg,
    model,
    clients: list[PlainClient],
    global_weights: dict,
    val: EncodedImages,
    target: EncodedImages,
    rnd: int,
    seed: int,
    device,
    workers: int = 0,
) -> tuple[dict, dict]:
    """One round of Algorithm 1, clients one after another. Returns (new global weights, record)."""
    uploads = {
        c.client_id: alg.client_upload(c, np.random.default_rng([seed, rnd, i])) for i, c in enumerate(clients)
    }  # Eq. 8
    payloads = alg.server_payloads(uploads)  # line 7
    replies = []
    for i, c in enumerate(clients):
        c.views.set_pool(payloads[c.client_id]["mu"], payloads[c.client_id]["sigma"])
        torch.manual_seed(seed * 1000 + rnd * 100 + i)
        loader = c.loader(alg.local.batch_size, seed * 1000 + rnd * 100 + i, workers)
        replies.append(run_to_end(plain_local_train_steps(alg, model, c, global_weights, loader, device)))
    global_weights = weighted_average([r.weights for r in replies], [r.n for r in replies])  # Eq. 2
    model.load_state_dict(global_weights)
    bs = alg.local.batch_size
    record = {
        contract.ROUND: rnd,
        contract.VAL_ACC: plain_accuracy(model, val, bs, device, workers),
        contract.TARGET_ACC: plain_accuracy(model, target, bs, device, workers),
    }
    return global_weights, record
