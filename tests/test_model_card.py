"""The model card (pipeline/fedccrl_pipeline/model_card.py): every number of the card read back from its Markdown and
compared with the record it came from; the Wilson interval against hand-computed values; the quotes of
docs/privacy.md still in the doc; and `fedccrl export` writing the card with the model (and no card when the export
fails), from the evaluate stage's result, shown by `fedccrl-serve info`.
The deployment's card is tests/test_deploy_stages.py's; the card as the registered version's description and the
sweep's ε from the MLflow parent are checked in tests/test_export.py's MLflow test (its store already made)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_export import HELD_OUT, leftovers, run_export, write_model

from fedccrl_core.data.manifest import FORMAT_VERSION, ShardManifest
from fedccrl_core.federation.history import RunHistory, RunPrivacySummary
from fedccrl_core.foundation import contract
from fedccrl_core.learning.model_meta import ModelMeta
from fedccrl_core.outcomes.evaluated import EvaluatedRun, Scored, Selections, write_result
from fedccrl_core.outcomes.intervals import wilson_interval
from fedccrl_pipeline.card_privacy import QUOTES
from fedccrl_pipeline.card_records import CardRecords, SweepEpsilon
from fedccrl_pipeline.checked_export import HELD_OUT_IMAGES, ExportParity
from fedccrl_pipeline.model_card import render
from fedccrl_pipeline.quantize import Int8Figures
from fedccrl_serving.cli import main as serve

REPO = Path(__file__).resolve().parents[1]
CLASSES = ["dog", "cat", "horse"]

# ------------------------------------------------------------------ reading a card back


def sections(card: str) -> dict[str, list[str]]:
    """The card's lines under each '## ' and '### ' heading."""
    out: dict[str, list[str]] = {}
    title = ""
    for line in card.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip()
            out[title] = []
        else:
            out.setdefault(title, []).append(line)
    return out


