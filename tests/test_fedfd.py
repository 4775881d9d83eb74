"""FedFD and FedFD-A (fedfd-a.txt sections 3.2-3.3): Eq. 2 mixing with a per-channel u, Eq. 3-5,
the instance adapter (Eq. 6-7; alpha = clamp(epsilon) at test time), the alternating updates, ONNX
parity on a shifted domain, model-file round trip and engine runs."""

from __future__ import annotations

import copy
import math

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from fixtures import held_out_run
from torch import nn

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import ALGORITHMS, build_algorithm, load_model
from fedccrl_core.algorithms.base import StepContext
from fedccrl_core.algorithms.fedfd import (
    FDBatchNorm2d,
    FedFD,
    bn_mode,
    cacl,
    cafl,
    fd_layers,
    set_global_statistics,
    total_loss,
)
from fedccrl_core.algorithms.fedfd_a import FedFDA, InstanceAdapter
from fedccrl_core.algorithms.local_bn import local_bn_keys
from fedccrl_core.federation.checkpoints import RoundCheckpoints
from fedccrl_core.federation.driver import train
from fedccrl_core.learning.model_file import ModelMeta, save_model
from fedccrl_pipeline import onnx_export, onnx_parity

SMALL = {"batch_size": 8}


def toy_run(toy_client, tmp_path, algorithm, hparams=None, rounds=2, ckpt_name="ck.pt"):
    """Four clients of two synthetic domains (different brightness and contrast), a shifted target."""
    torch.manual_seed(0)
    clients = [
        toy_client(f"d{i}_c{k}", f"d{i}", 32, 10 * i + k, 30 * i, 1.0 + 0.3 * i) for i in range(2) for k in range(2)
    ]
    tx = toy_client("t", "t", 40, 99, 60, 0.6)
    alg = build_algorithm(algorithm, LocalConfig(rounds=rounds, local_epochs=1, batch_size=8, lr=1e-2), hparams)
    model = alg.build_model("small_cnn", 3, "none", alg.hp)
    return held_out_run(
        alg,
        model,
        clients,
        (tx.train_x, tx.train_y),
        rounds,
        checkpoint_path=tmp_path / ckpt_name,
        run_info={"k": algorithm},
    )


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def bn_layer(c=4, adapter=None, inference="global", seed=0):
    torch.manual_seed(seed)
    bn = FDBatchNorm2d(c, adapter=adapter, inference=inference)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(c) + 0.5)
        bn.bias.copy_(torch.randn(c))
        bn.running_mean.copy_(torch.randn(c))
        bn.running_var.copy_(torch.rand(c) + 0.5)
    return bn


def by_hand(a, mu, sigma, bn):
    """gamma (a - mu) / sigma + beta written out, mu/sigma [B, C] or [C]."""
    mu = mu if mu.dim() == 2 else mu.expand(a.shape[0], -1)
    sigma = sigma if sigma.dim() == 2 else sigma.expand(a.shape[0], -1)
    return ((a - mu[:, :, None, None]) / sigma[:, :, None, None]) * bn.weight[None, :, None, None] + bn.bias[
        None, :, None, None
    ]


# ---- Eq. 2 --------------------------------------------------------------------------------------
def test_mixed_statistics_use_a_per_channel_u_drawn_every_forward():
    bn = bn_layer().train()
    g_mean, g_var = torch.randn(4), torch.rand(4) + 0.2
    bn.global_mean, bn.global_var = g_mean, g_var
    a = torch.randn(3, 4, 5, 5) * 2 + 1
    bn.mode, bn.generator = "mix", torch.Generator().manual_seed(7)
    out = bn(a)
    u = bn.last_u
    assert u.shape == (4,) and ((u >= 0) & (u <= 1)).all() and len(set(u.tolist())) == 4  # one per channel
    assert torch.equal(u, torch.rand(4, generator=torch.Generator().manual_seed(7)))  # from the generator
    mu_k = a.mean(dim=(2, 3))  # instance statistics
    sigma_k = (((a - mu_k[:, :, None, None]) ** 2).mean(dim=(2, 3)) + bn.eps).sqrt()
    sigma_g = (g_var + bn.eps).sqrt()
    mu_d, sigma_d = u * mu_k + (1 - u) * g_mean, u * sigma_k + (1 - u) * sigma_g  # Eq. 2
    assert torch.allclose(out, by_hand(a, mu_d, sigma_d, bn), atol=1e-5)
    running = bn.running_mean.clone()
    bn(a)
    assert not torch.equal(bn.last_u, u)  # a new u every forward
    assert torch.equal(bn.running_mean, running)  # the mixed pass leaves the local statistics alone


