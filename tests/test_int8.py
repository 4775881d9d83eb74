"""The INT8 copy of an export (`fedccrl export --int8 true`, pipeline/fedccrl_pipeline/quantize.py) and
`fedccrl-serve --int8`: calibrated on source domains only, gated on the held-out accuracy both ways, refused
without output, its metadata, and serving's errors.

Shards: the session's tiny synthetic dataset (conftest.py `tiny`); the model: a seeded random small_cnn at 32 px
(test_export.py's `write_model`), exported once per module.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from test_export import HELD_OUT, leftovers, run_export, write_model

from fedccrl_core.data.manifest import load_manifest
from fedccrl_core.data.shards import load_client, load_domain_test
from fedccrl_core.foundation.errors import FedCCRLError, ParamError
from fedccrl_pipeline import quantize
from fedccrl_pipeline.quantize import Int8Refused, Int8Settings, calibration_set, checked_int8
from fedccrl_serving.cli import main as serve

SOURCES = ["art", "cartoon", "photo"]


@pytest.fixture(scope="module")
def shards(tiny) -> Path:
    return tiny / "data" / "shards"


@pytest.fixture(scope="module")
def exported(shards, tmp_path_factory):
    """One export with its INT8 copy through the stage CLI; a gate of 100 points, so that this fixture does not
    depend on the random model's drop (the gate itself: test_the_gate_passes_at_the_drop_and_refuses_below_it)."""
    d = tmp_path_factory.mktemp("int8")
    model = write_model(d / "model.pt", shards)
    result = run_export(model, shards, d / "out", "--no-mlflow", "--int8", "true", "--int8-max-drop", "100")
    assert result.exit_code == 0, result.stderr
    return model, d / "out", result


def props(path: Path) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


def serve_cli(*args):
    return CliRunner().invoke(serve, [str(a) for a in args], catch_exceptions=False)


