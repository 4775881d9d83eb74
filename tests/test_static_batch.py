"""Static batch shapes (learning/static_batch.py): a partial batch padded to the batch size under a row mask computes
what the unpadded batch computes, every training step of a padding algorithm has one shape, and the step's own code
asks the device for nothing (no host sync)."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import ALGORITHMS, build_algorithm
from fedccrl_core.algorithms.base import cross_entropy_step
from fedccrl_core.foundation import fastpath
from fedccrl_core.learning.accuracy import predict
from fedccrl_core.learning.clients import ClientData, ClientState
from fedccrl_core.learning.models import build_model
from fedccrl_core.learning.static_batch import BATCH_NORMS, pad_rows, real_row_index, real_rows_only

# float32 sums in another order (the padded batch's convolutions run over B rows, BatchNorm's statistics are taken
# by var_mean instead of the native kernel). Measured on these sizes, 5 seeds, every loss, logit, gradient and
# running statistic: the largest |padded - unpadded| was 1.6e-6 of the tensor's largest value (AVX-512), 1.7e-6
# with ATEN_CPU_CAPABILITY=default; the tolerance leaves a wide margin for other CPUs
TOL = dict(rtol=1e-4, atol=1e-5)


def _images(n, size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8)


def _client(n, size=16, seed=0):
    x = _images(n, size, seed)
    y = torch.arange(n) % 4
    mu = np.random.default_rng(seed).normal(size=(n, 3)).astype(np.float32)
    sigma = np.abs(np.random.default_rng(seed + 1).normal(size=(n, 3))).astype(np.float32) + 0.5
    return ClientData(f"c{seed}", "d", x, y, x[:0], y[:0], mu, sigma)


def _normalized(n, size=16, seed=0):
    return _images(n, size, seed).float() / 255.0 - 0.5


def test_pad_rows_repeats_the_batch_and_the_real_rows_are_the_first_of_each_block():
    idx = torch.tensor([7, 3, 9])
    assert pad_rows(idx, 8).tolist() == [7, 3, 9, 7, 3, 9, 7, 3]
    assert pad_rows(idx, 3) is idx
    assert real_row_index(12, 2, 4, "cpu").tolist() == [0, 1, 4, 5, 8, 9]
    with pytest.raises(ValueError, match="multiple of 4"):
        real_row_index(10, 2, 4, "cpu")


@pytest.mark.parametrize("momentum", [0.1, None])
def test_a_padded_cross_entropy_step_equals_the_unpadded_one(momentum):
    """Loss, every gradient and every BatchNorm running statistic of 5 real rows padded to 8, against the 5 alone."""
    torch.manual_seed(0)
    model, padded = build_model("small_cnn", 4), build_model("small_cnn", 4)
    padded.load_state_dict(model.state_dict())
    for m in [*model.modules(), *padded.modules()]:
        if isinstance(m, BATCH_NORMS):
            m.momentum = momentum
    model.train(), padded.train()
    x, y = _normalized(5), torch.tensor([0, 1, 2, 3, 0])
    idx = pad_rows(torch.arange(5), 8)

    loss, _, logits = cross_entropy_step(model, x, y)
    loss.backward()
    with real_rows_only(padded, 5, 8):
        p_loss, _, p_logits = cross_entropy_step(padded, x[idx], y[idx], real_rows=5)
    p_loss.backward()

    assert p_logits.shape == logits.shape
    assert torch.allclose(p_loss, loss, **TOL) and torch.allclose(p_logits, logits, **TOL)
    for (name, p), q in zip(model.named_parameters(), padded.parameters()):
        assert torch.allclose(q.grad, p.grad, **TOL), name
    for (name, b), c in zip(model.named_buffers(), padded.buffers()):
        assert torch.equal(c, b) if b.dtype == torch.long else torch.allclose(c, b, **TOL), name
    # the masked forward is gone after the block: BatchNorm is torch's own again
    assert all("forward" not in vars(m) for m in padded.modules())


@pytest.mark.parametrize("forward", ["joint", "per_view"])
def test_a_padded_fedccrl_loss_equals_the_unpadded_one(forward):
    """Eq. 4-16 on three given views: 6 real rows padded to 8 (joint: one pass of 3 blocks, per_view: 3 passes)."""
    torch.manual_seed(1)
    alg = build_algorithm("fedccrl", LocalConfig(rounds=1, local_epochs=1, batch_size=8), {"forward": forward})
    model = build_model("small_cnn", 4)
    padded = build_model("small_cnn", 4)
    padded.load_state_dict(model.state_dict())
    x, x1, x2 = _normalized(6, seed=1), _normalized(6, seed=2), _normalized(6, seed=3)
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    idx = pad_rows(torch.arange(6), 8)

    loss, terms, _logits = alg.loss_from_views(model, x, x1, x2, y)
    loss.backward()
    with real_rows_only(padded, 6, 8):
        p_loss, p_terms, p_logits = alg.loss_from_views(padded, x[idx], x1[idx], x2[idx], y[idx], real_rows=6)
    p_loss.backward()

    assert p_logits.shape == (6, 4)
    assert torch.allclose(p_loss, loss, **TOL)
    assert terms.keys() == p_terms.keys() and all(torch.allclose(p_terms[k], terms[k], **TOL) for k in terms)
    for (name, p), q in zip(model.named_parameters(), padded.parameters()):
        assert torch.allclose(q.grad, p.grad, **TOL), name


def _shapes_of_a_client_round(alg_name, monkeypatch, static, n=20, batch=8, **hp):
    """(row counts of every training forward, the Reply) of one client-round, static shapes forced on or off."""
    monkeypatch.setattr(fastpath, "static_batches", lambda fast, device: static)
    torch.manual_seed(2)
    alg = build_algorithm(alg_name, LocalConfig(rounds=1, local_epochs=2, batch_size=batch), hp)
    model = build_model("small_cnn", 4)
    rows = []
    handle = model.h.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]) if m.training else None)
    clients = [_client(n, seed=0), _client(n, seed=1)]
    payload = alg.server_payloads({c.client_id: alg.client_upload(c, np.random.default_rng(0)) for c in clients})
    w = {k: v.clone() for k, v in model.state_dict().items()}
    reply = alg.local_train(
        model,
        clients[0],
        ClientState(),
        w,
        payload[clients[0].client_id],
        torch.Generator().manual_seed(0),
        np.random.default_rng(0),
    )
    handle.remove()
    return rows, reply


@pytest.mark.parametrize("alg_name,views", [("fedavg", 1), ("fedccrl", 3)])
def test_with_static_shapes_every_training_step_has_the_batch_size(alg_name, views, monkeypatch):
    """20 images in batches of 8: 8, 8 and a partial 4, padded to 8 (FedCCRL: its three views in one pass)."""
    rows, reply = _shapes_of_a_client_round(alg_name, monkeypatch, static=True)
    assert rows == [views * 8] * 6
    dynamic, _ = _shapes_of_a_client_round(alg_name, monkeypatch, static=False)
    assert dynamic == [views * 8, views * 8, views * 4] * 2
    assert reply.n == 20


def test_a_client_round_with_static_shapes_trains_the_same_weights(monkeypatch):
    """FedAvg draws nothing but the shuffle: padded or not, its client-round ends on the same weights and metrics."""
    _, padded = _shapes_of_a_client_round("fedavg", monkeypatch, static=True)
    _, plain = _shapes_of_a_client_round("fedavg", monkeypatch, static=False)
    for k, v in plain.weights.items():
        assert (
            torch.equal(padded.weights[k], v)
            if v.dtype == torch.long
            else torch.allclose(padded.weights[k], v, rtol=1e-3, atol=1e-4)
        ), k
    assert padded.metrics.keys() == plain.metrics.keys()
    assert padded.metrics["train_acc"] == plain.metrics["train_acc"]
    assert abs(padded.metrics["loss"] - plain.metrics["loss"]) < 1e-4


def test_an_algorithm_that_pads_has_only_torchs_own_batch_norms():
    """real_rows_only masks torch's BatchNorm classes; a subclass (FedFD's) has its own statistics and would be
    left unmasked, so an algorithm whose model holds one must not pad (Algorithm.pads_partial_batch)."""
    padding = [name for name, cls in ALGORITHMS.items() if cls.pads_partial_batch]
    assert {"fedavg", "fedccrl"} <= set(padding)
    for name in padding:
        model = ALGORITHMS[name].build_model("small_cnn", 4)
        odd = [type(m).__name__ for m in model.modules() if isinstance(m, BATCH_NORMS) and type(m) not in BATCH_NORMS]
        assert odd == [], name
    assert not ALGORITHMS["fedfd"].pads_partial_batch


def test_evaluation_pads_its_last_batch_and_predicts_the_same(monkeypatch):
    torch.manual_seed(3)
    model = build_model("small_cnn", 4).eval()
    x = _images(21)
    plain = predict(model, x, batch_size=8)
    monkeypatch.setattr(fastpath, "static_batches", lambda fast, device: True)
    rows = []
    handle = model.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    static = predict(model, x, batch_size=8)
    handle.remove()
    assert rows == [8, 8, 8]
    assert torch.equal(static, plain)


# the tensor calls that wait for the device on an accelerator: a value read back to the host
SYNCING = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu"}


class _HostReads(TorchFunctionMode):
    """Records every syncing call made by fedccrl_core's own code (torch's internals, e.g. Adam reading its step
    count, a CPU tensor, are not ours to check)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCING:
            caller = sys._getframe(1)  # these are C++ tensor methods: the frame that called one
            if "fedccrl_core" in caller.f_code.co_filename:
                self.calls.append(f"{name} at {caller.f_code.co_filename.split('fedccrl_core')[-1]}:{caller.f_lineno}")
        return func(*args, **(kwargs or {}))


