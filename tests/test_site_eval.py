"""Evaluation where the data is (fedccrl_flower/evalsets.py): the counts a site returns, their pooling into the
central evaluation's numbers, and a Flower deployment of imagefolder sites, each prepared from its own folder, in
which every SuperNode's folder holds only its own site's files, the held-out domain sits only with an
evaluation-only site and the SuperLink's folder holds no data file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flower_harness import (
    EVALUATORS,
    SOURCES,
    LoopbackGrid,
    assert_same_history,
    imagefolder_sites,
    make_spec,
    run_inprocess,
    serve,
)

from fedccrl_core.data import manifest as manifest_mod
from fedccrl_core.data import pools as pools_mod
from fedccrl_core.data import shards as shards_mod
from fedccrl_core.learning.accuracy import class_counts, pooled_accuracy


def site_folder(data: Path, cid: str, dest: Path) -> Path:
    """One site's folder as the central stages would write it for that site alone: shards/manifest.json listing
    only `cid` + shards/<cid>.npz, and pools/manifest.json listing only `cid` + pools/<cid>.npz."""
    for stage in ("shards", "pools"):
        src, out = data / stage, dest / stage
        out.mkdir(parents=True)
        manifest = json.loads((src / manifest_mod.MANIFEST).read_text())
        manifest["clients"] = [c for c in manifest["clients"] if c["id"] == cid]
        assert len(manifest["clients"]) == 1, (stage, cid)
        (out / manifest_mod.MANIFEST).write_text(json.dumps(manifest, indent=2))
        shutil.copy2(src / manifest["clients"][0]["file"], out / manifest["clients"][0]["file"])
    return dest


# ---------------------------------------------------------------- unit: the counts and their pooling
def test_pooled_accuracy_is_the_float32_mean_bit_for_bit():
    """Σ correct / Σ n as the central evaluation's float32 mean of 0/1 values, for every count up to 600 images
    and a few large ones: the federated and the central val accuracy are the same float."""
    for n in [*range(1, 601), 9973, 65536, 2**24 - 1]:
        cs = range(n + 1) if n <= 600 else [0, 1, n // 3, n // 2, n - 1, n]
        for c in cs:
            hits = torch.zeros(n, dtype=torch.bool)
            hits[:c] = True
            assert pooled_accuracy(c, n) == float(hits.float().mean()), (c, n)
    assert np.isnan(pooled_accuracy(0, 0))
    with pytest.raises(ValueError, match="3 correct of 2"):
        pooled_accuracy(3, 2)


def test_class_counts_add_up_to_the_accuracy():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 5))
    x = torch.randint(0, 256, (37, 3, 4, 4), dtype=torch.uint8)
    y = torch.randint(0, 5, (37,))
    right, predicted = class_counts(model, x, y, 5, batch_size=8)
    pred = _predict(model, x)
    assert right == [int(((pred == y) & (y == k)).sum()) for k in range(5)]
    assert predicted == [int((pred == k).sum()) for k in range(5)] and sum(predicted) == 37
    assert pooled_accuracy(sum(right), 37) == float((pred == y).float().mean())


def _predict(model, x):
    from fedccrl_core.learning.accuracy import predict

    return predict(model, x, 8)


def test_a_sites_share_of_the_held_out_domain_is_its_rows_of_load_domain_test(data, tmp_path):
    """load_client_domain (what an evaluation site reads) over the clients of the held-out domain concatenates to
    load_domain_test (what the central evaluation reads), and a site's restricted folder gives its own rows."""
    x, y = shards_mod.load_domain_test(data / "shards", "sketch")
    parts = [shards_mod.load_client_domain(data / "shards", cid, "sketch") for cid in EVALUATORS]
    assert np.array_equal(np.concatenate([p[0] for p in parts]), x)
    assert np.array_equal(np.concatenate([p[1] for p in parts]), y)
    site = site_folder(data, "sketch_c0", tmp_path / "sketch")
    sx, sy = shards_mod.load_client_domain(site / "shards", "sketch_c0", "sketch")
    assert np.array_equal(sx, x) and np.array_equal(sy, y)
    ax, _ = shards_mod.load_client_domain(site / "shards", "sketch_c0", "art")
    assert ax.shape[0] == 0
    with pytest.raises(shards_mod.DataError, match="no client 'art_c0'"):
        shards_mod.load_client(site / "shards", "art_c0")
    manifest = manifest_mod.load_manifest(data / "shards")
    assert manifest_mod.evaluation_sites(manifest, "sketch") == EVALUATORS
    assert sorted(manifest_mod.client_ids(manifest, "sketch")) == SOURCES
    assert pools_mod.load_pool(site_folder(data, "art_c0", tmp_path / "art") / "pools", "art_c0")[0].shape[0] == (
        shards_mod.load_client(data / "shards", "art_c0").n_train
    )