def tables(lines: list[str]) -> list[list[dict[str, str]]]:
    """The Markdown tables among `lines`, each as its rows keyed by the header's cells."""
    found, rows = [], []
    for line in [*lines, ""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            header, _sep, *body = rows
            found.append([dict(zip(header, r)) for r in body])
            rows = []
    return found


def kv(table: list[dict[str, str]]) -> dict[str, str]:
    """A two-column table (field | value) as a dict."""
    return {r[next(iter(r))]: list(r.values())[1] for r in table}


def pct(cell: str) -> float:
    m = re.fullmatch(r"([0-9.]+) %", cell)
    assert m, cell
    return float(m.group(1)) / 100


def interval(cell: str) -> tuple[float, float]:
    lo, hi = cell.split(" – ")
    return pct(lo), pct(hi)


def check_accuracy_row(row: dict[str, str], accuracy: float, n: int) -> None:
    """A card's accuracy row against the record's accuracy and image count."""
    k = round(accuracy * n)
    assert pct(row["accuracy"]) == pytest.approx(accuracy, abs=5e-5)
    assert (int(row["correct"]), int(row["images"])) == (k, n)
    lo, hi = wilson_interval(k, n)
    assert interval(row["95 % interval (Wilson)"]) == pytest.approx((lo, hi), abs=5e-5)


# ------------------------------------------------------------------ the records of one private run


def _meta(**over) -> ModelMeta:
    fields = dict(
        backbone="mobilenet_v3_large",
        num_classes=3,
        classes=CLASSES,
        image_size=224,
        mean=[0.485, 0.456, 0.406],
        std=[0.229, 0.224, 0.225],
        resize="resize SxS bilinear",
        dataset="pacs",
        domains=["photo", "art", "cartoon", "sketch"],
        held_out_domain="sketch",
        held_out_index=3,
        algorithm="fedccrl",
        seed=2,
        hparams={"alpha": 0.1, "r": 0.1, "lambda1": 0.1, "chains": [1, 2, 3]},
        params_hash="0123456789abcdef",
        git_commit="deadbeefcafe",
        mlflow_run_id="a" * 32,
        platform="x86_64 avx512f torch 2.x",
        round=3,
    )
    return ModelMeta(**{**fields, **over})


def _history(meta: ModelMeta, dp: bool = True, mark: str | None = None) -> RunHistory:
    rounds = [
        {
            "round": r,
            "val_acc": 0.5 + r / 10,
            "target_acc": 0.4,
            "val_pred_classes": 3,
            "seconds": 1.0,
            "bytes_up": 100,
            "bytes_down": 200,
            **({"dp_epsilon": eps} if dp and mark is None else {}),
        }
        for r, eps in ((1, 3.25), (2, 5.5), (3, 7.875))
    ]
    privacy = RunPrivacySummary(noise="os entropy", delta=1e-5, trained_domains=["photo"], releases="x", mark=mark)
    fields = {k: v for k, v in meta.to_dict().items() if k != "round"}
    return RunHistory(meta=fields, best_round=2, rounds=rounds, dp=privacy if dp else None)


def _manifest() -> ShardManifest:
    clients = [
        dict(
            id=f"{d}_c{k}",
            domain=d,
            domain_index=i,
            k=k,
            file=f"{d}_c{k}.npz",
            n_train=10 + i + k,
            n_val=2 + k,
            train_class_hist=[3 + i, 4 + k, 3 + k],
            val_class_hist=[1, 1, k],
        )
        for i, d in enumerate(["photo", "art", "cartoon", "sketch"])
        for k in (0, 1)
    ]
    return ShardManifest(
        format_version=FORMAT_VERSION,
        dataset="pacs",
        domains=["photo", "art", "cartoon", "sketch"],
        classes=CLASSES,
        num_classes=3,
        image_size=224,
        layout="uint8",
        seed=0,
        params={},
        domain_sizes={"photo": 24, "art": 26, "cartoon": 28, "sketch": 30},
        clients=clients,
        skipped=[],
    )


def _evaluated(meta: ModelMeta) -> EvaluatedRun:
    cm = [[30, 5, 5], [4, 20, 6], [1, 2, 27]]  # rows: true class
    final = Scored(
        target_acc=77 / 100,
        round=3,
        per_class_acc={c: cm[i][i] / sum(cm[i]) for i, c in enumerate(CLASSES)},
        confusion=cm,
    )
    assert meta.algorithm and meta.seed is not None and meta.held_out_domain
    return EvaluatedRun(
        dataset=meta.dataset,
        algorithm=meta.algorithm,
        seed=meta.seed,
        held_out_domain=meta.held_out_domain,
        held_out_index=meta.held_out_index,
        classes=CLASSES,
        platform=meta.platform,
        n_test=100,
        mlflow_run_id=meta.mlflow_run_id,
        final_target_acc=0.77,
        best_val_target_acc=0.7,
        best_round=2,
        final_val_acc=0.8,
        detail=Selections(final=final, best_val=final),
        bytes_up_per_round=1.0,
        bytes_down_per_round=1.0,
        per_round=[],
    )


INT8 = Int8Figures(
    file="model.int8.onnx",
    float32_accuracy=0.76,
    int8_accuracy=0.75,
    accuracy_drop_points=1.0,
    max_drop_points=1.0,
    calibration_images=256,
    calibration_domains=("art_painting", "cartoon", "photo"),
    n_images=100,
    bytes=4_400_321,
)
PARITY = ExportParity(
    n_images=100,
    max_abs_logit_diff=1e-6,
    top1_agreement=1.0,
    onnx_accuracy=0.76,
    torch_accuracy=0.76,
    min_agreement=0.999,
    held_out_domain="sketch",
    onnx_bytes=16_800_123,
    inputs=HELD_OUT_IMAGES,
    int8=INT8,
)


def _records(**over) -> CardRecords:
    meta = over.pop("meta", _meta())
    fields = dict(
        meta=meta,
        history=_history(meta),
        parity=PARITY,
        evaluated=_evaluated(meta),
        evaluated_note="`results/runs/fedccrl/s2/d3.json`",
        manifest=_manifest(),
        federation=None,
        dataset_hash=("the shard manifest manifest.json", "f" * 64),
        sweep=SweepEpsilon(19.5, runs=6),
    )
    return CardRecords(**{**fields, **over})


# ------------------------------------------------------------------ tests


def test_wilson_interval_against_hand_computed_values():
    # 0 of 10 by hand: [0, z² / (n + z²)] = [0, 3.841459 / 13.841459] = [0, 0.277533]
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.277533), abs=1e-6)
    # 8 of 10 by hand: p = 0.8, z²/n = 0.384146, denominator 1.384146; centre (0.8 + 0.192073) / 1.384146 = 0.716740;
    # half 1.959964 x sqrt(0.016 + 0.000960) / 1.384146 = 0.226578 -> [0.4902, 0.9433]
    assert wilson_interval(8, 10) == pytest.approx((0.4902, 0.9433), abs=5e-5)
    # Newcombe (1998), Statistics in Medicine 17:857-872, Table I, method 3 (score interval without continuity
    # correction), to the 4 decimals printed there
    for (k, n), published in {
        (81, 263): (0.2553, 0.3662),
        (15, 148): (0.0624, 0.1605),
        (0, 20): (0.0, 0.1611),
        (1, 29): (0.0061, 0.1718),
    }.items():
        assert wilson_interval(k, n) == pytest.approx(published, abs=5e-5), (k, n)
    with pytest.raises(ValueError, match="11 correct of 10"):
        wilson_interval(11, 10)