def test_every_layer_draws_its_own_u_and_table2_modes():
    torch.manual_seed(0)
    alg = FedFD(LocalConfig())
    model = FedFD.build_model("small_cnn", 3).train()
    g = {k: v.clone() for k, v in model.state_dict().items()}
    alg.before_local_train(model, g)
    with bn_mode(model, "mix", torch.Generator().manual_seed(3)) as layers:
        model.h(torch.randn(2, 3, 8, 8))
        us = [m.last_u for m in layers]
    assert [u.shape[0] for u in us] == [16, 32, 64, 64]  # u^l in R^{C_l}
    assert not torch.equal(us[2][:32], us[1])
    for stats, sampling, expected in (("global", "random", 0.0), ("instance", "random", 1.0), ("mixed", "fixed", 0.5)):
        a = FedFD(LocalConfig(), {"statistics": stats, "u_sampling": sampling})
        a.before_local_train(model, g)
        with bn_mode(model, "mix", torch.Generator().manual_seed(3)) as layers:
            model.h(torch.randn(2, 3, 8, 8))
            assert all(torch.equal(m.last_u, torch.full_like(m.last_u, expected)) for m in layers)
    bn = bn_layer().train()
    bn.u_low = bn.u_high = 1.0  # instance only: instance normalization
    bn.mode = "mix"
    a = torch.randn(2, 4, 6, 6)
    assert torch.allclose(bn(a), F.instance_norm(a, weight=bn.weight, bias=bn.bias, eps=bn.eps), atol=1e-5)
    bn.u_low = bn.u_high = 0.0  # global only, no global buffers set: the running statistics
    assert torch.allclose(
        bn(a),
        F.batch_norm(a, bn.running_mean, bn.running_var, bn.weight, bn.bias, training=False, eps=bn.eps),
        atol=1e-5,
    )


def test_global_statistics_come_from_the_received_global_model():
    torch.manual_seed(0)
    model = FedFD.build_model("small_cnn", 3)
    g = {k: v.clone() for k, v in model.state_dict().items()}
    g["h.features.1.running_mean"] = torch.arange(16.0)
    set_global_statistics(model, g)
    bn = model.h.features[1]
    assert torch.equal(bn.global_mean, torch.arange(16.0)) and not torch.equal(bn.running_mean, bn.global_mean)
    bn.train()
    assert torch.equal(bn.global_statistics()[0], torch.arange(16.0))  # training: theta_G's statistics
    bn.eval()
    assert torch.equal(bn.global_statistics()[0], bn.running_mean)  # the global model itself: running
    assert "global_mean" not in model.state_dict() and not any("global_" in k for k in model.state_dict())


