"""A sweep's epsilon per image (fedccrl_core/privacy/sweep_epsilon.py, pipeline/fedccrl_pipeline/sweep_privacy.py):
the composition of every release of every run that trains on an image's domain, checked against an independent
composition; the sweep's budget refused before MLflow naming its key; the parent run's metrics from what the
children charged; a seeded run marked not private everywhere it reports; docs/privacy.md's table rerun."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shlex
from pathlib import Path

import dp_accounting
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as rdp
from fixtures import ONE_ROUND

from fedccrl_core.privacy.sweep_epsilon import (
    SweepRun,
    decode_releases,
    encode_releases,
    per_image_epsilon,
    planned_releases,
)

REPO = Path(__file__).resolve().parents[1]
DELTA = 1e-5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def independent(releases, delta=DELTA) -> float:
    """epsilon of `releases` composed event by event with dp_accounting's RDP accountant (no counting, no cache),
    the smaller of the sampled and the unsampled compositions (accountant.py epsilon_of's two bounds)."""

    def eps(unsampled: bool) -> float:
        acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
        for _, p, k, z in releases:
            g = dp_accounting.GaussianDpEvent(z)
            acc.compose(g if unsampled or k == p else dp_accounting.SampledWithoutReplacementDpEvent(p, k, g))
        return float(acc.get_epsilon(delta))

    return min(eps(False), eps(True))


def test_an_image_composes_every_run_that_trains_on_its_domain_and_no_other():
    stats, weights = ("statistics", 108, 11, 1.0), ("weights", 6, 6, 0.5)
    a = SweepRun("fedccrl held-out c", ("a", "b"), (stats, weights) * 3)
    b = SweepRun("fedavg held-out c", ("a", "b"), (weights,) * 3)
    c = SweepRun("fedavg held-out a", ("b", "c"), (("weights", 6, 3, 0.7),) * 2)
    eps = per_image_epsilon([a, b, c], DELTA)
    assert list(eps) == ["a", "b", "c"]
    assert eps["a"] == pytest.approx(independent(a.releases + b.releases), rel=1e-9)
    assert eps["b"] == pytest.approx(independent(a.releases + b.releases + c.releases), rel=1e-9)
    assert eps["c"] == pytest.approx(independent(c.releases), rel=1e-9)
    one_run = per_image_epsilon([a], DELTA)["a"]
    assert eps["c"] < one_run < eps["a"] < eps["b"]  # more runs on the same images: more epsilon


def test_planned_releases_are_a_runs_per_round_events():
    from fedccrl_core.privacy.settings import PrivacySettings

    s = PrivacySettings(enabled=True, stats_noise_multiplier=2.0, weights_noise_multiplier=3.0)
    sizes = {"x": (100, 10), "y": (50, 6)}  # y samples the larger share: the round's statistics event is y's
    assert planned_releases(s, True, sizes, 4, 2, 2) == [("statistics", 50, 6, 2.0), ("weights", 4, 2, 1.5)] * 2
    assert planned_releases(s, False, sizes, 4, 4, 1) == [("weights", 4, 4, 1.5)]


def test_releases_travel_as_compact_json_and_bad_text_names_where():
    rel = [("weights", 6, 6, 0.5)] * 10 + [("statistics", 108, 11, 1.0)] * 10
    text = encode_releases(rel)
    assert len(text) < 80 and sorted(decode_releases(text, "tag x")) == sorted(rel)
    for bad in ("{", '[["secret", 1, 1, 1.0, 1]]', '[["weights", 1, 1, 1.0]]', '[["weights", 6, 6, 0.5, 0]]'):
        with pytest.raises(ValueError, match="tag x: not a list of"):
            decode_releases(bad, "tag x")


def test_seeded_runs_report_no_epsilon_and_are_marked(not_private):
    """A seeded run's epsilon does not apply: its round records lose the epsilon keys (dp_seeded_noise stays), and
    its mark reaches the model meta and the ONNX metadata; a private run and a run without DP are unchanged."""
    from fedccrl_core.federation.round_record import RoundRecord
    from fedccrl_core.foundation import contract
    from fedccrl_core.learning.model_file import ModelMeta
    from fedccrl_core.privacy.settings import NOT_PRIVATE_MARK, PrivacySettings
    from fedccrl_pipeline.onnx_export import metadata_props
    from fedccrl_serving.metadata import parse_metadata

    base = {contract.ROUND: 1, "val_acc": 0.5, "target_acc": 0.5, "val_pred_classes": 2, "seconds": 1.0}
    base |= {"bytes_up": 1, "bytes_down": 1, contract.DP_EPSILON: 3.0, contract.DP_EPSILON_WEIGHTS: 2.0}
    rec = RoundRecord.model_validate({**base, contract.DP_SEEDED_NOISE: 1.0})
    kept = rec.without_epsilon().to_dict()
    assert kept == {k: v for k, v in rec.to_dict().items() if k not in contract.DP_EPSILON_KEYS}
    assert kept[contract.DP_SEEDED_NOISE] == 1.0 and contract.DP_EPSILON_WEIGHTS not in kept
    assert PrivacySettings(enabled=True, noise_seed=1).not_private_mark() == NOT_PRIVATE_MARK
    assert PrivacySettings(enabled=True).not_private_mark() is None
    assert PrivacySettings(noise_seed=1).not_private_mark() is None  # DP off: nothing to mark
    base = dict(backbone="small_cnn", num_classes=2, classes=["a", "b"], image_size=32, mean=[0.0] * 3)
    meta = ModelMeta(**base, std=[1.0] * 3, resize="stretch")
    assert "privacy" not in meta.to_dict() and "privacy" not in metadata_props(meta)
    marked = meta.model_copy(update={"privacy": NOT_PRIVATE_MARK})
    props = metadata_props(marked)
    assert props["privacy"] == NOT_PRIVATE_MARK
    assert parse_metadata(props, "model.onnx").as_dict()["privacy"] == NOT_PRIVATE_MARK


def test_the_sweep_budget_does_not_change_a_runs_key(params, tmp_path):
    """train.privacy.max_sweep_epsilon is checked before the sweep trains and changes nothing a run trains: a DP
    run keeps its key (and round checkpoint) whatever it is, while a per-run setting (max_epsilon) changes it."""
    from fixtures import bare_manifest

    from fedccrl_core.federation.plan import plan_runs
    from fedccrl_pipeline.params import load_config
    from fedccrl_pipeline.training import run_settings

    def key(new_keys=None, **over):
        cfg = load_config(params({"train.privacy.enabled": True, **over}, new_keys=new_keys))
        part = cfg.partition.model_dump(by_alias=True)
        args = (bare_manifest(), "fedavg", 0, [3], ["sketch"], tmp_path / "m", tmp_path / "ck", cfg.train.fedavg)
        (job,) = plan_runs(run_settings(cfg), part, *args)
        return job.run_key

    plain = key()
    assert key({"train.privacy.max_sweep_epsilon": 50.0}) == plain
    assert key(**{"train.privacy.max_epsilon": 50.0}) != plain


def _train_cli(tiny: Path, ws: Path, monkeypatch, algorithm: str, held_out: list[str], out: str = "models/m"):
    from click.testing import CliRunner

    from fedccrl_pipeline.train import command

    monkeypatch.chdir(ws)
    args = ["--shards", str(tiny / "data" / "shards"), "--pools", str(tiny / "data" / "pools")]
    args += ["--algorithm", algorithm, "--seed", "0", "--out", out, "--params", "params.yaml", "--checkpoints", "ck"]
    for h in held_out:
        args += ["--held-out", h]
    return CliRunner().invoke(command, [*args, "--workers", "1"])


def _runs(ws: Path):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{ws / 'mlflow.db'}")
    exps = [e.experiment_id for e in client.search_experiments()]
    return client, (client.search_runs(exps) if exps else [])


@pytest.mark.parametrize("algorithm", ["ccst", "ga"])  # an upload, an aggregation; every one: test_privacy.py
def test_algorithms_without_a_mechanism_are_refused_before_mlflow(algorithm, params, tmp_path, monkeypatch):
    """Under train.privacy, `fedccrl train` of an algorithm whose releases have no mechanism stops at validation,
    naming train.privacy.enabled (the key to change) and the algorithm, before any MLflow run exists."""
    params({**ONE_ROUND, "train.privacy.enabled": True, "train.algorithms": [algorithm]})
    res = _train_cli(tmp_path / "nowhere", tmp_path, monkeypatch, algorithm, ["0"])
    assert res.exit_code == 2, res.output[-2000:]
    lines = [line for line in res.stderr.splitlines() if "key 'train.privacy.enabled'" in line]
    assert lines and f"{algorithm} cannot train under train.privacy" in lines[0], res.stderr
    assert _runs(tmp_path)[1] == [] and not (tmp_path / "models").exists()


def test_the_sweep_budget_is_refused_before_mlflow_naming_its_key(tiny, params, tmp_path, monkeypatch):
    """train.privacy.max_sweep_epsilon below the sweep's planned epsilon per image (two held-out domains on the
    same clients: the two sources they share compose both runs) stops `fedccrl train` before any MLflow run,
    though each run alone stays below it; at the planned value itself it passes the check."""
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_pipeline.params import load_config
    from fedccrl_pipeline.sweep_privacy import check_sweep_budget, manifest_plan

    over = {**ONE_ROUND, "train.privacy.enabled": True, "train.algorithms": ["fedavg"], "train.held_out": [0, 1]}
    cfg = load_config(params(over))
    manifest = load_manifest(tiny / "data" / "shards")
    eps = check_sweep_budget(cfg, manifest_plan(cfg, manifest), "fedavg", 0, ["photo"])
    assert eps is not None and eps["photo"] < eps["cartoon"] == eps["sketch"]  # photo: trained in one of the two
    limit = (eps["photo"] + eps["cartoon"]) / 2
    params(over, new_keys={"train.privacy.max_sweep_epsilon": limit})
    res = _train_cli(tiny, tmp_path, monkeypatch, "fedavg", ["0"])
    assert res.exit_code == 2, res.output[-2000:]
    assert re.search(r"key 'train.privacy.max_sweep_epsilon': got .*domain (cartoon|sketch) would reach", res.stderr)
    assert _runs(tmp_path)[1] == [] and not (tmp_path / "models").exists()
    cfg = load_config(params(over, new_keys={"train.privacy.max_sweep_epsilon": eps["cartoon"]}))
    assert check_sweep_budget(cfg, manifest_plan(cfg, manifest), "fedavg", 0, ["photo"]) == eps


@pytest.mark.full("a DP FedAvg train stage on the tiny data, two held-out domains of one round: ~10 s on the CPU")
def test_the_parent_run_reports_the_sweeps_epsilon_per_image(tiny, params, tmp_path, monkeypatch):
    """Two held-out runs of one sweep on the same clients: the children carry what their ledgers charged, and the
    parent's dp_epsilon_sweep_per_image/<domain> composes the runs that trained on the domain (photo: one run,
    cartoon and sketch: both), equal to an independent composition of the charged releases, and to the plan."""
    from fedccrl_pipeline.sweep_privacy import DOMAINS_TAG, RELEASES_TAG, SWEEP_EPSILON, SWEEP_PLANNED, SWEEP_RUNS

    over = {**ONE_ROUND, "train.privacy.enabled": True, "train.algorithms": ["fedavg"], "train.held_out": [0, 1]}
    params({**over, "train.privacy.weights_noise_multiplier": 3.0})
    res = _train_cli(tiny, tmp_path, monkeypatch, "fedavg", ["0", "1"])
    assert res.exit_code == 0, res.output[-3000:]
    _, runs = _runs(tmp_path)
    parent = next(r for r in runs if r.data.tags.get("fedccrl.role") == "parent")
    children = [r for r in runs if r.data.tags.get("fedccrl.role") == "child"]
    assert len(children) == 2
    charged = {}
    for child in children:
        entry = {"photo": "d0", "art": "d1"}[child.data.tags["held_out"]]
        doc = json.loads((tmp_path / "models" / "m" / entry / "history.json").read_text())
        assert json.loads(child.data.tags[DOMAINS_TAG]) == doc["dp"]["trained_domains"]
        charged[child.data.tags["held_out"]] = decode_releases(child.data.tags[RELEASES_TAG], "tag")
        assert child.data.metrics["dp_epsilon"] == pytest.approx(independent(charged[child.data.tags["held_out"]]))
    m = parent.data.metrics
    assert m[SWEEP_RUNS] == 2
    # photo's images train only in the run that holds out art, art's only in the one that holds out photo
    assert m[f"{SWEEP_EPSILON}/photo"] == pytest.approx(independent(charged["art"]), rel=1e-9)
    assert m[f"{SWEEP_EPSILON}/art"] == pytest.approx(independent(charged["photo"]), rel=1e-9)
    both = independent(charged["photo"] + charged["art"])
    for d in ("cartoon", "sketch"):
        assert m[f"{SWEEP_EPSILON}/{d}"] == pytest.approx(both, rel=1e-9)
        assert m[f"{SWEEP_PLANNED}/{d}"] == pytest.approx(both, rel=1e-9)
    assert m[SWEEP_EPSILON] == pytest.approx(both, rel=1e-9) and both > max(
        c.data.metrics["dp_epsilon"] for c in children
    )
    # each held-out domain scored on its val rows only, in training and again by the evaluate stage (shards.py
    # held_out_parts: no run of the study trains on them; docs/privacy.md, "What a site returns for evaluation")
    from fedccrl_core.data.shards import load_domain_test
    from fedccrl_core.outcomes.runs import evaluate_run

    shards = tiny / "data" / "shards"
    for entry, domain in (("d0", "photo"), ("d1", "art")):
        run = tmp_path / "models" / "m" / entry
        n_val = len(load_domain_test(shards, domain, private=True)[1])
        assert 0 < n_val < len(load_domain_test(shards, domain)[1])
        evaluated = evaluate_run(shards, run, 64, "cpu")
        recorded = json.loads((run / "history.json").read_text())["rounds"][-1]["target_acc"]
        assert evaluated.n_test == n_val and evaluated.final_target_acc == pytest.approx(recorded, abs=1e-6)


@pytest.mark.full("a seeded DP FedCCRL train stage on the tiny data, one round of one held-out domain: ~20 s")
def test_a_seeded_run_is_marked_not_private_everywhere(tiny, params, tmp_path, monkeypatch, not_private):
    """noise_seed (with FEDCCRL_NOT_PRIVATE=1): no dp_epsilon in MLflow nor in history.json, the mark on the child
    and the parent run, in history.json and in both model files' meta. The releases its ledger charged (both
    channels) are the sweep plan's for the run (the clients' sizes from the manifest, Eq. 8's k_i)."""
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_core.learning.model_file import load_meta
    from fedccrl_core.privacy.settings import NOT_PRIVATE_MARK
    from fedccrl_pipeline.params import load_config
    from fedccrl_pipeline.sweep_privacy import PRIVACY_TAG, SWEEP_EPSILON, SWEEP_PLANNED, manifest_plan, planned_sweep

    over = {**ONE_ROUND, "train.privacy.enabled": True, "train.algorithms": ["fedccrl"], "train.held_out": [0]}
    path = params(over, new_keys={"train.privacy.noise_seed": 3})
    res = _train_cli(tiny, tmp_path, monkeypatch, "fedccrl", ["0"])
    assert res.exit_code == 0, res.output[-3000:]
    _, runs = _runs(tmp_path)
    assert {r.data.tags.get("fedccrl.role") for r in runs} == {"parent", "child"}
    for r in runs:
        assert r.data.tags[PRIVACY_TAG] == NOT_PRIVATE_MARK
        assert not any(k.startswith(("dp_epsilon", SWEEP_EPSILON, SWEEP_PLANNED)) for k in r.data.metrics), (
            r.data.metrics
        )
    child = next(r for r in runs if r.data.tags["fedccrl.role"] == "child")
    assert child.data.metrics["dp_seeded_noise"] == 1.0
    run = tmp_path / "models" / "m" / "d0"
    doc = json.loads((run / "history.json").read_text())
    assert doc["dp"]["mark"] == NOT_PRIVATE_MARK and doc["meta"]["privacy"] == NOT_PRIVATE_MARK
    assert all("dp_epsilon" not in rec and rec["dp_seeded_noise"] == 1 for rec in doc["rounds"])
    assert load_meta(run / "model.pt").privacy == NOT_PRIVATE_MARK == load_meta(run / "best.pt").privacy
    (plan,) = planned_sweep(
        load_config(path),
        manifest_plan(load_config(path), load_manifest(tiny / "data" / "shards")),
        "fedccrl",
        0,
        ["photo"],
    )
    charged = decode_releases(doc["dp"]["releases"], "history.json")
    assert {c for c, *_ in charged} == {"statistics", "weights"} and sorted(charged) == sorted(plan.releases)


@pytest.mark.full("builds the default synthetic data (960 images) and reruns the docs' three commands: ~20 s")
def test_docs_sweep_epsilon_tables_are_the_commands_output(tmp_path):
    """docs/privacy.md's sweep tables and worked example are scripts/sweep_epsilon.py's output on the default data,
    and its table of the held-out test sets scripts/held_out_rows.py's."""
    from fedccrl_core.data.partition import PartitionSettings, partition
    from fedccrl_core.data.registry import get_dataset
    from fedccrl_core.data.synthetic import generate
    from fedccrl_pipeline.params_yaml import read_yaml

    p = read_yaml(REPO / "params.yaml")
    generate(tmp_path / "raw", seed=p["dataset"]["seed"], progress=False, workers=1)
    pp = p["partition"]
    partition(
        tmp_path / "raw",
        tmp_path / "shards",
        get_dataset("synthetic"),
        PartitionSettings(
            32, clients_per_domain=pp["clients_per_domain"], val_fraction=pp["val_fraction"], seed=pp["seed"]
        ),
        progress=False,
        workers=1,
    )
    doc = (REPO / "docs" / "privacy.md").read_text()
    blocks = re.findall(r"```bash\n(python scripts/sweep_epsilon\.py [^\n]*)\n```\n\n```text\n(.*?)\n```", doc, re.S)
    assert len(blocks) == 3, blocks
    spec = importlib.util.spec_from_file_location("sweep_epsilon_script", REPO / "scripts" / "sweep_epsilon.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # in this process: the three commands share their imports and compositions
    for cmd, expected in blocks:
        args = shlex.split(cmd)[2:]
        args[0] = str(tmp_path / "shards")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            script.main([*args, "--params", str(REPO / "params.yaml")])
        assert out.getvalue().strip() == expected.strip(), cmd
    # the held-out test sets' sizes with and without DP (docs/privacy.md, "What a site returns for evaluation")
    (rows_cmd, rows_expected), *_ = re.findall(
        r"```bash\n(python scripts/held_out_rows\.py [^\n]*)\n```\n\n```text\n(.*?)\n```", doc, re.S
    )
    spec = importlib.util.spec_from_file_location("held_out_rows_script", REPO / "scripts" / "held_out_rows.py")
    assert spec is not None and spec.loader is not None
    rows = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rows)
    assert rows.table(tmp_path / "shards") == rows_expected.strip(), rows_cmd