def test_every_number_of_the_card_is_its_records():
    r = _records()
    card = sections(render(r))
    meta, manifest, ev = r.meta, r.manifest, r.evaluated
    assert manifest is not None and ev is not None

    model = kv(tables(card["Model"])[0])
    assert (model["algorithm"], model["backbone"], int(model["image size"])) == ("fedccrl", meta.backbone, 224)
    assert json.loads(model["normalization mean"]) == meta.mean and json.loads(model["normalization std"]) == meta.std
    assert model["resize"] == meta.resize and model["classes"] == f"3: {', '.join(CLASSES)}"
    assert (int(model["seed"]), int(model["rounds"]), int(model["weights of round"])) == (2, 3, 3)
    settings = kv(tables(card["Settings (train.fedccrl)"])[0])
    assert {k: json.loads(v) for k, v in settings.items()} == meta.hparams

    clients, per_class = tables(card["Training data"])
    sources = [c for c in manifest.clients if c.domain != "sketch"]
    assert [(c["client"], c["domain"], int(c["training images"]), int(c["validation images"])) for c in clients] == [
        (c.id, c.domain, c.n_train, c.n_val) for c in sources
    ]
    expected = {name: sum(c.train_class_hist[i] for c in sources) for i, name in enumerate(CLASSES)}
    assert {row["class"]: int(row["training images"]) for row in per_class} == expected
    assert "Training domains: photo, art, cartoon." in card["Training data"]

    accuracy, sizes = tables(card["Held-out accuracy"])
    final, onnx_row, int8_row = accuracy
    assert final["measure"] == "final round, measured by the evaluate stage"
    check_accuracy_row(final, ev.final_target_acc, 100)
    check_accuracy_row(onnx_row, PARITY.onnx_accuracy, PARITY.n_images)
    check_accuracy_row(int8_row, INT8.int8_accuracy, INT8.n_images)
    assert {s["file"]: int(s["bytes"]) for s in sizes} == {
        "model.onnx (float32)": PARITY.onnx_bytes,
        "model.int8.onnx (INT8)": INT8.bytes,
    }
    cm = ev.detail.final.confusion
    assert cm is not None and ev.detail.final.per_class_acc is not None
    for i, row in enumerate(tables(card["Per class (final round)"])[0]):
        assert row["class"] == CLASSES[i]
        assert pct(row["accuracy"]) == pytest.approx(ev.detail.final.per_class_acc[CLASSES[i]], abs=5e-5)
        assert (int(row["correct"]), int(row["images"])) == (cm[i][i], sum(cm[i]))

    dp = kv(tables(card["Differential privacy"])[0])
    assert float(dp["epsilon per run"]) == r.history.rounds[-1].dp_epsilon == 7.875
    assert float(dp["delta"]) == 1e-5
    assert dp["epsilon per image over the sweep"] == "19.5 over 6 runs"
    assert any(QUOTES.unit in line for line in card["Differential privacy"])

    prov = kv(tables(card["Provenance"])[0])
    assert prov == {
        "git commit": meta.git_commit,
        "params hash (run key)": meta.params_hash,
        "dataset: sha256 of the shard manifest manifest.json": "f" * 64,
        "platform": meta.platform,
        "MLflow run": meta.mlflow_run_id,
    }


def test_a_card_without_the_evaluate_result_says_its_accuracy_is_the_parity_checks():
    card = sections(render(_records(evaluated=None, evaluated_note="results/x.json not found")))
    rows = tables(card["Held-out accuracy"])[0]
    assert [r["measure"] for r in rows] == ["export parity check: ONNX float32", "export parity check: INT8 copy"]
    assert any("the accuracy is the export's parity check only" in line for line in card["Held-out accuracy"])
    assert "Per class (final round)" not in card


