"""`fedccrl-serve`: predict / evaluate / info, the preprocessing contract and bad input.

One random small_cnn at 32 px is exported once per module; its PyTorch twin is the reference for
every prediction checked here.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from fedccrl_core.data.images import RESIZE_POLICY, load_rgb, resize_u8
from fedccrl_core.learning.model_file import ModelMeta
from fedccrl_core.learning.models import build_model
from fedccrl_core.learning.statistics import normalize_u8
from fedccrl_pipeline.onnx_export import export_onnx
from fedccrl_serving.cli import main
from fedccrl_serving.metadata import ServingMetadata
from fedccrl_serving.preprocess import preprocess_files
from fedccrl_serving.runtime import ServedModel

CLASSES = ["dog", "elephant", "giraffe", "guitar"]
SIZE = 32
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def make_meta(**over) -> ModelMeta:
    meta = dict(
        backbone="small_cnn",
        num_classes=len(CLASSES),
        classes=CLASSES,
        image_size=SIZE,
        mean=MEAN,
        std=STD,
        resize=RESIZE_POLICY,
        dataset="synthetic",
        domains=["a", "b", "c", "d"],
        held_out_domain="d",
        held_out_index=3,
        algorithm="fedccrl",
        seed=0,
        round=10,
        params_hash="0123abcd",
        git_commit="f00dcafe",
    )
    meta.update(over)
    return ModelMeta(**meta)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(onnx path, torch model) of a random small_cnn: distinct logits per image, so labels are checkable."""
    torch.manual_seed(0)
    model = build_model("small_cnn", len(CLASSES)).eval()
    path = tmp_path_factory.mktemp("export") / "model.onnx"
    export_onnx(model, make_meta(), path)
    return path, model


def torch_probs(model, paths) -> np.ndarray:
    """The reference: training eval transform + PyTorch model + softmax."""
    u8 = torch.from_numpy(np.stack([resize_u8(load_rgb(p), SIZE) for p in paths]))
    with torch.no_grad():
        return torch.softmax(model(normalize_u8(u8, MEAN, STD)).double(), 1).numpy()


def save_rgb(path: Path, arr: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)
    return path


def random_rgb(seed: int, h: int = 37, w: int = 45) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (1, 1, 3))  # a colour cast per image so predictions differ
    return np.clip(rng.integers(0, 256, (h, w, 3)) * 0.5 + base * 0.5, 0, 255).astype(np.uint8)


@pytest.fixture
def image_dir(tmp_path) -> Path:
    d = tmp_path / "imgs"
    for i in range(5):
        save_rgb(d / f"{i}.png", random_rgb(i))
    save_rgb(d / "nested" / "deep" / "5.jpg", random_rgb(5, 64, 20))
    (d / "notes.txt").write_text("not an image, skipped by the folder walk")
    return d


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def one_error_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fedccrl-serve: error: ")
    return lines[0]


# ------------------------------------------------------------------ info / help


def test_info_prints_the_metadata(exported):
    r = cli("info", exported[0])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    meta = doc["metadata"]
    for key, value in make_meta().to_dict().items():
        assert meta[key] == value, key
    assert meta["fedccrl_format"] == 1
    assert doc["inputs"][0]["name"] == "images" and doc["inputs"][0]["shape"][1:] == [3, SIZE, SIZE]
    assert isinstance(doc["inputs"][0]["shape"][0], str)  # the dynamic batch axis
    assert doc["outputs"][0]["name"] == "logits"


def test_help_and_version():
    for cmd in ([], ["predict"], ["evaluate"], ["info"]):
        r = cli(*cmd, "--help")
        assert r.exit_code == 0 and "Usage:" in r.stdout
    r = cli("--version")
    assert r.exit_code == 0 and "fedccrl-serve" in r.stdout


# ------------------------------------------------------------------ predict


