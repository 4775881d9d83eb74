"""FedCCRL as the reference code runs it (train.fedccrl.variant: reference) beside the paper's
reading. Each switch pinned on tiny tensors against hand-computed values; one local step under the
reference variant differs from the paper only where a switch says so; the reference variant end to
end through the in-process engine, Flower (loopback Grid) and the train stage (params.yaml -> MLflow)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flower_harness import HPARAMS, assert_same_history, loopback, make_spec, run_inprocess, serve
from torch import nn

from fedccrl_core.algorithm_params.fedccrl import VARIANT_SWITCHES, resolve_variant
from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms.fedccrl import FedCCRL
from fedccrl_core.augment.augmix import _augmix_with, sample_augmix_plan
from fedccrl_core.augment.augmix_batch import (
    augmix_batch,
    batch_op_magnitude,
    sample_batch_augmix_plan,
    to_uint8_levels,
)
from fedccrl_core.augment.augmix_ops import ALL_OPS, OPS, apply_op
from fedccrl_core.augment.ccdt import mixstyle, pool_rows
from fedccrl_core.augment.compose import fedccrl_augment
from fedccrl_core.augment.settings import AugmentParams
from fedccrl_core.data.pools import compute_statistics, unbiased_sigma, upload_size
from fedccrl_core.foundation.errors import DataError
from fedccrl_core.learning.clients import ClientData, ClientState
from fedccrl_core.learning.losses import supcon_loss, supcon_self_positive_loss, three_view_ce
from fedccrl_core.learning.models import build_model
from fedccrl_core.learning.statistics import IMAGENET_MEAN, IMAGENET_STD, channel_stats

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")
PAPER = {k: v[0] for k, v in VARIANT_SWITCHES.items()}
REFERENCE = {k: v[1] for k, v in VARIANT_SWITCHES.items()}


# ================================================================ the registry of switches
def test_variant_resolves_auto_switches_and_explicit_ones_win():
    base = FedCCRL.Params()
    assert {k: getattr(resolve_variant(base), k) for k in PAPER} == PAPER
    ref = resolve_variant(base.model_copy(update={"variant": "reference"}))
    assert {k: getattr(ref, k) for k in REFERENCE} == REFERENCE
    assert ref.uint8_wrap is False  # the reference's wrap-around is a defect: never implied by the variant
    assert resolve_variant(base.model_copy(update={"variant": "reference", "l_cls": "mean"})).l_cls == "mean"
    assert FedCCRL(LocalConfig(), {"variant": "reference"}).hp.forward == "per_view"


@pytest.mark.parametrize(
    "key,value", [("variant", "code"), ("forward", "twice"), ("supcon", True), ("uint8_wrap", "yes")]
)
def test_bad_switch_is_one_error_naming_the_key(key, value):
    with pytest.raises(ValueError, match=rf"train\.fedccrl\.{key}\b"):
        FedCCRL(LocalConfig(), {key: value})


# ================================================================ (2) L_CLS: mean (Eq. 16) vs sum
def test_l_cls_sum_against_mean():
    y = torch.tensor([0])
    views = (torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]]), torch.tensor([[0.0, math.log(3.0)]]))
    ce = [math.log(2.0), -math.log(3.0 / 4.0), -math.log(1.0 / 4.0)]  # softmax (1/2, 1/2), (3/4, 1/4), (1/4, 3/4)
    assert three_view_ce(*views, y).item() == pytest.approx(sum(ce) / 3.0, rel=1e-6)
    assert three_view_ce(*views, y, reduction="sum").item() == pytest.approx(sum(ce), rel=1e-6)


# ================================================================ (3) SupCon: P(i) without i vs self-positive
def test_supcon_self_positive_against_paper():
    """2B = 4 unit rows a=(1,0) b=(0,1) | c=(.6,.8) d=(.8,.6), labels 0 1 | 0 1, tau = 1: cos a.c = b.d = .6,
    a.d = b.c = .8, a.b = 0, c.d = .96. Anchors a, b: A(i) sums D1 = 1 + e^.6 + e^.8; anchors c, d:
    D2 = e^.6 + e^.8 + e^.96. Eq. 11: the one positive has sim .6, so L = (2 log D1 + 2 log D2)/4 - .6.
    The reference averages sim over {i, p} = (1 + .6)/2 = .8 instead: the same minus .2."""
    z1, z = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[0.6, 0.8], [0.8, 0.6]])
    y = torch.tensor([0, 1])
    d1, d2 = 1 + math.exp(0.6) + math.exp(0.8), math.exp(0.6) + math.exp(0.8) + math.exp(0.96)
    logs = (math.log(d1) + math.log(d2)) / 2
    assert supcon_loss(z1, z, y, y, tau=1.0).item() == pytest.approx(logs - 0.6, abs=1e-5)
    assert supcon_self_positive_loss(z1, z, y, y, tau=1.0).item() == pytest.approx(logs - 0.8, abs=1e-5)
    # one sample, two views at cos .6: Eq. 11 gives exactly 0 (the only other row is the positive);
    # the self-positive form log e^.6 - (1 + .6)/2 = -.2 (it can go negative)
    one, other = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.6, 0.8]])
    assert supcon_loss(one, other, y[:1], y[:1], tau=1.0).item() == pytest.approx(0.0, abs=1e-6)
    assert supcon_self_positive_loss(one, other, y[:1], y[:1], tau=1.0).item() == pytest.approx(-0.2, abs=1e-6)


# ================================================================ (4) AugMix: per sample (Alg. 3) vs batch-level
def test_batch_magnitudes_are_torchvision_bins():
    """linspace(0, max, 10)[bin], bins 0..severity-1; hand values at bin 2 (2/9 of max), W = 36, H = 18."""
    ids = torch.arange(len(ALL_OPS))
    mag = batch_op_magnitude(ids, torch.full_like(ids, 2), torch.full((len(ids),), -1.0), height=18, width=36)
    want = {
        "autocontrast": 0.0,
        "equalize": 0.0,
        "posterize": 3.0,  # 4 - round(2 / 2.25)
        "rotate": -30 * 2 / 9,
        "solarize": 255 * 7 / 9,
        "shear_x": -0.3 * 2 / 9,
        "shear_y": -0.3 * 2 / 9,
        "translate_x": -2.0,
        "translate_y": -1.0,  # -int(12 * 2/9 = 2.67), -int(6 * 2/9 = 1.33)
        "brightness": -0.2,
        "color": -0.2,
        "contrast": -0.2,
        "sharpness": -0.2,
    }
    assert dict(zip(ALL_OPS, mag.tolist())) == pytest.approx(want, rel=1e-6)
    bins0 = batch_op_magnitude(ids, torch.zeros_like(ids), torch.ones(len(ids)), 18, 36)
    assert bins0[ALL_OPS.index("posterize")] == 4 and bins0[ALL_OPS.index("solarize")] == 255
    assert all(bins0[ALL_OPS.index(n)] == 0 for n in ("rotate", "shear_x", "translate_x", "brightness"))


def test_batch_plan_one_chain_per_batch_13_ops_against_per_sample_plan():
    g = torch.Generator().manual_seed(0)
    seen_ops, seen = set(), {}
    for _ in range(300):
        plan = sample_batch_augmix_plan(5, 18, 36, beta=1.0, severity=3, generator=g)
        assert torch.equal(plan.op, plan.op[:, :1].expand_as(plan.op))  # the same chain for every sample
        assert torch.equal(plan.magnitude, plan.magnitude[:, :1].expand_as(plan.magnitude))
        assert (plan.op[:, :, 0] >= 0).all()  # 3 chains, each at least one op deep
        assert (plan.weight > 0).all() and torch.allclose(plan.weight.sum(1), torch.ones(5))  # k = 3 always
        assert len(set(plan.m.tolist())) == 5  # the Beta weight is per sample
        for op, m in zip(plan.op[:, 0].flatten().tolist(), plan.magnitude[:, 0].flatten().tolist()):
            if op >= 0:
                seen_ops.add(op)
                seen.setdefault(ALL_OPS[op], set()).add(round(abs(m), 5))
    assert seen_ops == set(range(13))  # all 13 ops, the 4 color ops included
    assert seen["shear_x"] == {0.0, round(0.3 / 9, 5), round(0.6 / 9, 5)}  # severity 3: bins 0, 1, 2
    assert seen["posterize"] == {4.0, 3.0} and seen["translate_x"] == {0.0, 1.0, 2.0}
    assert seen["brightness"] == {0.0, 0.1, 0.2}
    per_sample = sample_augmix_plan(64, 18, 36, generator=torch.Generator().manual_seed(0))
    assert int(per_sample.op.max()) < len(OPS)  # Alg. 3 draws from the 9 ops of O only
    assert len({tuple(per_sample.op[:, b].flatten().tolist()) for b in range(64)}) > 32  # its own chain per sample
    assert (per_sample.weight == 0).any()  # and k ~ U{1, 2, 3}: unused chain slots


def test_batch_augmix_applies_one_chain_to_every_sample():
    """Identical images with the per-sample weights equalized: batch-level AugMix gives identical outputs,
    per-sample AugMix does not (each image has its own chain)."""
    x = torch.rand(1, 3, 12, 12).expand(6, 3, 12, 12).contiguous()
    for sampler, all_ops, same in ((sample_batch_augmix_plan, True, True), (sample_augmix_plan, False, False)):
        plan = sampler(6, 12, 12, generator=torch.Generator().manual_seed(3))
        plan.weight = torch.full((6, 3), 1 / 3)
        plan.m = torch.full((6,), 0.25)
        if not all_ops:
            plan.op[:, :, 0] = torch.randint(0, len(OPS), (3, 6), generator=torch.Generator().manual_seed(4))
        out = _augmix_with(x, plan, all_ops=all_ops)
        assert torch.equal(out, out[:1].expand_as(out)) is same


def test_color_ops_by_hand():
    x = torch.full((1, 3, 5, 5), 0.5)
    assert torch.allclose(apply_op(x, "brightness", 0.2), torch.full_like(x, 0.6))  # factor 1.2 x
    gray = torch.full((1, 3, 5, 5), 0.4)  # torchvision's gray weights sum to .9999: gray(.4) = .39996
    assert torch.allclose(apply_op(gray, "color", 0.2), torch.full_like(gray, 1.2 * 0.4 - 0.2 * 0.39996), atol=1e-7)
    img = torch.zeros(1, 3, 5, 5)
    img[:, 0] = 0.5  # R = .5: gray = .2989 * .5 everywhere, its mean too
    out = apply_op(img, "contrast", -0.1)  # .9 x + .1 mean(gray)
    assert torch.allclose(out[:, 0], torch.full((1, 5, 5), 0.9 * 0.5 + 0.1 * 0.2989 * 0.5))
    assert torch.allclose(out[:, 1], torch.full((1, 5, 5), 0.1 * 0.2989 * 0.5))
    delta = torch.zeros(1, 3, 5, 5)
    delta[:, :, 2, 2] = 1.0
    sharp = apply_op(delta, "sharpness", -0.5)  # .5 x + .5 smooth; smooth(center) = 5/13, neighbours 1/13
    assert sharp[0, 0, 2, 2].item() == pytest.approx(0.5 + 0.5 * 5 / 13)
    assert sharp[0, 0, 1, 1].item() == pytest.approx(0.5 / 13)
    assert sharp[0, 0, 0, 0].item() == 0.0  # border pixels keep the original (torchvision)


def test_uint8_levels_truncate_and_wrap_as_the_reference_cast():
    x = torch.tensor([-0.3, 0.5, 1.2, 1.0])
    assert (to_uint8_levels(x) * 255).round().tolist() == [0, 127, 255, 255]  # truncation, then clamp
    assert (to_uint8_levels(x, wrap=True) * 255).round().tolist() == [180, 127, 50, 255]  # -76 mod 256 = 180
    assert torch.equal(to_uint8_levels(x, wrap=True), (x * 255).to(torch.uint8).float() / 255)  # the CPU cast


def test_uint8_wrap_only_changes_pixels_outside_0_1():
    """Between MixStyle and AugMix: out-of-range pixels wrap instead of clamping; others are the same."""
    x = torch.randn(4, 3, 8, 8) * 2.0  # normalized, many pixels outside [0, 1] once denormalized
    kw: dict = dict(ccdt=False, difp=True, augmix="batch")
    a = fedccrl_augment(x, None, None, AugmentParams(**kw), torch.Generator().manual_seed(0))
    b = fedccrl_augment(x, None, None, AugmentParams(**kw, uint8_wrap=True), torch.Generator().manual_seed(0))
    assert not torch.equal(a, b)
    inside = fedccrl_augment(x.clamp(-0.5, 0.5), None, None, AugmentParams(**kw), torch.Generator().manual_seed(0))
    assert torch.equal(
        inside,
        fedccrl_augment(
            x.clamp(-0.5, 0.5), None, None, AugmentParams(**kw, uint8_wrap=True), torch.Generator().manual_seed(0)
        ),
    )
    out = augmix_batch(torch.rand(2, 3, 8, 8), generator=torch.Generator().manual_seed(1))
    assert torch.equal(out * 255, (out * 255).round())  # torchvision's uint8 output: 8-bit levels


# ================================================================ (5) MixStyle: population vs unbiased, pool draws
def test_unbiased_against_population_statistics():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0]).view(1, 1, 2, 2)  # mean 1.5; var 5/4 (over HW) or 5/3 (over HW - 1)
    mu, pop = channel_stats(x, eps=0.0)
    _, unb = channel_stats(x, eps=0.0, unbiased=True)
    assert (
        mu.item() == 1.5
        and pop.item() == pytest.approx(math.sqrt(1.25))
        and unb.item() == pytest.approx(math.sqrt(5 / 3))
    )
    one, zero = torch.ones(1), torch.zeros(1, 1)  # lambda = 1: x_hat = (x - mu) / sigma(x) with the pool row (0, 1)
    for unbiased, var in ((False, 1.25), (True, 5 / 3)):
        got = mixstyle(x, zero, torch.ones(1, 1), one, eps=0.0, unbiased=unbiased)
        assert torch.allclose(got.flatten(), (torch.tensor([0.0, 1, 2, 3]) - 1.5) / math.sqrt(var))


def test_pool_rows_distinct_when_the_pool_is_large_enough():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert sorted(pool_rows(10, 10, "reference", g).tolist()) == list(range(10))  # a permutation
        assert len(set(pool_rows(10, 6, "reference", g).tolist())) == 6
    small = pool_rows(3, 50, "reference", g)  # fewer rows than B: with replacement
    assert set(small.tolist()) == {0, 1, 2}
    assert any(len(set(pool_rows(10, 10, "with_replacement", g).tolist())) < 10 for _ in range(5))


# ================================================================ (6) uploads: ceil (Eq. 8) vs floor with the unbiased std
def test_floor_against_ceil_uploads():
    assert (upload_size(25, 0.1), upload_size(25, 0.1, "floor")) == (3, 2)
    assert (upload_size(30, 0.1), upload_size(30, 0.1, "floor")) == (3, 3)
    assert upload_size(100, 0.29, "floor") == 28  # int(100 * 0.29) = int(28.999999999999996), as the reference
    with pytest.raises(DataError, match="train.fedccrl.upload"):
        upload_size(9, 0.1, "floor")


def test_reference_upload_is_floor_rows_with_unbiased_std():
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (25, 4, 4, 3), dtype=np.uint8)
    mu, sigma = compute_statistics(imgs, IMAGENET_MEAN, IMAGENET_STD)
    data = ClientData.from_numpy("c", "d", imgs, np.zeros(25), imgs[:0], np.zeros(0), "cpu", mu, sigma)
    paper = FedCCRL(LocalConfig()).client_upload(data, np.random.default_rng(1))
    ref = FedCCRL(LocalConfig(), {"variant": "reference"}).client_upload(data, np.random.default_rng(1))
    assert paper["mu"].shape == (3, 3) and ref["mu"].shape == (2, 3)  # ceil(2.5) vs floor(2.5)
    rows = [int(np.flatnonzero((mu == m).all(1))[0]) for m in ref["mu"]]
    x = torch.from_numpy(imgs[rows]).permute(0, 3, 1, 2).float() / 255
    x = (x - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    _, want = channel_stats(x, unbiased=True)  # what the reference computes on the images (torch.var)
    np.testing.assert_allclose(ref["sigma"], want.numpy(), rtol=1e-5)
    np.testing.assert_allclose(unbiased_sigma(sigma, 16)[rows], want.numpy(), rtol=1e-5)
    assert not np.allclose(sigma[rows], want.numpy(), rtol=1e-3)  # population and unbiased really differ at HW = 16


# ================================================================ (1) forward: one pass on 3B vs three passes
class TinyBN(nn.Module):
    """h = BatchNorm over one feature (no affine), g = identity on 2 'classes' [z, -z]."""

    def __init__(self):
        super().__init__()
        self.h = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(1, affine=False, eps=1e-12))  # eps must be > 0 in training
        self.g = nn.Linear(1, 2, bias=False)
        with torch.no_grad():
            self.g.weight.copy_(torch.tensor([[1.0], [-1.0]]))


def test_three_bn_passes_against_one():
    x, x1, x2 = torch.tensor([[0.0], [2.0]]), torch.tensor([[10.0], [12.0]]), torch.tensor([[20.0], [22.0]])
    y = torch.tensor([0, 1])
    out = {}
    for forward in ("joint", "per_view"):
        alg = FedCCRL(LocalConfig(), {"forward": forward})
        model = TinyBN().train()
        _, terms, logits = alg.loss_from_views(model, x, x1, x2, y)
        out[forward] = (logits[:, 0], terms, model.h[1])
    z, terms, bn = out["per_view"]  # each view normalized by its own batch: every view becomes (-1, 1)
    assert torch.allclose(z, torch.tensor([-1.0, 1.0]))
    assert terms["l_js"].item() == pytest.approx(0.0, abs=1e-7)  # three identical predictions
    # running mean after 3 updates with momentum .1: clean 1 -> .1, view 1 (11) -> 1.19, view 2 (21) -> 3.171
    assert bn.running_mean.item() == pytest.approx(3.171) and int(bn.num_batches_tracked) == 3
    z, terms, bn = out["joint"]  # one batch of 6: mean 11, population var (121+81+1+1+81+121)/6
    assert torch.allclose(z, torch.tensor([-11.0, -9.0]) / math.sqrt(406 / 6))
    assert terms["l_js"].item() > 0.1
    assert bn.running_mean.item() == pytest.approx(1.1) and int(bn.num_batches_tracked) == 1


# ================================================================ one local step: paper vs reference
def _client(n: int, seed: int, cid: str):
    rng = np.random.default_rng(seed)
    imgs = rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8)  # small_cnn's last BN at 2x2: a batch of 1 trains
    labels = np.arange(n) % 3
    mu, sigma = compute_statistics(imgs, IMAGENET_MEAN, IMAGENET_STD)
    return ClientData.from_numpy(cid, "d", imgs, labels, imgs[:0], labels[:0], "cpu", mu, sigma)


def local_step(hp: dict, n: int = 6, batch_size: int | None = None):
    """One client-round of FedCCRL with one local epoch (batch_size = n: one step) from a fixed init."""
    data = _client(n, 0, "c0")
    other = _client(8, 1, "c1")
    payload = {"mu": other.stats_mu, "sigma": other.stats_sigma}
    alg = FedCCRL(LocalConfig(rounds=1, local_epochs=1, batch_size=batch_size or n), hp)
    torch.manual_seed(0)
    model = build_model("small_cnn", 3)
    w0 = {k: v.clone() for k, v in model.state_dict().items()}
    steps = alg.local_train_steps(
        model, data, ClientState(), w0, payload, torch.Generator().manual_seed(1), np.random.default_rng(2)
    )
    count = 0
    while True:
        try:
            next(steps)
            count += 1
        except StopIteration as done:
            return done.value, count


def same_weights(a, b) -> bool:
    return all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)


def test_variant_is_exactly_its_switches():
    """variant: reference is the paper with every switch at its reference reading, and nothing else."""
    ref, _ = local_step({"variant": "reference"})
    assert same_weights(ref, local_step({"variant": "paper", **REFERENCE})[0])
    paper, _ = local_step({})
    assert same_weights(paper, local_step({"variant": "reference", **PAPER})[0])
    assert not same_weights(paper, ref)


@pytest.mark.parametrize("switch", ["l_cls", "supcon", "forward", "augmix", "mixstyle_var", "pool_draw"])
def test_one_switch_changes_the_step_only_where_it_says(switch):
    paper, _ = local_step({})
    flipped, _ = local_step({switch: REFERENCE[switch]})
    assert not same_weights(paper, flipped)
    p, f = paper.metrics, flipped.metrics
    if switch == "l_cls":  # the same views and representations: L_CLS tripled, L_RA and L_JS untouched
        assert f["l_cls"] == pytest.approx(3 * p["l_cls"], rel=1e-6)
        assert (f["l_ra"], f["l_js"]) == (p["l_ra"], p["l_js"])
    elif switch == "supcon":  # only L_RA changes
        assert (f["l_cls"], f["l_js"]) == (p["l_cls"], p["l_js"]) and f["l_ra"] != p["l_ra"]
    else:  # the views or their BN statistics change: every term moves
        assert all(f[k] != p[k] for k in ("l_cls", "l_ra", "l_js"))


def test_last_batch_of_one_kept_only_by_the_reference():
    for hp, steps in (({}, 2), ({"last_batch": "keep"}, 3), ({"variant": "reference"}, 3)):
        assert local_step(hp, n=9, batch_size=4)[1] == steps, hp  # 4 + 4 + 1
    assert local_step({}, n=10, batch_size=4)[1] == 3  # a last batch of 2 is trained by both


# ================================================================ end to end: in-process engine, Flower, the train stage
def test_reference_variant_through_flower_equals_inprocess(data, monkeypatch, tmp_path):
    """2 rounds of variant reference on the embedded default (K = 1, three source clients): the loopback
    Grid (every message over Flower's wire objects) gives the in-process engine's numbers bit for bit."""
    monkeypatch.setitem(HPARAMS, "fedccrl", {"variant": "reference"})
    ref = run_inprocess(data, "fedccrl", 2)
    assert all(math.isfinite(r.to_dict()["loss"]) for r in ref.history)
    res = serve(loopback(data), make_spec(data, tmp_path / "w", "fedccrl"))
    assert_same_history(res.history, ref.history)
    for k, v in ref.final_weights.items():
        assert torch.equal(res.final_weights[k].cpu(), v.cpu()), k
    monkeypatch.setitem(HPARAMS, "fedccrl", {})
    assert run_inprocess(data, "fedccrl", 1).history[0].to_dict()["loss"] != ref.history[0].to_dict()["loss"]


@pytest.mark.full("the variant through dvc exp run")
@pytest.mark.timeout(900)
def test_reference_variant_through_dvc(params, tmp_path):
    """`train.fedccrl.variant: reference` in params.yaml, run by `dvc repro` (download -> partition with its pools ->
    train, one round, one held-out domain): the run trains the reference's readings and MLflow records them."""
    import shutil

    import mlflow
    from fixtures import REPO, dvc_env, dvc_run

    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    for code in ("fedccrl_core", "fedccrl_flower", "serving", "pipeline"):
        (tmp_path / code).symlink_to(REPO / code)
    params(
        {
            "train.rounds": 1,
            "train.local_epochs": 1,
            "train.held_out": [3],
            "train.algorithms": ["fedccrl"],
            "train.fedccrl.variant": "reference",
        }
    )
    dvc_run(["dvc", "init", "--no-scm", "-q"], tmp_path)
    dvc_run(["dvc", "repro", "train@fedccrl-0"], tmp_path)
    meta = json.loads((tmp_path / "models/fedccrl/s0/d3/history.json").read_text())["meta"]
    assert {k: meta["hparams"][k] for k in REFERENCE} == REFERENCE
    run = mlflow.MlflowClient(tracking_uri=dvc_env(tmp_path)["MLFLOW_TRACKING_URI"]).get_run(meta["mlflow_run_id"])
    assert {k: run.data.params[f"train.fedccrl.{k}"] for k in REFERENCE} == REFERENCE
    assert run.data.params["train.fedccrl.variant"] == "reference" and run.info.status == "FINISHED"