def test_an_accuracy_that_is_no_whole_count_of_its_images_gets_no_interval():
    card = sections(
        render(_records(evaluated=_evaluated(_meta()).model_copy(update={"final_target_acc": 0.5, "n_test": 17})))
    )
    final = tables(card["Held-out accuracy"])[0][0]
    assert final["correct"] == "not a whole count (0.5 x 17)" and final["95 % interval (Wilson)"] == "not computed"


@pytest.mark.parametrize(
    "dp, mark, says", [(False, None, "without train.privacy"), (True, "not private (noise_seed)", QUOTES.seeded)]
)
def test_a_card_of_a_run_that_is_not_private_says_why(dp, mark, says):
    meta = _meta(privacy=mark)
    lines = sections(render(_records(meta=meta, history=_history(meta, dp=dp, mark=mark))))["Differential privacy"]
    text = " ".join(lines)
    assert text.strip().startswith("Not private") and says in text and not tables(lines)
    held_out = " ".join(
        sections(render(_records(meta=meta, history=_history(meta, dp=dp, mark=mark))))["Held-out accuracy"]
    )
    assert ("over the held-out domain's val rows only" in held_out) == dp  # under train.privacy, seeded or not


def test_the_quoted_facts_are_docs_privacy_word_for_word():
    doc = " ".join((REPO / "docs" / "privacy.md").read_text().replace("**", "").split())
    quotes = dataclasses.asdict(QUOTES)
    assert len(quotes) == 7
    for key, quote in quotes.items():
        assert quote in doc, key


# ------------------------------------------------------------------ fedccrl export


@pytest.fixture(scope="module")
def shards(tiny) -> Path:
    return tiny / "data" / "shards"


@pytest.fixture(scope="module")
def evaluated_export(shards, tmp_path_factory):
    """One run in the models/<alg>/s<seed>/d<entry> layout, its evaluate result, and its export with --results."""
    d = tmp_path_factory.mktemp("card")
    run = contract.run_dir(d / "models", "fedccrl", 0, HELD_OUT)
    run.mkdir(parents=True)
    model = write_model(run / contract.MODEL_FILE, shards)
    result = _evaluated(_load_meta(model)).model_copy(update={"final_target_acc": 0.625, "n_test": 48})
    write_result(result, contract.result_file(d / "results", d / "models", run))
    out = d / "out"
    res = run_export(model, shards, out, "--no-mlflow", "--results", d / "results")
    assert res.exit_code == 0, res.stderr
    return d, run, out, result


def _load_meta(path: Path) -> ModelMeta:
    from fedccrl_core.learning.model_file import load_meta

    return load_meta(path)


def test_export_writes_the_card_from_the_evaluate_result(evaluated_export, shards):
    _d, _run, out, result = evaluated_export
    assert leftovers(out) == {"model.onnx", "parity.json", "MODEL_CARD.md"}
    card = sections((out / "MODEL_CARD.md").read_text())
    rows = tables(card["Held-out accuracy"])[0]
    check_accuracy_row(rows[0], result.final_target_acc, 48)
    parity = json.loads((out / "parity.json").read_text())
    check_accuracy_row(rows[1], parity["onnx_accuracy"], parity["n_images"])
    sha = __import__("hashlib").sha256((shards / "manifest.json").read_bytes()).hexdigest()
    assert kv(tables(card["Provenance"])[0])["dataset: sha256 of the shard manifest manifest.json"] == sha


def test_an_evaluate_result_of_another_run_is_refused_naming_it(evaluated_export, shards, tmp_path):
    d, run, _out, result = evaluated_export
    other = tmp_path / "results"
    path = contract.result_file(other, d / "models", run)
    write_result(result.model_copy(update={"seed": 7}), path)
    res = run_export(run, shards, tmp_path / "out", "--no-mlflow", "--results", other)
    assert res.exit_code == 2 and str(path) in res.stderr and "seed 7" in res.stderr, res.stderr
    assert leftovers(tmp_path / "out") == set()