# ---- Eq. 3-5 ------------------------------------------------------------------------------------
def test_cafl_cacl_total_by_hand():
    f_k = torch.tensor([[1.0, 2.0, 0.0], [0.0, -1.0, 3.0]])
    f_d = torch.tensor([[0.0, 2.0, 1.0], [2.0, 1.0, 3.0]])
    assert cafl(f_k, f_d, "sum").item() == pytest.approx(((1 + 0 + 1) + (4 + 4 + 0)) / 2)  # Eq. 3 as printed
    assert cafl(f_k, f_d, "mean").item() == pytest.approx(((1 + 0 + 1) + (4 + 4 + 0)) / 2 / 3)  # / V (default)
    logits, y = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 1.0]]), torch.tensor([0, 2])
    ce = [-(2.0 - math.log(math.exp(2) + 1 + math.exp(-1))), -(1.0 - math.log(2 * math.exp(0.5) + math.e))]
    assert cacl(logits, y).item() == pytest.approx(sum(ce) / 2, rel=1e-6)  # Eq. 4
    assert total_loss(torch.tensor(2.0), torch.tensor(3.0), torch.tensor(0.5), 0.1, 4.0).item() == pytest.approx(
        0.9 * 2 + 0.1 * 3 + 4.0 * 0.5
    )  # Eq. 5


def test_fedfd_step_is_eq5_of_the_two_forwards():
    torch.manual_seed(0)
    alg = FedFD(LocalConfig())
    model = FedFD.build_model("small_cnn", 3).train()
    g = {k: v.clone() for k, v in model.state_dict().items()}
    g["h.features.5.running_mean"] += 0.3
    alg.before_local_train(model, g)
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 0])
    loss, terms, logits = alg.train_step(model, x, y, StepContext(None, [], torch.Generator().manual_seed(5)))
    f_k = model.h(x)
    with bn_mode(model, "mix", torch.Generator().manual_seed(5)):
        f_d = model.h(x)
    assert torch.allclose(logits, model.g(f_k), atol=1e-6)
    assert terms["l_ce"].item() == pytest.approx(F.cross_entropy(model.g(f_k), y).item(), rel=1e-5)
    assert terms["l_cafl"].item() == pytest.approx(((f_k - f_d) ** 2).sum(1).mean().item() / 64, rel=1e-5)
    assert terms["l_cacl"].item() == pytest.approx(F.cross_entropy(model.g(f_d), y).item(), rel=1e-5)
    assert loss.item() == pytest.approx(
        0.9 * terms["l_ce"].item() + 0.1 * terms["l_cacl"].item() + 4.0 * terms["l_cafl"].item(), rel=1e-5
    )
    assert all(m.mode == "batch" for m in fd_layers(model))


# ---- Eq. 6-7 and the adapter ---------------------------------------------------------------------
def test_adapter_alpha_is_clamped_epsilon_at_test_time_and_sampled_in_training():
    torch.manual_seed(0)
    ad = InstanceAdapter(4, 3)
    with torch.no_grad():
        ad.fc2.weight.mul_(20)  # spread epsilon over and beyond [0, 1]
    d_mu, d_sigma = torch.randn(64, 4), torch.randn(64, 4)
    delta, eps = ad.delta_epsilon(d_mu, d_sigma)
    assert (eps < 0).any() and (eps > 1).any() and ((eps > 0) & (eps < 1)).any()
    alpha = ad(d_mu, d_sigma)
    assert alpha.shape == (64, 1) and torch.equal(alpha, eps.clamp(0, 1))  # test: T(epsilon)
    z = torch.randn(64, 1, generator=torch.Generator().manual_seed(2))
    assert torch.equal(ad(d_mu, d_sigma, torch.Generator().manual_seed(2)), (z * delta + eps).clamp(0, 1))  # Eq. 7
    # the layer in eval mode: Eq. 6 with alpha = T(epsilon), deterministic
    bn = bn_layer(adapter=ad, inference="adapter").eval()
    a = torch.randn(5, 4, 6, 6) * 3 + 2
    mu_i = a.mean(dim=(2, 3))
    sigma_i = (a.var(dim=(2, 3), unbiased=False) + bn.eps).sqrt()
    mu_g, sigma_g = bn.running_mean, (bn.running_var + bn.eps).sqrt()
    alpha = ad.delta_epsilon(mu_i - mu_g, sigma_i - sigma_g)[1].clamp(0, 1)
    expected = by_hand(a, alpha * mu_i + (1 - alpha) * mu_g, alpha * sigma_i + (1 - alpha) * sigma_g, bn)
    assert torch.allclose(bn(a), expected, atol=1e-5) and torch.equal(bn(a), bn(a))
    assert ad.fc2.out_features == 2 and isinstance(ad.fc1, nn.Linear)  # two FC layers, output size 2
    tbn = bn_layer(inference="instance").eval()  # Table 3 (c1): instance statistics at test time (alpha = 1)
    assert torch.allclose(tbn(a), F.instance_norm(a, weight=tbn.weight, bias=tbn.bias, eps=tbn.eps), atol=1e-5)