def test_under_privacy_a_held_out_domain_is_scored_on_rows_no_run_of_the_study_trains_on(data):
    """train.privacy: a held-out domain's test set (central, and each site's share) is its clients' val rows, and
    none of them is a training row of any client in the shards, whichever domain a run of the study holds out: exact
    counts over them release nothing about a training image. Without DP it is every row (the papers' protocol)."""
    manifest = manifest_mod.load_manifest(data / "shards")
    trained = {p for c in manifest.clients for p in shards_mod.load_client(data / "shards", c.id).train_paths}
    for domain in manifest.domains:
        holders = [c.id for c in manifest.clients if c.holds(domain)]
        shares = [shards_mod.load_client(data / "shards", cid) for cid in holders]
        x, y = shards_mod.load_domain_test(data / "shards", domain, private=True)
        assert np.array_equal(x, np.concatenate([s.val_x for s in shares]))
        assert np.array_equal(y, np.concatenate([s.val_y for s in shares]))
        assert not trained & {p for s in shares for p in s.val_paths}
        _, y_all = shards_mod.load_domain_test(data / "shards", domain)
        assert 0 < len(y) < len(y_all) == sum(s.n_train + len(s.val_y) for s in shares)
        sites = [shards_mod.load_client_domain(data / "shards", cid, domain, private=True) for cid in holders]
        assert np.array_equal(np.concatenate([p[1] for p in sites]), y)


def test_a_malformed_evaluation_reply_is_refused():
    from flwr.app import ConfigRecord, Message, RecordDict

    from fedccrl_flower import messages as M
    from fedccrl_flower.evalsets import SiteCounts, pool, read_eval_reply

    LoopbackGrid({})  # Flower's task identity, which a Message needs, as a Grid has it

    def reply(cid="art_c0", **over):
        rec = SiteCounts([2, 3], [1, 3], [3, 2], 4, 2).to_record()
        for k, v in over.items():
            rec[k] = v
        return Message(
            RecordDict({M.INFO: ConfigRecord({M.F_CLIENT_ID: cid}), M.EVAL: rec}),
            dst_node_id=1,
            message_type=M.EVALUATE,
        )

    good = read_eval_reply(reply(), "art_c0", 2)
    assert good == SiteCounts([2, 3], [1, 3], [3, 2], 4, 2)
    for over, match in [
        ({M.F_VAL_CORRECT: [3, 3]}, "do not add up"),
        ({M.F_VAL_PREDICTED: [3, 3]}, "do not add up"),
        ({M.F_TARGET_CORRECT: 5}, "do not add up"),
        ({M.F_VAL_LABELS: [2, 3, 0]}, "one per class"),
        ({M.F_VAL_LABELS: [2, -3]}, "other than counts"),
        ({M.F_TARGET_N: 1.5}, "other than counts"),
    ]:
        with pytest.raises(M.MalformedUpdate, match=match):
            read_eval_reply(reply(**over), "art_c0", 2)
    with pytest.raises(M.MalformedUpdate, match="answers as photo_c0"):
        read_eval_reply(reply("photo_c0"), "art_c0", 2)
    ev = pool({"a": good, "b": SiteCounts([0, 1], [0, 0], [1, 0], 0, 0)})
    assert (ev.val_n, ev.val_pred_classes, ev.val_labels) == (6, 2, 2)
    assert ev.val_acc == pooled_accuracy(4, 6) and ev.target_acc == pooled_accuracy(2, 4)
    assert ev.record == {"val_n": 6, "target_n": 4, "eval_sites": 2}