def test_the_cuda_code_path_switches_every_device_and_only_inside():
    """fastpath.cuda_code_path(): the CUDA fast path's branches on the CPU (the dispatch bench's --code-path cuda),
    and the CPU's own again when it ends, also through an error."""
    assert not fastpath.enabled(True, "cpu") and fastpath.compacts("cpu") and not fastpath.static_batches(True, "cpu")
    with pytest.raises(RuntimeError), fastpath.cuda_code_path():
        assert fastpath.enabled(True, "cpu") and fastpath.static_batches(True, "cpu")
        assert not fastpath.enabled(False, "cpu") and not fastpath.compacts("cpu")
        raise RuntimeError
    assert not fastpath.enabled(True, "cpu") and fastpath.compacts("cpu")
    assert not fastpath.compacts("meta")  # an accelerator never compacts


@pytest.mark.parametrize("alg_name", ["fedavg", "fedccrl"])
def test_the_local_step_reads_nothing_back_from_the_device(alg_name):
    """Every step of a client-round, the padded one included, on the accelerator's code path
    (fastpath.cuda_code_path: static shapes on, AugMix without the CPU's compaction, bf16 autocast, fused Adam):
    fedccrl_core asks the device for no value until the round's metrics."""
    with fastpath.cuda_code_path():
        alg = build_algorithm(alg_name, LocalConfig(rounds=1, local_epochs=1, batch_size=8))
        model = build_model("small_cnn", 4)
        clients = [_client(20, seed=0), _client(20, seed=1)]
        payload = alg.server_payloads({c.client_id: alg.client_upload(c, np.random.default_rng(0)) for c in clients})
        steps = alg.local_train_steps(
            model,
            clients[0],
            ClientState(),
            {k: v.clone() for k, v in model.state_dict().items()},
            payload[clients[0].client_id],
            torch.Generator().manual_seed(0),
            np.random.default_rng(0),
        )
        next(steps)  # the first step moves the pool to the device and builds the constants
        reads = _HostReads()
        with reads:
            next(steps)
            next(steps)  # the padded last batch
        assert reads.calls == []
        with pytest.raises(StopIteration):
            next(steps)