def test_predict_jsonl_matches_pytorch(exported, image_dir):
    path, model = exported
    r = cli("predict", path, image_dir, "--batch-size", 4, "--top-k", 3)
    assert r.exit_code == 0, r.stderr
    recs = jsonl(r.stdout)
    expected_paths = sorted(str(p) for p in image_dir.rglob("*") if p.suffix in (".png", ".jpg"))
    assert sorted(rec["path"] for rec in recs) == expected_paths  # notes.txt skipped, nested found
    probs = torch_probs(model, [rec["path"] for rec in recs])
    for rec, p in zip(recs, probs):
        assert set(rec) == {"path", "label", "score", "topk"}
        # compared through the probabilities, so that a near-tie cannot flip the test
        assert p[CLASSES.index(rec["label"])] == pytest.approx(p.max(), abs=1e-5)
        assert rec["score"] == pytest.approx(p.max(), abs=1e-5)
        assert [t["score"] for t in rec["topk"]] == pytest.approx(sorted(p, reverse=True)[:3], abs=1e-5)
        assert all(t["score"] == pytest.approx(p[CLASSES.index(t["label"])], abs=1e-5) for t in rec["topk"])
        assert rec["topk"][0] == {"label": rec["label"], "score": rec["score"]}
    assert {rec["label"] for rec in recs} <= set(CLASSES) and len(recs) == len(expected_paths)
    assert "images" in r.stderr  # progress on stderr, never on stdout


def test_predict_csv_to_file_with_globs_and_capped_top_k(exported, image_dir, tmp_path):
    out = tmp_path / "pred.csv"
    r = cli(
        "predict",
        exported[0],
        image_dir / "*.png",
        image_dir / "0.png",
        "--format",
        "csv",
        "--output",
        out,
        "--top-k",
        99,
        "-q",
    )
    assert r.exit_code == 0, r.stderr
    assert r.stdout == ""
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [row["path"] for row in rows] == [str(image_dir / f"{i}.png") for i in range(5)]  # de-duplicated
    for row in rows:
        topk = json.loads(row["topk"])
        assert len(topk) == len(CLASSES)
        assert row["label"] == topk[0]["label"] and float(row["score"]) == pytest.approx(topk[0]["score"])
        assert sum(t["score"] for t in topk) == pytest.approx(1.0)
        assert row["error"] == ""


def test_device_cuda_request_falls_back_to_cpu_with_a_notice(exported, image_dir):
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("a CUDA driver is present: the fallback path is not taken")
    except OSError:
        pass
    r = cli("predict", exported[0], image_dir / "0.png", "--device", "cuda")
    assert r.exit_code == 0
    assert "falling back to CPU" in r.stderr
    assert len(jsonl(r.stdout)) == 1


# ------------------------------------------------------------------ preprocessing contract


def test_preprocessing_equals_training_eval_transform(exported, image_dir, tmp_path):
    served = ServedModel(exported[0], "cpu")
    paths = sorted(image_dir.rglob("*.png")) + sorted(image_dir.rglob("*.jpg"))
    x, good, errors = preprocess_files(paths, served.meta, workers=2)
    assert good == list(range(len(paths))) and not errors
    for i, p in enumerate(paths):
        ref = normalize_u8(torch.from_numpy(np.array(resize_u8(load_rgb(p), SIZE)))[None], MEAN, STD)[0]
        assert torch.equal(torch.from_numpy(x[i]), ref), p
    # the size and normalization come from the metadata, not from a default
    other = ServingMetadata(tuple(CLASSES), 24, (0.5, 0.5, 0.5), (0.25, 0.5, 1.0), RESIZE_POLICY, {})
    x24, _, _ = preprocess_files(paths[:1], other)
    ref24 = normalize_u8(torch.from_numpy(np.array(resize_u8(load_rgb(paths[0]), 24)))[None], other.mean, other.std)[0]
    assert x24.shape == (1, 3, 24, 24) and torch.equal(torch.from_numpy(x24[0]), ref24)