# ---------------------------------------------------------------- imagefolder sites: each knows only its own domain
@pytest.fixture(scope="module")
def consortium(data, tmp_path_factory):
    """({client id: site folder}, the federation file): four imagefolder sites (flower_harness.imagefolder_sites)."""
    return imagefolder_sites(data, tmp_path_factory.mktemp("imagefolder-sites"))


def _site_configs(sites: dict[str, Path]) -> dict[int, dict]:
    from fedccrl_flower import messages as M

    return {
        100 + i: {M.NODE_CLIENT_ID: cid, M.NODE_SHARDS: str(f / "shards"), M.NODE_POOLS: str(f / "pools")}
        for i, (cid, f) in enumerate(sites.items())
    }


def _federation_spec(data, work, federation, algorithm="fedccrl", rounds=2, **over):
    """make_spec with what `fedccrl federate` takes from the federation file: sources, evaluators, classes, image
    size and domains."""
    from fedccrl_flower.sites import read_federation

    fed = read_federation(federation)
    held_out = over.pop("held_out", "sketch")
    kw = dict(sources=fed.sources(held_out), evaluators=fed.evaluators(held_out), classes=fed.classes)
    kw.update(image_size=fed.image_size, domains=fed.domains)
    return make_spec(data, work, algorithm, rounds=rounds, **{**kw, **over}, held_out=held_out)


def test_imagefolder_sites_over_a_loopback_deployment_match_the_inprocess_engine(data, consortium, tmp_path):
    """Four imagefolder sites, each prepared from its own folder (its manifest names only its own domain), over the
    loopback Grid holding out sketch: the held-out domain and the domains come from the spec (the federation file),
    and every round's val and target accuracy, and the weights, are the in-process engine's on the same images."""
    sites, federation = consortium
    for cid, folder in sites.items():
        assert manifest_mod.load_manifest(folder / "shards").domains == [cid.rsplit("_c", 1)[0]]
    ref = run_inprocess(data, "fedavg", 2, sites=sites)  # FedCCRL's pools: the deployment test below
    res = serve(LoopbackGrid(_site_configs(sites)), _federation_spec(data, tmp_path, federation, "fedavg"))
    assert_same_history(res.history, ref.history)
    target_n = len(shards_mod.load_domain_test(sites["sketch_c0"] / "shards", "sketch")[1])
    for rec, r in zip(res.history, ref.history, strict=True):
        assert rec.val_acc == r.val_acc and rec.target_acc == r.target_acc  # exact
        assert rec.clients == 3 and rec.eval_sites == 4 and rec.refused == rec.dropped == 0
        assert rec.target_n == target_n > 0
    for k, v in ref.final_weights.items():
        assert torch.equal(res.final_weights[k].cpu(), v.cpu()), k


def test_an_imagefolder_site_checks_its_domain_against_the_federations(data, consortium, tmp_path):
    """A site whose domain is not among the spec's (the federation file's) domains is dropped, naming its manifest
    and the site command that fixes it; a site asked to train on the run's held-out domain refuses, naming it."""
    from flwr.app import Context, RecordDict

    from fedccrl_flower import messages as M
    from fedccrl_flower.site_data import check_site_data

    sites, federation = consortium
    spec = _federation_spec(data, tmp_path, federation, "fedavg", 1, domains=["cartoon", "painting", "photo", "sketch"])
    rec = serve(LoopbackGrid(_site_configs(sites)), spec).history[0]
    (refused,) = rec.refused_clients  # the site's own check: it refuses the run by its client id
    assert rec.clients == 2 and refused.client == "art_c0" and not rec.dropped_clients, rec
    where = f"{sites['art_c0'] / 'shards'}/manifest.json"
    assert f"{where}: client art_c0's domain 'art' is not one of the federation's domains" in refused.reason
    assert "(fedccrl site prepare --domain)" in refused.reason
    art = {M.NODE_CLIENT_ID: "art_c0", M.NODE_SHARDS: str(sites["art_c0"] / "shards")}
    held_art = _federation_spec(data, tmp_path, federation, "fedavg", 1, held_out="art").client_spec()
    ctx = Context(run_id=1, node_id=1, node_config=art, state=RecordDict(), run_config={})
    assert check_site_data(ctx, held_art, "art_c0") == "art"  # QUERY, EVALUATE: it evaluates the held-out domain
    with pytest.raises(ValueError, match=rf"{where}: client art_c0 holds domain 'art', the run's held-out domain"):
        check_site_data(ctx, held_art, "art_c0", train=True)
    empty = Context(
        run_id=1, node_id=1, node_config={**art, M.NODE_SHARDS: str(tmp_path)}, state=RecordDict(), run_config={}
    )
    with pytest.raises(ValueError, match=r"manifest not found .*; at a site, `fedccrl site prepare --out SITE` writes"):
        check_site_data(empty, held_art, "art_c0")