def test_fedfd_a_model_and_deterministic_eval():
    torch.manual_seed(0)
    model = FedFDA.build_model("small_cnn", 3).eval()
    layers = fd_layers(model)
    assert len(layers) == 4 and all(isinstance(m.adapter, InstanceAdapter) for m in layers)
    assert [m.adapter.fc1.out_features for m in layers] == [4, 4, 4, 4]  # max(4, C // 16)
    x = torch.randn(3, 3, 8, 8)
    assert torch.equal(model(x), model(x))
    fedfd = FedFDA.build_model("small_cnn", 3, "none", {"adapter": False, "inference": "global"})
    assert not any("adapter" in k for k in fedfd.state_dict())
    r18 = FedFDA.build_model("resnet18", 7)
    n_adapter = sum(p.numel() for n, p in r18.named_parameters() if ".adapter." in n)
    assert len(fd_layers(r18)) == 20 and n_adapter == 218540  # Table 4: 11.31M -> 11.53M


def test_fedfd_a_alternating_updates_keep_the_objectives_apart():
    torch.manual_seed(0)
    alg = FedFDA(LocalConfig())
    model = FedFDA.build_model("small_cnn", 3).train()
    g = {k: v.clone() for k, v in model.state_dict().items()}
    alg.before_local_train(model, g)
    x, y = torch.randn(6, 3, 8, 8), torch.tensor([0, 1, 2, 0, 1, 2])
    snapshot = copy.deepcopy(model.state_dict())
    loss, terms, _ = alg.train_step(model, x, y, StepContext(None, [], torch.Generator().manual_seed(4)))
    loss.backward()
    adapter = {n for n, _ in model.named_parameters() if ".adapter." in n}
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert adapter <= set(got) and all(p.requires_grad for p in model.parameters())
    assert any(model.h.features[1].last_alpha.flatten() != model.h.features[1].last_alpha.flatten()[0])
    model.zero_grad()
    model.load_state_dict(snapshot)
    main_loss, _, _ = FedFD.train_step(alg, model, x, y, StepContext(None, [], torch.Generator().manual_seed(4)))
    main_loss.backward()  # Eq. 5 alone: exactly the main network's gradients
    for n, p in model.named_parameters():
        if n in adapter:
            assert p.grad is None, n  # the adapter takes no part in Eq. 5
        else:
            assert torch.allclose(got[n], p.grad, atol=1e-6), n
    assert loss.item() == pytest.approx(main_loss.item() + terms["l_adapter"].item(), rel=1e-5)


def test_bad_params_name_the_key():
    for key, value in (("lambda1", 1.5), ("statistics", "batch"), ("u_sampling", "normal"), ("diversification", "yes")):
        with pytest.raises(ValueError, match=f"train.fedfd.{key}"):
            FedFD(LocalConfig(), {key: value})
    with pytest.raises(ValueError, match=r"train\.fedfd\.u_high': got 1\.0 \(the default\); must be >= u_low \(2\)"):
        FedFD(LocalConfig(), {"u_low": 2.0})
    for key, value in (("adapter_reduction", 0), ("inference", "tbn"), ("adapter_init_alpha", 2)):
        with pytest.raises(ValueError, match=f"train.fedfd_a.{key}"):
            FedFDA(LocalConfig(), {key: value})
    with pytest.raises(ValueError, match="train.fedfd_a.inference"):
        FedFDA(LocalConfig(), {"adapter": False})
    with pytest.raises(ValueError, match="unknown key"):
        FedFD(LocalConfig(), {"adapter": True})
    with pytest.raises(ValueError, match="train.fedfd.cafl_reduction"):
        FedFD(LocalConfig(), {"cafl_reduction": "max"})