def test_the_host_read_check_sees_a_read():
    """The recorder above is not blind: a value read in fedccrl_core code is reported."""
    from fedccrl_core.learning import accuracy

    reads = _HostReads()
    model = build_model("small_cnn", 4)
    with reads:
        accuracy.accuracy(model, _images(4), torch.tensor([0, 1, 2, 3]), batch_size=4)
    assert any(c.startswith(("__float__", "item")) for c in reads.calls), reads.calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (checks the padded step for host syncs)")
@pytest.mark.parametrize("alg_name", ["fedavg", "fedccrl"])
def test_a_client_round_on_cuda_has_no_host_sync_and_one_shape(alg_name):
    device = torch.device("cuda")
    alg = build_algorithm(alg_name, LocalConfig(rounds=1, local_epochs=1, batch_size=8))
    model = build_model("small_cnn", 4).to(device)
    clients = [_client(20, seed=s) for s in (0, 1)]
    clients = [
        ClientData(
            c.client_id,
            c.domain,
            c.train_x.to(device),
            c.train_y.to(device),
            c.val_x.to(device),
            c.val_y.to(device),
            c.stats_mu,
            c.stats_sigma,
        )
        for c in clients
    ]
    payload = alg.server_payloads({c.client_id: alg.client_upload(c, np.random.default_rng(0)) for c in clients})
    rows = []
    model.h.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]) if m.training else None)
    steps = alg.local_train_steps(
        model,
        clients[0],
        ClientState(),
        {k: v.clone() for k, v in model.state_dict().items()},
        payload[clients[0].client_id],
        torch.Generator(device=device).manual_seed(0),
        np.random.default_rng(0),
    )
    next(steps)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        next(steps)
        next(steps)  # the padded last batch
    finally:
        torch.cuda.set_sync_debug_mode("default")
    steps.close()
    assert len(set(rows)) == 1