# ---------------------------------------------------------------- a deployment of site folders
@pytest.mark.full(
    "a Flower deployment of real processes: a SuperLink and 4 SuperNodes from the wheel, 2 rounds of FedCCRL, ~90 s"
)
@pytest.mark.timeout(1200)
def test_deployment_of_site_folders_matches_inprocess_and_serves(data, consortium, full_venv, tmp_path):
    """The four imagefolder sites of `consortium` (three sources and the held-out sketch's evaluation-only site, each
    prepared from its own folder, its manifest naming only its own domain), each SuperNode from the installed wheel
    (no checkout, no PYTHONPATH) in its own folder that holds only its site's files; the SuperLink and the ServerApp
    work in an operator folder that holds no data file, with the spec `fedccrl federate` makes of the federation
    file. 2 rounds of FedCCRL, whose statistics pools travel in the messages: every round's val and target
    accuracy, the val-selected round and the weights equal the in-process engine's on the sites' images, bit for bit
    (one torch thread on both sides); MLflow gets each round's record; `fedccrl-serve` serves the exported final
    model."""
    import math

    import mlflow
    from click.testing import CliRunner

    from fedccrl_core.learning.model_file import ModelMeta
    from fedccrl_core.learning.models import build_model
    from fedccrl_flower import messages as M
    from fedccrl_flower.federation import LocalFederation
    from fedccrl_flower.follow import wait_for_result
    from fedccrl_flower.sites import read_federation
    from fedccrl_pipeline.onnx_export import export_onnx
    from fedccrl_pipeline.tracking import ChildRun, parent_run_id
    from fedccrl_serving.cli import main as serve_main

    sites, federation = consortium
    fed_file = read_federation(federation)
    ref = run_inprocess(data, "fedccrl", 2, sites=sites)
    operator = tmp_path / "operator"
    run = ChildRun("flower-test", parent_run_id("flower-test", "k", {}), "deployment", {}, {})
    with LocalFederation(operator / "federation") as fed:
        for cid, folder in sites.items():
            cfg = {
                M.NODE_CLIENT_ID: cid,
                M.NODE_SHARDS: str(folder / "shards"),
                M.NODE_POOLS: str(folder / "pools"),
                M.NODE_STATE_DIR: str(folder.parent / "state"),
            }
            fed.add_supernode(cid, cfg, threads=1, wait=False, bin_dir=full_venv / "bin", cwd=folder.parent)
        fed.wait_supernodes()
        work = operator / "work"
        t0 = time.perf_counter()
        spec = _federation_spec(data, work, federation, num_clients=4, min_clients=3)
        res = wait_for_result(fed, fed.submit(spec), work, on_round=run.log_round, timeout=900)
        print(f"deployment of site folders, 2 rounds FedCCRL, 4 SuperNodes: {time.perf_counter() - t0:.1f}s")
        run.finish()
        logs = {cid: p.log_path.read_text() for cid, p in fed.supernodes.items()}
        assert not list(fed.workdir.glob("*.fab")) and not list(work.glob("*.fab"))  # the FAB is built in memory
    assert_same_history(res.history, ref.history)
    assert res.best_round == ref.best_round
    for k, v in ref.final_weights.items():
        assert torch.equal(res.final_weights[k].cpu(), v.cpu()), k
        assert torch.equal(res.best_weights[k].cpu(), ref.best_weights[k].cpu()), k
    n_i = {cid: shards_mod.load_client(sites[cid] / "shards", cid).n_train for cid in SOURCES}
    k_i = {cid: math.ceil(0.1 * n) for cid, n in n_i.items()}  # Eq. 8: ceil(r n_i) statistics of (mu, sigma)
    for rec, r in zip(res.history, ref.history):
        assert rec.val_acc == r.val_acc and rec.target_acc == r.target_acc  # exact
        assert rec.val_pred_classes == r.val_pred_classes
        assert rec.eval_sites == 4 and rec.clients == 3 and rec.refused == rec.dropped == 0
        assert rec.target_n == len(shards_mod.load_domain_test(sites["sketch_c0"] / "shards", "sketch")[1])
        for cid in SOURCES:  # 3 channels, float32
            assert rec.metric(f"upload_bytes/{cid}") == k_i[cid] * 3 * 2 * 4  # what the server received from cid
            others = sum(k for c, k in k_i.items() if c != cid)
            assert rec.metric(f"payload_bytes/{cid}") == others * 3 * 2 * 4  # F_pool minus F_i, sent to cid
        assert rec.bytes_up == r.bytes_up and rec.bytes_down == r.bytes_down  # the same count
        assert rec.wire_bytes_up > rec.bytes_up and rec.wire_bytes_down > rec.bytes_down
    hist = mlflow.MlflowClient().get_metric_history(run.run_id, "val_acc")
    assert [(m.step, m.value) for m in hist] == [
        (r.to_dict()["round"], pytest.approx(r.to_dict()["val_acc"])) for r in res.history
    ]
    assert all(logs[cid].count("Receiving: train message") >= 2 for cid in SOURCES)  # every source trained twice
    assert "Receiving: train message" not in logs["sketch_c0"] and logs["sketch_c0"].count("evaluate message") >= 2
    data_files = {p.name for f in sites.values() for p in f.rglob("*.npz")}
    assert not [p for p in operator.rglob("*") if p.name in data_files or p.name == manifest_mod.MANIFEST]

    # the operator exports the deployment's final model and serves it
    model = build_model("small_cnn", 6)
    model.load_state_dict({k: v.cpu() for k, v in res.final_weights.items()})
    onnx = operator / "model.onnx"
    export_onnx(
        model.eval(),
        ModelMeta(
            backbone="small_cnn",
            num_classes=6,
            classes=fed_file.classes,
            image_size=fed_file.image_size,
            mean=[0.485, 0.456, 0.406],
            std=[0.229, 0.224, 0.225],
            resize=fed_file.resize_policy,
            dataset=fed_file.dataset,
            domains=fed_file.domains,
            held_out_domain="sketch",
            held_out_index=fed_file.domains.index("sketch"),
            algorithm="fedccrl",
            seed=0,
            round=2,
            params_hash="0" * 8,
            git_commit="0" * 8,
        ),
        onnx,
    )
    from PIL import Image

    x, _ = shards_mod.load_domain_test(sites["sketch_c0"] / "shards", "sketch")
    paths = []
    for i in range(4):
        paths.append(tmp_path / f"img{i}.png")
        Image.fromarray(x[i]).save(paths[-1])
    out = CliRunner().invoke(serve_main, ["predict", str(onnx), *map(str, paths), "--quiet"])
    assert out.exit_code == 0, out.output
    got = [json.loads(line)["label"] for line in out.output.splitlines() if line.startswith("{")]
    want = _predict(model, torch.from_numpy(x[:4]).permute(0, 3, 1, 2).contiguous())
    assert got == [fed_file.classes[int(k)] for k in want]