# ---- model file, ONNX ---------------------------------------------------------------------------
def _trained_looking(model):
    """Perturb a fresh model so the global statistics and the adapter matter."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for m in fd_layers(model):
            m.running_mean.normal_(0, 0.3, generator=g)
            m.running_var.uniform_(0.5, 2.0, generator=g)
            if m.adapter is not None:
                m.adapter.fc1.weight.normal_(0, 1.0, generator=g)
                m.adapter.fc2.weight.normal_(0, 0.5, generator=g)
    return model.eval()


def test_model_file_round_trip(tmp_path):
    for name in ("fedfd", "fedfd_a"):
        cls = ALGORITHMS[name]
        torch.manual_seed(1)
        model = _trained_looking(cls.build_model("small_cnn", 3, "none", None))
        meta = {
            "backbone": "small_cnn",
            "num_classes": 3,
            "classes": ["a", "b", "c"],
            "image_size": 8,
            "mean": [0.5] * 3,
            "std": [0.25] * 3,
            "algorithm": name,
            "hparams": cls(LocalConfig()).hp.model_dump(),
        }
        save_model(tmp_path / f"{name}.pt", model, ModelMeta(**meta))
        loaded, _ = load_model(tmp_path / f"{name}.pt")  # rebuilt through build_model with meta["hparams"]
        assert [type(m.adapter) for m in fd_layers(loaded)] == [type(m.adapter) for m in fd_layers(model)]
        x = torch.randn(2, 3, 8, 8)
        assert torch.equal(model(x), loaded(x))


def test_fedfd_a_onnx_parity_on_a_shifted_domain(tmp_path):
    torch.manual_seed(2)
    hp = FedFDA(LocalConfig()).hp
    model = _trained_looking(FedFDA.build_model("small_cnn", 3, "none", hp))
    meta = {
        "backbone": "small_cnn",
        "num_classes": 3,
        "classes": ["a", "b", "c"],
        "image_size": 16,
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
        "resize": "resize SxS bilinear",
        "algorithm": "fedfd_a",
        "hparams": hp.model_dump(),
        "held_out_domain": "shifted",
    }
    save_model(tmp_path / "m.pt", model, ModelMeta(**meta))
    loaded, meta = load_model(tmp_path / "m.pt")
    path = onnx_export.export_onnx(loaded, meta, tmp_path / "m.onnx")
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert "BatchNormalization" not in ops  # every BN layer computes instance statistics + Eq. 6 in the graph
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (24, 16, 16, 3)).astype(np.float64)
    shifted = np.clip(0.35 * base + 140, 0, 255).astype(np.uint8)  # another domain: brighter, low contrast
    session = onnx_parity.cpu_session(path)
    res = onnx_parity.parity(session, loaded, shifted, meta.mean, meta.std, batch_size=7)  # odd batches
    assert res.max_abs_logit_diff <= 1e-4 and res.top1_agreement == 1.0
    from fedccrl_core.learning.statistics import normalize_u8

    x = normalize_u8(torch.from_numpy(shifted), meta.mean, meta.std)
    plain = FedFDA.build_model("small_cnn", 3, "none", hp.model_copy(update={"inference": "global"}))
    plain.load_state_dict(loaded.state_dict())
    with torch.no_grad():
        onnx_logits = torch.from_numpy(session.run(["logits"], {"images": x.numpy()})[0])
        assert (onnx_logits - plain.eval()(x)).abs().max() > 1e-3  # the adapter changes the prediction


# ---- engine ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["fedfd", "fedfd_a"])
def test_engine_round(toy_client, tmp_path, algorithm):
    run = toy_run(toy_client, tmp_path, algorithm, SMALL, rounds=1)
    res = train(run, log=lambda m: None)
    rec = res.history[0]
    terms = ("l_ce", "l_cacl", "l_cafl") + (("l_adapter",) if algorithm == "fedfd_a" else ())
    assert all(math.isfinite(rec.to_dict()[k]) for k in (*terms, "loss", "val_acc", "target_acc")), rec
    states = RoundCheckpoints(tmp_path / "ck.pt", "cpu").client_states()
    keys = set(local_bn_keys(run.model, "silobn"))
    assert all(set(s["extra"]["local_bn"]) == keys for s in states.values())  # SiloBN framework
    assert res.final_weights.keys() == run.model.state_dict().keys()
    if algorithm == "fedfd_a":
        assert any(".adapter." in k for k in res.final_weights)  # the adapter is aggregated (Table 15)


def test_fedfd_a_resume_is_exact(toy_client, tmp_path):
    class Killed(Exception):
        pass

    full = train(toy_run(toy_client, tmp_path, "fedfd_a", SMALL, ckpt_name="full.pt"), log=lambda m: None)

    def die(rec):
        if rec.to_dict()["round"] == 2:
            raise Killed

    with pytest.raises(Killed):
        train(toy_run(toy_client, tmp_path, "fedfd_a", SMALL, ckpt_name="r.pt"), on_round=die, log=lambda m: None)
    resumed = train(toy_run(toy_client, tmp_path, "fedfd_a", SMALL, ckpt_name="r.pt"), log=lambda m: None)
    strip = lambda h: [{k: v for k, v in r.to_dict().items() if k != "seconds"} for r in h]  # noqa: E731
    assert resumed.resumed_from == 1 and strip(resumed.history) == strip(full.history)
    assert all(torch.equal(full.final_weights[k], resumed.final_weights[k]) for k in full.final_weights)


def test_export_stage_writes_fedfd_a_onnx_with_parity(tiny, tmp_path):
    """`fedccrl export` on a FedFD-A model file: load_model rebuilds it from meta["hparams"], the stage
    exports it and checks parity on the held-out domain like any other model."""
    import json

    from fixtures import write_run_history

    from fedccrl_core.data.images import RESIZE_POLICY
    from fedccrl_core.learning.model_file import load_meta
    from fedccrl_pipeline.export_run import export

    shards = tiny / "data" / "shards"  # the session's tiny dataset (conftest.py), read-only
    manifest = json.loads((shards / "manifest.json").read_text())
    hp = FedFDA(LocalConfig()).hp
    torch.manual_seed(3)
    model = _trained_looking(FedFDA.build_model("small_cnn", manifest["num_classes"], "none", hp))
    held_out = manifest["domains"][-1]
    save_model(
        tmp_path / "model.pt",
        model,
        ModelMeta(
            backbone="small_cnn",
            num_classes=manifest["num_classes"],
            classes=manifest["classes"],
            image_size=32,
            mean=[0.485, 0.456, 0.406],
            std=[0.229, 0.224, 0.225],
            resize=RESIZE_POLICY,
            dataset="synthetic",
            domains=manifest["domains"],
            held_out_domain=held_out,
            algorithm="fedfd_a",
            seed=0,
            hparams=hp.model_dump(),
        ),
    )
    write_run_history(tmp_path, load_meta(tmp_path / "model.pt"))
    res = export(tmp_path / "model.pt", shards, tmp_path / "out", 0.999, 64, None, None, False)
    assert res.top1_agreement == 1.0 and res.max_abs_logit_diff <= 1e-4
    assert (tmp_path / "out" / "model.onnx").is_file() and (tmp_path / "out" / "parity.json").is_file()