def test_model_with_another_resize_policy_is_refused(tmp_path):
    import onnx

    from fedccrl_pipeline.onnx_export import metadata_props

    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Flatten", ["images"], ["flat"]),
            onnx.helper.make_node("Slice", ["flat", "s", "e", "a"], ["logits"]),
        ],
        "g",
        [onnx.helper.make_tensor_value_info("images", onnx.TensorProto.FLOAT, ["N", 3, 4, 4])],
        [onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", 4])],
        [onnx.helper.make_tensor(n, onnx.TensorProto.INT64, [1], [v]) for n, v in (("s", 0), ("e", 4), ("a", 1))],
    )
    m = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=9)
    onnx.helper.set_model_props(m, metadata_props(make_meta(image_size=4, resize="center crop 87.5%")))
    path = tmp_path / "crop.onnx"
    onnx.save(m, path)
    line = one_error_line(cli("info", path))
    assert "resize policy" in line and "center crop" in line


# ------------------------------------------------------------------ image modes


def _modes(tmp_path: Path) -> tuple[Path, dict[str, Path]]:
    """An RGB reference and the same pixels stored as CMYK, grey, RGBA, palette, 16-bit and EXIF-rotated."""
    rng = np.random.default_rng(7)
    grey = rng.integers(0, 256, (30, 41)).astype(np.uint8)
    ref = np.repeat(grey[..., None], 3, axis=2)  # grey so that the L and 16-bit files carry the same pixels
    ref[:10, :, 0] = 200  # plus a coloured band for the colour-capable formats
    out = {}
    d = tmp_path / "modes"
    ref_path = save_rgb(d / "ref.png", ref)
    grey_ref = save_rgb(d / "grey_ref.png", np.repeat(grey[..., None], 3, axis=2))
    Image.fromarray(ref).convert("CMYK").save(d / "cmyk.tif")
    out["cmyk"] = (ref_path, d / "cmyk.tif")
    Image.fromarray(grey).save(d / "grey.png")
    out["grey"] = (grey_ref, d / "grey.png")
    Image.fromarray(grey.astype(np.uint16) * 257).save(d / "grey16.png")
    assert Image.open(d / "grey16.png").mode.startswith("I")
    out["16-bit"] = (grey_ref, d / "grey16.png")
    Image.fromarray(np.dstack([ref, np.full(grey.shape, 255, np.uint8)])).save(d / "rgba.png")
    out["rgba"] = (ref_path, d / "rgba.png")
    palette_img = Image.fromarray(ref).quantize(colors=256)  # lossy vs ref: compare with its own RGB
    pal_ref = save_rgb(d / "pal_ref.png", np.asarray(palette_img.convert("RGB")))
    palette_img.save(d / "palette.png")
    assert Image.open(d / "palette.png").mode == "P"
    out["palette"] = (pal_ref, d / "palette.png")
    for orientation, k in ((6, 1), (8, -1), (3, 2)):  # stored rotated; the EXIF tag rotates it back
        exif = Image.Exif()
        exif[0x0112] = orientation
        Image.fromarray(np.ascontiguousarray(np.rot90(ref, k))).save(d / f"exif{orientation}.png", exif=exif)
        out[f"exif-{orientation}"] = (ref_path, d / f"exif{orientation}.png")
    return d, out


def test_image_modes_are_converted_like_their_rgb_reference(exported, tmp_path):
    path, _ = exported
    _, cases = _modes(tmp_path)
    served = ServedModel(path, "cpu")
    for name, (ref, variant) in cases.items():
        x, _good, errors = preprocess_files([ref, variant], served.meta)
        assert not errors, (name, errors)
        assert np.array_equal(x[0], x[1]), f"{name}: preprocessed tensor differs from the RGB reference"
    r = cli("predict", path, *[p for pair in cases.values() for p in pair], "-q")
    assert r.exit_code == 0, r.stderr
    by_path = {rec["path"]: rec for rec in jsonl(r.stdout)}
    for name, (ref, variant) in cases.items():
        a, b = by_path[str(ref)], by_path[str(variant)]
        assert a["label"] == b["label"] and a["score"] == pytest.approx(b["score"], abs=1e-6), name


# ------------------------------------------------------------------ bad input