# ---------------------------------------------------------------- the operator's federation file
def _federation(tmp_path: Path, **over) -> Path:
    doc = {
        "dataset": "embedded",
        "domains": ["art", "cartoon", "photo", "sketch"],
        "classes": list("abcdef"),
        "image_size": 32,
        "resize_policy": "resize SxS bilinear",
        "sites": [{"id": f"{d}_c0", "domain": d} for d in ("art", "cartoon", "photo", "sketch")],
        **over,
    }
    path = tmp_path / "federation.json"
    path.write_text(json.dumps(doc))
    return path


def test_the_federation_file_names_sources_and_evaluation_sites(data, tmp_path):
    from fedccrl_flower.sites import federation_of, federation_sites, read_federation

    fed = read_federation(_federation(tmp_path))
    assert fed.held_out("3") == fed.held_out("sketch") == "sketch"
    assert fed.sources("sketch") == SOURCES and fed.evaluators("sketch") == EVALUATORS
    central = federation_of(manifest_mod.load_manifest(data / "shards"))
    assert sorted(central.sources("sketch")) == sorted(federation_sites(data / "shards", "sketch")[0])
    assert central.evaluators("sketch") == federation_sites(data / "shards", "sketch")[1] == EVALUATORS


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"sites": [{"id": "a", "domain": "mars"}]}, "domain 'mars' is not one of"),
        ({"sites": [{"id": "a", "domain": "art"}, {"id": "a", "domain": "photo"}]}, "appears twice"),
        ({"image_size": "32"}, "image_size"),
        ({"sites": [{"id": "a"}]}, r"key 'sites\[0\]"),  # the site without its domain
    ],
)
def test_a_bad_federation_file_is_refused_naming_the_file_and_key(tmp_path, over, match):
    from fedccrl_flower.sites import read_federation

    path = _federation(tmp_path, **over)
    with pytest.raises(shards_mod.DataError, match=match) as e:
        read_federation(path)
    assert str(path) in str(e.value)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(shards_mod.DataError, match="broken.json: not JSON"):
        read_federation(tmp_path / "broken.json")
    with pytest.raises(shards_mod.DataError, match="absent.json: federation file not found"):
        read_federation(tmp_path / "absent.json")