def test_export_writes_the_int8_copy_beside_the_float_model(exported, shards):
    _, out, result = exported
    assert leftovers(out) == {"model.onnx", "model.int8.onnx", "parity.json", "MODEL_CARD.md"}
    int8 = json.loads((out / "parity.json").read_text())["int8"]
    x, _ = load_domain_test(shards, HELD_OUT)
    assert list(int8) == [  # parity.json's "int8", its keys in their order
        "file",
        "float32_accuracy",
        "int8_accuracy",
        "accuracy_drop_points",
        "max_drop_points",
        "calibration_images",
        "calibration_domains",
        "n_images",
        "bytes",
    ]
    assert int8["file"] == "model.int8.onnx"  # the name it was renamed to, not the temporary one
    assert int8["n_images"] == len(x) and int8["calibration_domains"] == SOURCES
    assert int8["accuracy_drop_points"] == pytest.approx(100 * (int8["float32_accuracy"] - int8["int8_accuracy"]))
    assert f"INT8 on {len(x)} {HELD_OUT} images: accuracy" in result.stderr
    # the float32 accuracy is the ONNX model's that parity measured (the same images, the same labels)
    assert int8["float32_accuracy"] == json.loads((out / "parity.json").read_text())["onnx_accuracy"]
    assert (out / "model.int8.onnx").stat().st_size < (out / "model.onnx").stat().st_size / 2
    fp, q = props(out / "model.onnx"), props(out / "model.int8.onnx")
    assert {k: v for k, v in q.items() if k in fp} == fp  # the same preprocessing and provenance
    assert q["precision"] == "int8" and "precision" not in fp
    assert (
        json.loads(q["calibration_domains"]) == SOURCES and int(q["calibration_images"]) == int8["calibration_images"]
    )
    assert "QDQ" in q["quantization"] and "per channel" in q["quantization"]
    graph_ops = {n.op_type for n in onnx.load(str(out / "model.int8.onnx")).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= graph_ops


def test_calibration_reads_source_domains_only(shards):
    manifest = load_manifest(shards)
    n_source_train = sum(c.n_train for c in manifest.clients if c.domain != HELD_OUT)
    images, domains = calibration_set(shards, HELD_OUT, 10**6)  # more than there are: every source training image
    assert domains == SOURCES and len(images) == n_source_train
    held_out, _ = load_domain_test(shards, HELD_OUT)
    held = {im.tobytes() for im in held_out}
    assert not any(im.tobytes() in held for im in images)
    few, _ = calibration_set(shards, HELD_OUT, 7)  # spread over the 6 source clients
    assert len(few) == 7
    # a model trained under train.privacy: the source domains' val rows, which no run of the study trains on
    private, domains = calibration_set(shards, HELD_OUT, 10**6, private=True)
    vals = [load_client(shards, c.id).val_x for c in manifest.clients if c.domain != HELD_OUT]
    assert domains == SOURCES and np.array_equal(private, np.concatenate(vals))
    trained = {im.tobytes() for c in manifest.clients for im in load_client(shards, c.id).train_x}
    assert not any(im.tobytes() in trained for im in private)


def test_calibration_without_a_source_domain_is_an_error_naming_the_shards(shards, tmp_path):
    only = tmp_path / "shards"
    shutil.copytree(shards, only)
    doc = json.loads((only / "manifest.json").read_text())
    doc["clients"] = [c for c in doc["clients"] if c["domain"] == HELD_OUT]
    (only / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(FedCCRLError, match=f"{only}: no source-domain client to calibrate.*only {HELD_OUT}"):
        calibration_set(only, HELD_OUT, 16)


def test_the_gate_passes_at_the_drop_and_refuses_below_it(exported, shards, tmp_path):
    _, out, _ = exported
    test = load_domain_test(shards, HELD_OUT)
    drop = json.loads((out / "parity.json").read_text())["int8"]["accuracy_drop_points"]
    passed = checked_int8(out / "model.onnx", tmp_path / "a.onnx", shards, HELD_OUT, test, Int8Settings(64, drop), 16)
    assert passed.accuracy_drop_points == drop and (tmp_path / "a.onnx").is_file()
    with pytest.raises(Int8Refused, match=rf"is {drop:.2f} points below float32's .*export.int8_max_drop="):
        checked_int8(out / "model.onnx", tmp_path / "b.onnx", shards, HELD_OUT, test, Int8Settings(64, drop - 0.01), 16)


def test_a_refused_int8_copy_leaves_no_output(shards, tmp_path):
    model = write_model(tmp_path / "model.pt", shards)
    out = tmp_path / "out"
    result = run_export(model, shards, out, "--no-mlflow", "--int8", "true", "--int8-max-drop", "-100")
    assert result.exit_code == 2
    assert "error: INT8 model refused: held-out accuracy" in result.stderr
    assert "export.int8_max_drop=-100" in result.stderr and "no model written" in result.stderr
    assert leftovers(out) == set()  # neither model.onnx, model.int8.onnx, parity.json nor a temp file


def test_int8_params_are_typed_with_bounds(params):
    from fedccrl_pipeline.params import load_config

    cfg = load_config(params())
    assert (cfg.export.int8, cfg.export.int8_max_drop, cfg.export.int8_calibration_images) == (
        False,
        quantize.MAX_DROP_POINTS,
        quantize.CALIBRATION_IMAGES,
    )
    for key, bad in (("export.int8_max_drop", 101), ("export.int8_calibration_images", 0), ("export.int8", "yes")):
        with pytest.raises(ParamError, match=key.replace(".", r"\.")):
            load_config(params({key: bad}))


# ------------------------------------------------------------------ fedccrl-serve --int8


def test_serve_int8_info_and_predict(exported, shards, tmp_path):
    _, out, _ = exported
    r = serve_cli("info", out / "model.onnx", "--int8")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["precision"] == "int8" and doc["file"] == str(out / "model.int8.onnx")
    assert doc["metadata"]["calibration_domains"] == SOURCES and doc["metadata"]["calibration_images"] > 0
    assert json.loads(serve_cli("info", out / "model.onnx").stdout)["precision"] == "float32"
    from PIL import Image

    x, _ = load_domain_test(shards, HELD_OUT)
    for i in range(3):
        Image.fromarray(x[i]).save(tmp_path / f"{i}.png")
    r = serve_cli("predict", out / "model.onnx", tmp_path, "--int8", "--quiet")
    assert r.exit_code == 0, r.stderr
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(recs) == 3 and all(0 < rec["score"] <= 1 for rec in recs)


def test_serve_int8_errors_name_the_file(exported, tmp_path):
    _, out, _ = exported
    lone = tmp_path / "model.onnx"
    shutil.copy(out / "model.onnx", lone)
    r = serve_cli("predict", lone, tmp_path, "--int8")
    assert r.exit_code == 2
    assert r.stderr.strip() == (
        f"fedccrl-serve: error: {tmp_path / 'model.int8.onnx'}: no INT8 model beside {lone} (export it with "
        "params export.int8: true, or `fedccrl export ... --int8 true`)"
    )
    fake = tmp_path / "fake.int8.onnx"  # a float32 export under an INT8 name
    shutil.copy(out / "model.onnx", fake)
    r = serve_cli("info", fake, "--int8")
    assert r.exit_code == 2
    assert r.stderr.strip() == f"fedccrl-serve: error: {fake}: --int8, but the file's metadata says precision float32"
    r = serve_cli("info", tmp_path / "absent.onnx", "--int8")
    assert r.exit_code == 2 and "absent.int8.onnx: model file not found" in r.stderr


# ------------------------------------------------------------------ fedccrl-bench int8


def test_the_bench_report_says_whether_the_target_is_met_and_passes_the_docs_check():
    from test_readme_blocks import check_bench_output

    from fedccrl_benchmarks.int8 import report

    def side(mb, ms, ips, acc, op):
        return {"mb": mb, "batch1_ms": ms, "batch32_ips": ips, "accuracy": acc, "ops": [(op, 0.6), ("Add", 0.4)]}

    results = {
        ("small_cnn", "trained (models/x)", 32): {
            "float32": side(0.27, 0.05, 20000.0, 60.0, "Conv"),
            "int8": side(0.09, 0.04, 30000.0, 59.5, "QLinearConv"),
        },
        ("mobilenet_v3_large", "random, seed 0", 224): {
            "float32": side(17.0, 3.0, 200.0, 16.0, "Conv"),
            "int8": side(4.25, 3.3, 300.0, 0.0, "QLinearConv"),
        },
    }
    lines = report(results, 1, 64)
    assert "ratio int8/float32, small_cnn: file size 0.33x  batch-32 images/s 1.50x  batch-1 latency 0.80x  " in (
        "\n".join(lines)
    )
    assert lines[-1] == (
        "target on mobilenet_v3_large: images/s at batch 32 >= 2x (not met: 1.50x), size <= 1/3 (met: 0.25x)"
    )
    assert check_bench_output("fedccrl-bench int8", "\n".join(lines)) == []
    results["mobilenet_v3_large", "random, seed 0", 224]["int8"]["batch1_ms"] = float("nan")  # no measurement
    assert check_bench_output("fedccrl-bench int8", "\n".join(report(results, 1, 64)))