def _bomb_png(path: Path, side: int = 30000) -> Path:
    """A 100-byte PNG that claims 30000 x 30000 pixels (900 M, over PIL's bomb limit)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )
    return path


@pytest.fixture
def bad_inputs(tmp_path) -> dict[str, Path]:
    d = tmp_path / "bad"
    d.mkdir()
    good = save_rgb(d / "good.png", random_rgb(1))
    jpg = io.BytesIO()
    Image.fromarray(random_rgb(2, 64, 64)).save(jpg, format="JPEG", quality=90)
    (d / "truncated.jpg").write_bytes(jpg.getvalue()[: len(jpg.getvalue()) // 2])
    png = (d / "good.png").read_bytes()
    (d / "corrupt.png").write_bytes(png[:60] + bytes(range(256)) * 4 + png[-12:])
    (d / "zero.png").write_bytes(b"")
    (d / "text.jpg").write_text("hello, I am not a JPEG\n")
    _bomb_png(d / "bomb.png")
    good2 = save_rgb(d / "z_good.png", random_rgb(3))
    return {"good": good, "good2": good2, **{p.stem: p for p in d.iterdir() if "good" not in p.stem}}


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_bad_files_get_error_records_and_the_rest_is_predicted(exported, bad_inputs, fmt):
    r = cli("predict", exported[0], bad_inputs["good"].parent, "--format", fmt, "--batch-size", 3)
    assert r.exit_code == 3
    recs = jsonl(r.stdout) if fmt == "jsonl" else list(csv.DictReader(io.StringIO(r.stdout)))
    by_name = {Path(rec["path"]).name: rec for rec in recs}
    assert len(recs) == 7
    expected = {
        "truncated.jpg": "truncated",
        "corrupt.png": "corrupt",
        "zero.png": "zero-byte",
        "text.jpg": "not an image",
        "bomb.png": "decompression bomb",
    }
    for name, words in expected.items():
        assert words in by_name[name]["error"], (name, by_name[name])
        assert not by_name[name].get("label")
    for name in ("good.png", "z_good.png"):
        assert by_name[name]["label"] in CLASSES and not by_name[name].get("error")
    assert "5 of 7 inputs could not be read" in r.stderr


def test_missing_path_empty_folder_and_foreign_onnx_give_one_line(exported, tmp_path):
    path, _ = exported
    img = save_rgb(tmp_path / "a.png", random_rgb(0))
    (tmp_path / "empty").mkdir()
    cases = {
        "no such file or folder": ("predict", path, img, tmp_path / "nope.png"),
        "folder has no image files": ("predict", path, tmp_path / "empty"),
        "no file matches": ("predict", path, tmp_path / "*.webp"),
        "model file not found": ("predict", tmp_path / "missing.onnx", img),
        "not a readable ONNX model": ("info", img),
    }
    import onnx

    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    foreign = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=9)
    onnx.save(foreign, tmp_path / "other.onnx")
    cases["not a fedccrl export"] = ("predict", tmp_path / "other.onnx", img)
    cases["class folders hold no image files"] = ("evaluate", path, _empty_class_tree(tmp_path))
    for words, args in cases.items():
        r = cli(*args)
        assert r.exit_code == 2, (words, r.stderr)
        assert words in one_error_line(r)
        assert r.stdout == ""


def _empty_class_tree(tmp_path: Path) -> Path:
    (tmp_path / "tree" / "dog").mkdir(parents=True)
    return tmp_path / "tree"


# ------------------------------------------------------------------ evaluate


@pytest.fixture
def labelled(tmp_path) -> Path:
    d = tmp_path / "unseen"
    for c, cls in enumerate(CLASSES[:3]):  # one class without a folder: allowed
        for i in range(3):
            save_rgb(d / cls / f"{i}.png", random_rgb(10 * c + i))
    return d


def test_evaluate_reports_accuracy_per_class_and_confusion(exported, labelled, tmp_path):
    path, model = exported
    out = tmp_path / "report.json"
    r = cli("evaluate", path, labelled, "--json", "--output", out, "--batch-size", 4)
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc == json.loads(out.read_text())
    files = sorted(labelled.rglob("*.png"))
    truth = [CLASSES.index(p.parent.name) for p in files]
    pred = torch_probs(model, files).argmax(1)
    cm = np.zeros((len(CLASSES), len(CLASSES)), int)
    for t, p in zip(truth, pred):
        cm[t, p] += 1
    assert doc["confusion_matrix"] == cm.tolist()
    assert doc["accuracy"] == pytest.approx(np.trace(cm) / len(files))
    assert doc["n_images"] == 9 and doc["n_failed"] == 0 and doc["errors"] == []
    assert doc["per_class"]["dog"] == {"n": 3, "correct": int(cm[0, 0]), "accuracy": cm[0, 0] / 3}
    assert doc["per_class"]["guitar"]["accuracy"] is None
    assert "confusion matrix" in r.stderr  # the table goes to stderr when stdout carries JSON
    r = cli("evaluate", path, labelled, "-q")
    assert r.exit_code == 0 and r.stdout.startswith("accuracy ") and "confusion matrix" in r.stdout


def test_evaluate_names_unknown_class_folders_and_counts_bad_images(exported, labelled):
    path, _ = exported
    (labelled / "dog" / "zero.png").write_bytes(b"")
    r = cli("evaluate", path, labelled, "--json", "-q")
    assert r.exit_code == 3
    doc = json.loads(r.stdout)
    assert doc["n_images"] == 9 and doc["n_failed"] == 1 and doc["errors"][0]["path"].endswith("zero.png")
    save_rgb(labelled / "zebra" / "0.png", random_rgb(0))
    save_rgb(labelled / "Dogs" / "0.png", random_rgb(0))
    line = one_error_line(cli("evaluate", path, labelled))
    assert "Dogs, zebra" in line and "model classes: dog, elephant" in line


# ------------------------------------------------------------------ the installed console script


def test_console_script_end_to_end(exported, labelled):
    script = Path(sys.executable).parent / "fedccrl-serve"
    if not script.exists():
        script = shutil.which("fedccrl-serve")
    if not script:
        pytest.skip("the fedccrl-serve console script is not installed (pip install -e .)")
    path, model = exported

    def run(*args):
        return subprocess.run([str(script), *map(str, args)], capture_output=True, text=True, timeout=120)

    r = run("predict", path, labelled, "--top-k", 2)
    assert r.returncode == 0, r.stderr
    recs = jsonl(r.stdout)
    probs = torch_probs(model, [rec["path"] for rec in recs])
    assert all(p[CLASSES.index(rec["label"])] == pytest.approx(p.max(), abs=1e-5) for rec, p in zip(recs, probs))
    assert all(len(rec["topk"]) == 2 for rec in recs)
    r = run("evaluate", path, labelled, "--json", "-q")
    assert r.returncode == 0 and json.loads(r.stdout)["n_images"] == 9 and "confusion matrix" in r.stderr
    r = run("info", path)
    assert r.returncode == 0 and json.loads(r.stdout)["metadata"]["classes"] == CLASSES


def test_serving_runs_without_torch(exported, labelled):
    """`fedccrl-serve predict` and `evaluate` in a process where `import torch` fails (no torch in
    the serving process, which keeps it fast to start and small; preprocessing is numpy/PIL, inference onnxruntime)."""
    path, model = exported
    code = (
        "import sys; sys.modules['torch'] = None; from fedccrl_serving.cli import main; "
        "main(sys.argv[1:], standalone_mode=True)"
    )
    for args in (["predict", str(path), str(labelled)], ["evaluate", str(path), str(labelled), "--json", "-q"]):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "torch" not in r.stderr
    recs = jsonl(
        subprocess.run(
            [sys.executable, "-c", code, "predict", str(path), str(labelled)],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    )
    probs = torch_probs(model, [rec["path"] for rec in recs])
    assert all(p[CLASSES.index(rec["label"])] == pytest.approx(p.max(), abs=1e-5) for rec, p in zip(recs, probs))