def test_federate_refuses_bad_input_before_starting_anything(tmp_path):
    """`fedccrl federate` with an unknown held-out domain, or too few sources for train.flower.min_clients: one
    error line naming the file, exit code 2, and no run folder, work folder or Flower home left behind."""

    from fixtures import write_params

    write_params(tmp_path, {"train.flower.min_clients": 3})
    fed = _federation(tmp_path, sites=[{"id": "art_c0", "domain": "art"}, {"id": "sketch_c0", "domain": "sketch"}])
    out = tmp_path / "run"
    base = [str(Path(sys.executable).parent / "fedccrl"), "federate", "--federation", str(fed), "--params"]
    base += [str(tmp_path / "params.yaml"), "--algorithm", "fedavg", "--seed", "0", "--superlink", "127.0.0.1:1"]
    base += ["--out", str(out)]

    def federate(*args):
        return subprocess.run([*base, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path)

    r = federate("--held-out", "mars")
    assert r.returncode == 2 and f"error: {fed}: --held-out: held-out domain 'mars' is not one of" in r.stderr
    r = federate("--held-out", "sketch")
    assert r.returncode == 2 and "min_clients is 3 but held-out sketch leaves 1 source clients" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["federation.json", "params.yaml"]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda m: {**m, "classes": m["classes"][::-1]}, "are not the federation's"),
        (lambda m: {**m, "image_size": m["image_size"] * 2}, "image_size 64 is not the federation's 32"),
    ],
    ids=["class-order", "image-size"],
)
def test_a_site_whose_data_is_not_the_federations_is_refused_naming_its_manifest(data, tmp_path, change, match):
    """A site prepared with another class list (or order) or image size than the spec's (the federation's): its
    reply is an error naming its own manifest, before its images are used; the round goes on with the others."""
    from flower_harness import serve

    from fedccrl_flower import messages as M

    odd = site_folder(data, "photo_c0", tmp_path / "photo")
    manifest = json.loads((odd / "shards" / manifest_mod.MANIFEST).read_text())
    (odd / "shards" / manifest_mod.MANIFEST).write_text(json.dumps(change(manifest)))
    configs = {
        100 + i: {
            M.NODE_CLIENT_ID: cid,
            M.NODE_SHARDS: str((odd if cid == "photo_c0" else data) / "shards"),
            M.NODE_POOLS: str((odd if cid == "photo_c0" else data) / "pools"),
        }
        for i, cid in enumerate(SOURCES)
    }
    spec = make_spec(
        data,
        tmp_path / "work",
        "fedavg",
        rounds=1,
        min_clients=2,
        evaluators=[],
        classes=manifest["classes"],
        image_size=manifest["image_size"],
    )
    rec = serve(LoopbackGrid(configs), spec).history[0]
    (refused,) = rec.refused_clients  # the site refuses the run by its client id, with its check's reason
    assert rec.clients == 2 and refused.client == "photo_c0" and not rec.dropped_clients
    assert match in refused.reason, refused
    assert f"{odd / 'shards'}/manifest.json" in refused.reason
