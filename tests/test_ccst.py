"""CCST (ccst.txt): AdaIN (Eq. 2, 5), single/overall styles (Eq. 6-8), the style bank as statistics
only, Alg. 1's augmentation level K, AdaIN weight loading, and CCST through the in-process engine.
The AdaIN networks use seeded random weights (`adain_weights: random`): no download here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from fixtures import held_out_run
from torch import nn

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.algorithms import build_algorithm
from fedccrl_core.algorithms.ccst import Style, TransferPlan, payload_to_bank, single_bank_size, transfer_plan
from fedccrl_core.augment import adain as adain_mod
from fedccrl_core.augment.adain import (
    AdaINNetworks,
    AdaINWeightsError,
    RandomAdaINWeightsWarning,
    adain,
    feature_stats,
    load_adain_networks,
    overall_style,
    random_adain_networks,
    save_adain_weights,
    single_image_styles,
    stylize,
    to_u8,
)
from fedccrl_core.federation.driver import train
from fedccrl_core.federation.loop import nbytes
from fedccrl_core.federation.sampling import sample_clients
from fedccrl_core.learning.models import build_model

pytestmark = pytest.mark.filterwarnings("ignore::fedccrl_core.augment.adain.RandomAdaINWeightsWarning")

S, N_TRAIN, N_VAL = 16, 8, 4  # 16 x 16 images (relu4_1 is 2 x 2), 8 training images per client
STYLE_BYTES = 2 * 512 * 4  # one style: a float32 mu and sigma of 512 channels


def _clients(toy_client):
    """Four S x S clients of two domains (tests/conftest.py toy_client)."""
    return [
        toy_client(f"d{i}_c{k}", f"d{i}", N_TRAIN + N_VAL, 10 * i + k, 40 * i, size=S, n_val=N_VAL)
        for i in range(2)
        for k in range(2)
    ]


def _ccst(**hp):
    return build_algorithm(
        "ccst", LocalConfig(rounds=2, local_epochs=1, batch_size=8, lr=1e-2), {"adain_weights": "random", "K": 2, **hp}
    )


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: on 2 shared cores, torch's thread pool spinning against other jobs made
    this module 4-5x slower. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def nets():
    return random_adain_networks()


# ---- Eq. 2 ----------------------------------------------------------------------------------
def test_adain_eq2_gives_the_style_statistics_and_keeps_the_content():
    g = torch.Generator().manual_seed(0)
    f_c = torch.randn(2, 4, 5, 5, generator=g) * 3 + 1
    mu_s = torch.tensor([[0.5, -1.0, 2.0, 0.0], [1.0, 3.0, -2.0, 0.25]])
    sigma_s = torch.tensor([[0.1, 2.0, 1.0, 3.0], [0.5, 0.2, 4.0, 1.5]])
    out = adain(f_c, mu_s, sigma_s)
    assert torch.allclose(out.mean(dim=(2, 3)), mu_s, atol=1e-5)
    assert torch.allclose(out.std(dim=(2, 3), unbiased=False), sigma_s, rtol=1e-4)
    # one element by hand: sigma_s (x - mu(x)) / sqrt(var(x) + eps) + mu_s
    ch = f_c[1, 2].flatten().tolist()
    m = sum(ch) / 25
    v = sum((c - m) ** 2 for c in ch) / 25
    assert out[1, 2, 3, 4].item() == pytest.approx(
        4.0 * (f_c[1, 2, 3, 4].item() - m) / math.sqrt(v + 1e-5) - 2.0, rel=1e-5
    )
    # the standardized content (spatial structure) is unchanged
    z = lambda t: (t - t.mean(dim=(2, 3), keepdim=True)) / t.std(dim=(2, 3), unbiased=False, keepdim=True)  # noqa: E731
    assert torch.allclose(z(out), z(f_c), atol=1e-4)


# ---- Eq. 6-8 ----------------------------------------------------------------------------------
def test_single_and_overall_styles_by_hand():
    """With Phi = identity the features are the pixels/255, so every statistic is checkable by hand."""
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 60, (5, 3, 4, 4), generator=g)
    x_u8 = (base + torch.tensor([0, 40, 80, 120, 160]).view(5, 1, 1, 1)).to(torch.uint8)  # different means
    ident = AdaINNetworks(nn.Sequential(nn.Identity()), nn.Sequential(nn.Identity()))
    f = x_u8.float() / 255
    mu, sigma = single_image_styles(ident, x_u8, batch_size=2)  # Eq. 6
    assert mu.shape == sigma.shape == (5, 3)
    assert torch.allclose(mu, f.mean(dim=(2, 3)), atol=1e-6)
    assert torch.allclose(sigma, (f.var(dim=(2, 3), unbiased=False) + 1e-5).sqrt(), atol=1e-6)

    mu_all, sigma_all = overall_style(ident, x_u8, batch_size=2)  # Eq. 8: statistics of the stack
    assert mu_all.shape == sigma_all.shape == (1, 3)
    stack = f.permute(1, 0, 2, 3).reshape(3, -1)
    assert torch.allclose(mu_all[0], stack.mean(1), atol=1e-6)
    assert torch.allclose(sigma_all[0], (stack.var(1, unbiased=False) + 1e-5).sqrt(), atol=1e-6)
    # mu_all = mean of the per-image means; sigma_all by the law of total variance, which is NOT
    # the mean of the per-image sigmas when the images' means differ
    assert torch.allclose(mu_all[0], mu.mean(0), atol=1e-6)
    var_i = sigma.square() - 1e-5
    assert torch.allclose(sigma_all[0], ((var_i + mu.square()).mean(0) - mu.mean(0).square() + 1e-5).sqrt(), atol=1e-5)
    assert (sigma_all[0] - sigma.mean(0)).abs().min() > 0.05
    assert torch.equal(overall_style(ident, x_u8, batch_size=5)[1], sigma_all)  # batching does not matter


def test_vgg_styles_are_512_vectors(toy_client, nets):
    x = toy_client("a", "a", N_TRAIN + N_VAL, 0, 0, size=S, n_val=N_VAL).train_x
    f = nets.encoder(x.float() / 255)
    assert f.shape == (N_TRAIN, 512, S // 8, S // 8)  # relu4_1
    mu, sigma = single_image_styles(nets, x)
    assert mu.shape == sigma.shape == (N_TRAIN, 512)
    assert torch.allclose(torch.stack(feature_stats(f)), torch.stack((mu, sigma)), atol=1e-5)
    mu_all, sigma_all = overall_style(nets, x)
    assert mu_all.shape == sigma_all.shape == (1, 512) and bool((sigma_all > 0).all())


# ---- the style bank leaves the client as statistics only (Sec. 3.2.1, 4.4) -------------------------
@pytest.mark.parametrize("style_type,J,expected_J", [("overall", None, 1), ("single", None, 1), ("single", 3, 3)])
def test_upload_is_statistics_only_and_sent_once(toy_client, nets, style_type, J, expected_J):
    alg = _ccst(style_type=style_type, J=J)
    client = _clients(toy_client)[0]
    up = alg.client_upload(client, np.random.default_rng(0))
    if style_type == "single":
        assert single_bank_size(J, N_TRAIN) == expected_J  # J = ceil(8 / 32) = 1 unless given
    assert set(up) == {"mu", "sigma"}
    for v in up.values():
        assert isinstance(v, np.ndarray) and v.dtype == np.float32 and v.shape == (expected_J, 512)
        assert np.isfinite(v).all()
    assert (up["sigma"] > 0).all()
    assert nbytes(up) == expected_J * STYLE_BYTES  # nothing image-sized
    alg._nets = nets  # same seeded weights; the per-image styles it may have picked, by hand:
    if style_type == "single":
        mu_all, _ = single_image_styles(nets, client.train_x)
        d = np.abs(up["mu"][:, None, :] - mu_all.numpy()[None]).max(-1)
        assert (d.min(1) < 1e-5).all()  # each uploaded row is one of the client's own images' styles
    else:
        assert np.allclose(up["mu"], overall_style(nets, client.train_x)[0].numpy(), atol=1e-5)
    payload = alg.server_payloads({client.client_id: up})[client.client_id]  # B, broadcast: statistics only
    assert set(payload) == {f"{client.client_id}/mu", f"{client.client_id}/sigma"}
    assert all(v.dtype == np.float32 and v.shape == (expected_J, 512) for v in payload.values())
    assert nbytes(payload) == nbytes(up)
    assert all(np.array_equal(payload_to_bank(payload)[client.client_id][k], up[k]) for k in up)
    assert alg.upload_wanted("other") and not alg.upload_wanted(client.client_id)  # once: the server half decides
    fresh = _ccst(style_type=style_type, J=J)  # e.g. a restarted client process uploads again:
    again = fresh.client_upload(client, np.random.default_rng(5))
    alg.server_payloads({client.client_id: {k: v + 1 for k, v in again.items()}})
    assert np.array_equal(alg.style_bank[client.client_id]["mu"], up["mu"])  # the server keeps the first


# ---- Alg. 1: augmentation level K ------------------------------------------------------------------
def test_transfer_plan_draws_K_distinct_clients():
    sizes = {"a": 2, "b": 1, "c": 3, "d": 1}
    plan = transfer_plan(300, sizes, "b", 3, np.random.default_rng(0), "single")
    clients, styles = plan.clients, plan.styles
    assert plan.bank_ids == ["a", "b", "c", "d"] and clients.shape == styles.shape == (300, 3)
    assert all(len(set(row)) == 3 for row in clients.tolist())  # K distinct entries of B per image
    assert set(np.unique(clients)) == {0, 1, 2, 3}
    own = clients == 1
    assert 0.65 < own.any(1).mean() < 0.85  # an image keeps itself with probability K/N = 3/4
    assert (styles[own] == 0).all()
    cap = np.array([2, 1, 3, 1])[clients]
    assert ((styles >= 0) & (styles < cap)).all() and set(np.unique(styles[clients == 2])) == {0, 1, 2}
    again = transfer_plan(300, sizes, "b", 3, np.random.default_rng(0), "single")
    assert np.array_equal(again.clients, clients) and np.array_equal(again.styles, styles)
    assert not np.array_equal(transfer_plan(300, sizes, "b", 3, np.random.default_rng(1), "single").clients, clients)
    full = transfer_plan(10, sizes, "b", 4, np.random.default_rng(0)).clients  # K = N: the reference setting
    assert all(sorted(row) == [0, 1, 2, 3] for row in full.tolist())  # the image itself + N-1 transfers
    with pytest.raises(ValueError, match=r"train\.ccst\.K=5"):
        transfer_plan(10, sizes, "b", 5, np.random.default_rng(0))


def test_augmented_dataset_has_K_entries_per_image_styled_by_other_clients(toy_client, nets):
    clients = _clients(toy_client)
    alg = _ccst(K=3)
    alg._nets = nets
    bank = {c.client_id: Style(**alg.client_upload(c, np.random.default_rng(0))) for c in clients}
    me = clients[1]
    plan = transfer_plan(N_TRAIN, dict.fromkeys(bank, 1), me.client_id, 3, np.random.default_rng(7))
    assert isinstance(plan, TransferPlan)
    ids, cl = plan.bank_ids, plan.clients
    d_x, d_y = alg.augmented_dataset(me, bank, plan)
    K, own = 3, ids.index(me.client_id)
    assert d_x.shape == (N_TRAIN * K, 3, S, S) and d_x.dtype == torch.uint8
    assert torch.equal(d_y, me.train_y.repeat_interleave(K))
    entries, styles = [], []
    for i in range(N_TRAIN):
        for k in range(K):
            if cl[i, k] == own:  # Alg. 1 line 6: the image itself, never its own style transferred
                assert torch.equal(d_x[i * K + k], me.train_x[i])
            else:
                entries.append((i, k))
                styles.append(bank[ids[cl[i, k]]])  # another client's overall style
    n_transferred = len(entries)
    rows = [i for i, _ in entries]
    f_c = nets.encoder(me.train_x[rows].float() / 255)  # Eq. 5 by hand, entry by entry
    mu = torch.from_numpy(np.concatenate([st.mu for st in styles]))
    sigma = torch.from_numpy(np.concatenate([st.sigma for st in styles]))
    ref = to_u8(stylize(nets, f_c, mu, sigma, (S, S)))
    got = torch.stack([d_x[i * K + k] for i, k in entries])
    assert (got.int() - ref.int()).abs().max() <= 1
    assert all(not torch.equal(got[j], me.train_x[i]) for j, (i, _) in enumerate(entries))
    assert 0 < n_transferred < N_TRAIN * K
    again = _ccst(K=3)
    again._nets = nets
    assert torch.equal(again.augmented_dataset(me, bank, plan)[0], d_x)  # deterministic


# ---- AdaIN weights -----------------------------------------------------------------------------
def test_weights_random_warns_and_null_refuses():
    with pytest.warns(RandomAdaINWeightsWarning, match="random"):
        a = load_adain_networks("random", None)
    b = random_adain_networks()
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))  # seeded
    with pytest.raises(AdaINWeightsError, match=r"train\.ccst\.adain_weights is null"):
        load_adain_networks(None, None)


def test_weights_file_sha256_verified(toy_client, nets, tmp_path):
    path = tmp_path / "adain.pth"
    sha = save_adain_weights(nets, path)
    loaded = load_adain_networks(str(path), sha)
    for k, v in nets.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    with pytest.raises(AdaINWeightsError, match=r"train\.ccst\.adain_sha256: sha256 mismatch"):
        load_adain_networks(str(path), "0" * 64)
    with pytest.raises(AdaINWeightsError, match=r"train\.ccst\.adain_sha256 is required"):
        load_adain_networks(str(path), None)
    with pytest.raises(AdaINWeightsError, match=r"train\.ccst\.adain_weights='.*missing\.pth': no such file"):
        load_adain_networks(str(tmp_path / "missing.pth"), sha)
    alg = build_algorithm("ccst", LocalConfig(), {"adain_weights": str(path), "adain_sha256": "f" * 64})
    with pytest.raises(AdaINWeightsError, match=r"train\.ccst\.adain_sha256"):  # before any use
        alg.client_upload(_clients(toy_client)[0], np.random.default_rng(0))


def test_weights_two_release_files_and_url_cache(nets, tmp_path, monkeypatch):
    """{vgg, decoder} as the pytorch-AdaIN release ships them (its vgg_normalised goes on past relu4_1)."""
    vgg_state = {**nets.encoder.state_dict(), "32.weight": torch.zeros(1)}
    torch.save(vgg_state, tmp_path / "vgg_normalised.pth")
    torch.save(nets.decoder.state_dict(), tmp_path / "decoder.pth")
    weights = {"vgg": str(tmp_path / "vgg_normalised.pth"), "decoder": (tmp_path / "decoder.pth").as_uri()}
    shas = {
        k: adain_mod.sha256_file(tmp_path / f) for k, f in (("vgg", "vgg_normalised.pth"), ("decoder", "decoder.pth"))
    }
    monkeypatch.setenv("FEDCCRL_CACHE", str(tmp_path / "cache"))
    loaded = load_adain_networks(weights, shas)
    assert torch.equal(loaded.decoder.state_dict()["1.weight"], nets.decoder.state_dict()["1.weight"])
    assert torch.equal(loaded.encoder.state_dict()["29.weight"], nets.encoder.state_dict()["29.weight"])
    assert (tmp_path / "cache" / "adain" / f"{shas['decoder']}.pth").is_file()  # the URL was cached
    with pytest.raises(AdaINWeightsError, match=r"train\.ccst\.adain_sha256\.decoder: sha256 mismatch"):
        load_adain_networks(weights, {**shas, "decoder": "1" * 64})
    monkeypatch.setattr(adain_mod, "DOWNLOAD_RETRIES", 0)
    gone = {**weights, "decoder": (tmp_path / "gone.pth").as_uri()}
    with pytest.raises(AdaINWeightsError, match=r"train\.ccst\.adain_weights\.decoder=.*cannot download"):
        load_adain_networks(gone, {**shas, "decoder": "2" * 64})
    with pytest.raises(AdaINWeightsError, match=r"train\.ccst\.adain_sha256 must map"):
        load_adain_networks(weights, shas["vgg"])


def test_hparams_validated():
    with pytest.raises(ValueError, match=r"train\.ccst\.style_type"):
        build_algorithm("ccst", LocalConfig(), {"style_type": "mixed"})
    with pytest.raises(ValueError, match=r"train\.ccst\.K"):
        build_algorithm("ccst", LocalConfig(), {"K": 0})
    with pytest.raises(ValueError, match=r"train\.ccst\.k"):
        build_algorithm("ccst", LocalConfig(), {"k": 3})


# ---- through the in-process engine -----------------------------------------------------------
def _run(toy_client, tmp_path, nets, rounds=2, ckpt="ck.pt", fraction=1.0, **hp):
    """LocalConfig.rounds is 2 whatever the engine runs, so a 1-round run is the first half of a 2-round run."""
    torch.manual_seed(0)
    clients = _clients(toy_client)
    tx = toy_client("t", "t", 16, 99, 60, size=S, n_val=N_VAL)
    alg = _ccst(**hp)
    alg._nets = nets  # the same seeded random weights `adain_weights: random` builds, built once per module
    return held_out_run(
        alg,
        build_model("small_cnn", 3),
        clients,
        (tx.train_x, tx.train_y),
        rounds,
        client_fraction=fraction,
        checkpoint_path=tmp_path / ckpt,
        run_info={"k": "ccst"},
    )


def _check_bank_bytes_once(toy_client, run, res, per_client):
    """Round 1: every client uploads its style S^{C_n} and receives B; afterwards weights only."""
    h, w, n_clients = res.history, nbytes(res.final_weights), 4
    assert h[0].to_dict()["bytes_up"] == n_clients * w + n_clients * per_client
    assert h[0].to_dict()["bytes_down"] == n_clients * w + n_clients * (n_clients * per_client)
    assert all(r.metric("bytes_up") == r.metric("bytes_down") == n_clients * w for r in h[1:])
    for key in ("loss", "l_cls", "train_acc", "lr", "val_acc", "target_acc"):
        assert math.isfinite(h[-1].to_dict()[key]), key
    assert (
        sorted(run.algorithm.served) == sorted(run.algorithm.style_bank) == [c.client_id for c in _clients(toy_client)]
    )
    for d_x, d_y in run.algorithm._datasets.values():
        assert d_x.shape[0] == d_y.shape[0] == 2 * N_TRAIN  # |D| = K d
    assert all(not isinstance(m, AdaINNetworks) for m in run.model.modules())  # Phi, Psi stay outside f


def test_engine_single_style_sends_the_bank_once_per_client_under_sampling(toy_client, tmp_path, nets):
    """Half the clients per round: a client first sampled in round t > 1 gets B in round t, once."""
    run = _run(toy_client, tmp_path, nets, rounds=3, fraction=0.5, style_type="single", J=2)
    res = train(run, log=lambda m: None)
    style_bytes = 2 * STYLE_BYTES  # J = 2 single-image styles per client
    w, bank_bytes = nbytes(res.final_weights), 4 * style_bytes
    ids, served = sorted(c.client_id for c in _clients(toy_client)), set()
    for rnd, rec in enumerate(res.history, 1):
        sampled = sample_clients(ids, 0.5, 0, rnd)
        fresh = [c for c in sampled if c not in served]
        served.update(sampled)
        assert rec.metric("bytes_down") == len(sampled) * w + len(fresh) * bank_bytes, rnd
        assert rec.metric("bytes_up") == len(sampled) * w + (4 * style_bytes if rnd == 1 else 0), rnd  # all 4 upload
        assert math.isfinite(rec.metric("loss")) and math.isfinite(rec.metric("target_acc"))
    assert sorted(run.algorithm.served) == sorted(served)
    assert any(c not in sample_clients(ids, 0.5, 0, 1) for c in served)  # someone got B after round 1


def test_engine_overall_style_bytes_and_resume(toy_client, tmp_path, nets):
    full_run = _run(toy_client, tmp_path, nets, ckpt="full.pt")
    full = train(full_run, log=lambda m: None)
    assert [r.metric("round") for r in full.history] == [1, 2]
    _check_bank_bytes_once(toy_client, full_run, full, STYLE_BYTES)

    stopped = _run(toy_client, tmp_path, nets, rounds=1, ckpt="resume.pt")
    train(stopped, log=lambda m: None)  # stopped after round 1 (checkpointed)
    run = _run(toy_client, tmp_path, nets, ckpt="resume.pt")
    resumed = train(run, log=lambda m: None)
    assert resumed.resumed_from == 1
    strip = lambda hist: [{k: v for k, v in r.to_dict().items() if k != "seconds"} for r in hist]  # noqa: E731
    assert strip(resumed.history) == strip(full.history)  # incl. round 2's bytes: nothing re-sent
    for k in full.final_weights:
        assert torch.equal(full.final_weights[k], resumed.final_weights[k]), k
    for cid, (d_x, _) in full_run.algorithm._datasets.items():
        assert torch.equal(run.algorithm._datasets[cid][0], d_x), cid