@pytest.mark.parametrize("static,calls", [(True, 1), (False, 2)])
def test_fedccrl_draws_both_views_in_one_call_on_the_accelerator_path(static, calls, monkeypatch):
    """Eq. 3's X1 = M(X), X2 = M(X): one call on [X; X] where M draws per row (the CUDA fast path), two on the CPU
    (whose random stream, and so numbers, stay as they were). Either way two different views of X's shape."""
    fedccrl_module = importlib.import_module("fedccrl_core.algorithms.fedccrl")
    from fedccrl_core.algorithms.base import StepContext

    monkeypatch.setattr(fastpath, "static_batches", lambda fast, device: static)
    seen = []
    real_augment = fedccrl_module.fedccrl_augment

    def counting(x, *args):
        seen.append(x.shape[0])
        return real_augment(x, *args)

    monkeypatch.setattr(fedccrl_module, "fedccrl_augment", counting)
    alg = build_algorithm("fedccrl", LocalConfig(rounds=1, local_epochs=1, batch_size=8))
    x = _normalized(8)
    pool = {"mu": np.zeros((5, 3), np.float32), "sigma": np.ones((5, 3), np.float32)}
    x1, x2 = alg.augmented_views(x, StepContext(pool, [], torch.Generator().manual_seed(0)))
    assert seen == [8 * (3 - calls)] * calls
    assert x1.shape == x2.shape == x.shape and not torch.equal(x1, x2)
    reference = build_algorithm(
        "fedccrl", LocalConfig(rounds=1, local_epochs=1, batch_size=8), {"variant": "reference"}
    )
    assert not reference.views_in_one_draw("cpu")  # the reference's per-batch AugMix: one chain per call