def test_a_failed_export_leaves_no_card(shards, tmp_path, monkeypatch):
    """The card is written before parity.json and model.onnx: a failure writing parity.json removes it again; a stale
    card of an earlier export goes first."""
    from fedccrl_core.foundation import fsio

    model = write_model(tmp_path / "model.pt", shards)
    out = tmp_path / "out"
    out.mkdir()
    (out / "MODEL_CARD.md").write_text("a stale card of an earlier export")
    real = fsio.write_text
    seen = []

    def failing(path, text, newline=None):
        seen.append(Path(path).name)
        if Path(path).name == "parity.json":
            assert (out / "MODEL_CARD.md").is_file()  # the card was in place
            raise OSError(28, "No space left on device")
        return real(path, text, newline)

    monkeypatch.setattr(fsio, "write_text", failing)
    res = run_export(model, shards, out, "--no-mlflow")
    assert res.exit_code != 0 and seen == ["MODEL_CARD.md", "parity.json"]
    assert leftovers(out) == set()


def test_serve_info_says_where_the_card_is(evaluated_export, tmp_path):
    _d, _run, out, _result = evaluated_export
    r = CliRunner().invoke(serve, ["info", str(out / "model.onnx")], catch_exceptions=False)
    assert r.exit_code == 0 and json.loads(r.stdout)["model_card"] == str(out / "MODEL_CARD.md")
    (tmp_path / "model.onnx").write_bytes((out / "model.onnx").read_bytes())
    r = CliRunner().invoke(serve, ["info", str(tmp_path / "model.onnx")], catch_exceptions=False)
    assert r.exit_code == 0 and json.loads(r.stdout)["model_card"] is None
    assert f"no model card beside {tmp_path / 'model.onnx'}" in r.stderr


# ------------------------------------------------------------------ the sites' evaluation (fedccrl evaluate-sites)


def _sites_evaluated(meta: ModelMeta):
    from fedccrl_core.outcomes.site_scores import SiteProblem, SiteScore, SitesEvaluated, by_domain, pooled, score

    sites = [
        SiteScore(client="art_c0", domain="art", split="val", score=score([4, 3, 5], [3, 1, 5], [4, 2, 6], CLASSES)),
        SiteScore(
            client="sketch_c0", domain="sketch", split="all", score=score([20, 17, 9], [11, 9, 2], [25, 15, 6], CLASSES)
        ),
    ]
    return SitesEvaluated(
        model="models/fedccrl/s2/d3/model.pt",
        run_key=meta.params_hash,
        mlflow_run_id=meta.mlflow_run_id,
        algorithm=meta.algorithm,
        held_out_domain=meta.held_out_domain,
        classes=CLASSES,
        split="auto",
        sites=sites,
        domains=by_domain(sites, CLASSES),
        pooled=pooled([s.score for s in sites], CLASSES),
        refused=[SiteProblem(client="cartoon_c0", reason="classes differ")],
        dropped=[],
    )


def test_the_cards_sites_evaluation_is_each_sites_counts():
    meta = _meta()
    card = sections(render(_records(meta=meta, sites=_sites_evaluated(meta))))
    rows = {r["measure"]: r for r in tables(card["The sites' evaluation"])[0]}
    for what, correct, n in [
        ("site art_c0 (art, val)", 9, 12),
        ("site sketch_c0 (sketch, all)", 22, 46),
        ("domain art", 9, 12),
        ("domain sketch", 22, 46),
        ("all sites pooled", 31, 58),
    ]:
        check_accuracy_row(rows[what], correct / n, n)
    assert "Not evaluated: cartoon_c0 refused: classes differ." in card["The sites' evaluation"]
    assert "The sites' evaluation" not in sections(render(_records()))  # no evaluation ran: no section


def test_a_sites_evaluation_of_another_model_is_refused_naming_it(evaluated_export, shards, tmp_path):
    from fedccrl_core.outcomes.site_scores import write_scores

    _d, run, _out, _result = evaluated_export
    meta = _load_meta(run / contract.MODEL_FILE)
    path = write_scores(_sites_evaluated(meta).model_copy(update={"run_key": "another"}), tmp_path / "sites.json")
    res = run_export(run, shards, tmp_path / "out", "--no-mlflow", "--sites-evaluation", path)
    assert res.exit_code == 2 and str(path) in res.stderr and "'another'" in res.stderr, res.stderr
    assert leftovers(tmp_path / "out") == set()
    good = write_scores(_sites_evaluated(meta), tmp_path / "good" / "sites.json")
    res = run_export(run, shards, tmp_path / "out", "--no-mlflow", "--sites-evaluation", good.parent)
    assert res.exit_code == 0, res.stderr
    assert "site sketch_c0 (sketch, all)" in (tmp_path / "out" / "MODEL_CARD.md").read_text()
