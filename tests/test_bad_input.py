"""The bad-input suite: what a new user gets wrong, over download, data, params, training, export and
serving, one row of CASES each. Every case runs the command line a user would type (in process, through click)
and asserts the same five things:

  1. the exit code (2: a refused input, before any work);
  2. a message that names the file or the key (the `needles`);
  3. no traceback;
  4. no partial output (everything the command would write lives under out/, and out/ does not exist);
  5. no FAILED or RUNNING MLflow run (validation stops before a run is opened).

Cheap by design: every case is refused before any training, so the whole suite runs in seconds. The count is
visible: `pytest --collect-only -q tests/test_bad_input.py | grep -c '::test_bad_input\\['`, and
`test_the_suite_covers_every_area` asserts at least 120 cases over the six areas.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fixtures import DELETE, ONE_ROUND, tiny_onnx

AREAS = ("download", "data", "params", "training", "export", "serving")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Case:
    id: str
    area: str
    args: list[str]  # `fedccrl ...` (or `fedccrl-serve ...` when args[0] == "serve"); {data}: tiny
    needles: tuple[str, ...]  # each must be in the output: the key, the file, the value
    params: dict = field(default_factory=dict)  # dotted overrides of params.yaml (the value DELETE: delete)
    setup: Callable[[Path], None] | None = None  # prepares bad files in the case's folder
    code: int = 2
    new_keys: dict = field(default_factory=dict)  # keys params.yaml does not have (a typo, an unknown group)


# ------------------------------------------------------------------ commands
def train(*extra: str, held_out: str | None = "0", algorithm: str = "fedavg") -> list[str]:
    args = [
        "train",
        "--shards",
        "{data}/shards",
        "--pools",
        "{data}/pools",
        "--algorithm",
        algorithm,
        "--seed",
        "0",
        "--out",
        "out/model",
        "--checkpoints",
        "out/ck",
        *extra,
    ]
    return args + (["--held-out", held_out] if held_out is not None else [])


DOWNLOAD = ["download", "--out", "out/raw", "--report", "out/report.json"]
PARTITION = ["partition", "--raw", "raw", "--out", "out/shards"]
POOLS = ["pools", "--shards", "shards", "--out", "out/pools"]
EVALUATE = ["evaluate", "--shards", "{data}/shards", "--models", "models", "--out", "out/runs"]
EXPORT = [
    "export",
    "--models",
    "models",
    "--shards",
    "{data}/shards",
    "--out",
    "out/exports",
    "--summary",
    "out/parity.json",
    "--no-mlflow",
]
REPORT = ["report", "--runs", "runs", "--metrics", "out/m.json", "--table", "out/t.md", "--curves", "out/c.csv"]
FIGURES = [
    "figures",
    "--shards",
    "{data}/shards",
    "--pools",
    "{data}/pools",
    "--models",
    "models",
    "--runs",
    "runs",
    "--out",
    "out/plots",
]


def predict(*extra: str, model: str = "model.onnx", inputs: str = "imgs") -> list[str]:
    return ["serve", "predict", model, inputs, "--output", "out/preds.jsonl", *extra]


def evaluate_served(*extra: str, model: str = "model.onnx", folder: str = "imgs") -> list[str]:
    return ["serve", "evaluate", model, folder, "--output", "out/report.json", *extra]


# ------------------------------------------------------------------ bad files
def write(rel: str, content: str | bytes) -> Callable[[Path], None]:
    def f(ws: Path) -> None:
        p = ws / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())

    return f


def mkdirs(*rels: str) -> Callable[[Path], None]:
    def f(ws: Path) -> None:
        for rel in rels:
            (ws / rel).mkdir(parents=True, exist_ok=True)

    return f


def both(*fs: Callable[[Path], None]) -> Callable[[Path], None]:
    def f(ws: Path) -> None:
        for g in fs:
            g(ws)

    return f


def png(rel: str) -> Callable[[Path], None]:
    def f(ws: Path) -> None:
        import numpy as np
        from PIL import Image

        p = ws / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (9, 7, 3), dtype=np.uint8)).save(p)

    return f


def raw_tree(domains=("photo", "art"), classes=("dog", "cat"), n=3) -> Callable[[Path], None]:
    return both(*[png(f"raw/{d}/{c}/{i}.png") for d in domains for c in classes for i in range(n)])


def onnx_model(**kw) -> Callable[[Path], None]:
    def f(ws: Path) -> None:
        tiny_onnx(ws / "model.onnx", **kw)

    return f


SERVE_OK = both(onnx_model(), png("imgs/a/0.png"), png("imgs/b/0.png"))


def shards_copy(mutate: Callable[[dict], None] | None = None, drop: str | None = None) -> Callable[[Path], None]:
    """A copy of the tiny shards with its manifest changed (or a file dropped)."""

    def f(ws: Path) -> None:
        import shutil

        shutil.copytree(ws.parent / "data" / "shards", ws / "shards")
        if mutate is not None:
            m = json.loads((ws / "shards" / "manifest.json").read_text())
            mutate(m)
            (ws / "shards" / "manifest.json").write_text(json.dumps(m))
        if drop is not None:
            (ws / "shards" / drop).unlink()

    return f


def a_model_folder(content: bytes | None = None) -> Callable[[Path], None]:
    """models/<alg>/s<seed>/d<h>/ with a model.pt that is not one."""
    return write("models/fedavg/s0/d0/model.pt", content if content is not None else b"not a checkpoint")


# ------------------------------------------------------------------ the cases
CASES: list[Case] = [
    # ---- download: the dataset and download groups, and where the data goes
    Case("dl-unknown-dataset", "download", DOWNLOAD, ("dataset.name", "pacs"), {"dataset.name": "imagenet"}),
    Case("dl-bad-source", "download", DOWNLOAD, ("dataset.source",), {"dataset.source": "ftp"}),
    Case("dl-sha256-not-hex", "download", DOWNLOAD, ("dataset.sha256",), {"dataset.sha256": "xyz"}),
    Case("dl-seed-string", "download", DOWNLOAD, ("dataset.seed",), {"dataset.seed": "zero"}),
    Case("dl-timeout-zero", "download", DOWNLOAD, ("download.timeout_s",), {"download.timeout_s": 0}),
    Case("dl-timeout-negative", "download", DOWNLOAD, ("download.timeout_s",), {"download.timeout_s": -5}),
    Case("dl-deadline-zero", "download", DOWNLOAD, ("download.deadline_s",), {"download.deadline_s": 0}),
    Case("dl-deadline-string", "download", DOWNLOAD, ("download.deadline_s",), {"download.deadline_s": "1h"}),
    Case("dl-retries-negative", "download", DOWNLOAD, ("download.retries",), {"download.retries": -1}),
    Case("dl-retries-float", "download", DOWNLOAD, ("download.retries",), {"download.retries": 2.5}),
    Case(
        "dl-bad-fraction-above-1",
        "download",
        DOWNLOAD,
        ("download.max_bad_fraction",),
        {"download.max_bad_fraction": 1.5},
    ),
    Case("dl-unknown-key", "download", DOWNLOAD, ("download.timeout",), new_keys={"download.timeout": 10}),
    Case("dl-group-missing", "download", DOWNLOAD, ("download",), {"download": DELETE}),
    Case(
        "dl-out-is-a-file",
        "download",
        ["download", "--out", "raw.txt", "--report", "out/report.json"],
        ("raw.txt",),
        setup=write("raw.txt", "a file where the folder goes"),
    ),
    Case(
        "dl-imagefolder-missing",
        "download",
        DOWNLOAD,
        ("nowhere",),
        {"dataset.name": "imagefolder", "dataset.source": "nowhere"},
    ),
    # ---- data: partition and pools
    Case("part-raw-missing", "data", PARTITION, ("raw",)),
    Case("part-raw-empty", "data", PARTITION, ("raw",), setup=mkdirs("raw")),
    Case("part-raw-is-a-file", "data", PARTITION, ("raw",), setup=write("raw", "not a folder")),
    Case("part-one-domain", "data", PARTITION, ("raw", "domain"), setup=raw_tree(domains=("photo",))),
    Case(
        "part-clients-zero", "data", PARTITION, ("partition.clients_per_domain",), {"partition.clients_per_domain": 0}
    ),
    Case(
        "part-clients-string",
        "data",
        PARTITION,
        ("partition.clients_per_domain",),
        {"partition.clients_per_domain": "two"},
    ),
    Case("part-val-fraction-one", "data", PARTITION, ("partition.val_fraction",), {"partition.val_fraction": 1.0}),
    Case(
        "part-val-fraction-negative", "data", PARTITION, ("partition.val_fraction",), {"partition.val_fraction": -0.1}
    ),
    Case(
        "part-dirichlet-negative",
        "data",
        PARTITION,
        ("partition.dirichlet_alpha",),
        {"partition.dirichlet_alpha": -1.0},
    ),
    Case("part-scheme-unknown", "data", PARTITION, ("partition.scheme",), {"partition.scheme": "random"}),
    Case("part-num-clients-zero", "data", PARTITION, ("partition.num_clients",), {"partition.num_clients": 0}),
    Case("part-lambda-above-1", "data", PARTITION, ("partition.lambda",), {"partition.lambda": 2.0}),
    Case("part-image-size-zero", "data", PARTITION, ("preprocess.image_size",), {"preprocess.image_size": 0}),
    Case("part-image-size-word", "data", PARTITION, ("preprocess.image_size",), {"preprocess.image_size": "big"}),
    Case("pools-shards-missing", "data", POOLS, ("shards",)),
    Case("pools-no-manifest", "data", POOLS, ("manifest",), setup=mkdirs("shards")),
    Case("pools-manifest-not-json", "data", POOLS, ("manifest.json",), setup=write("shards/manifest.json", "{oops")),
    Case("pools-mean-two-values", "data", POOLS, ("preprocess.mean",), {"preprocess.mean": [0.5, 0.5]}),
    Case("pools-std-zero", "data", POOLS, ("preprocess.std",), {"preprocess.std": [0.2, 0.0, 0.2]}),
    Case("pools-std-negative", "data", POOLS, ("preprocess.std",), {"preprocess.std": [0.2, -0.2, 0.2]}),
    Case("pools-mean-string", "data", POOLS, ("preprocess.mean",), {"preprocess.mean": "imagenet"}),
    Case("pools-client-file-missing", "data", POOLS, ("photo_c0",), setup=shards_copy(drop="photo_c0.npz")),
    Case(
        "pools-manifest-without-clients",
        "data",
        POOLS,
        ("manifest.json",),
        setup=shards_copy(lambda m: m.pop("clients")),
    ),
    # ---- folders that overlap: an output folder is replaced whole, and would take its neighbour with it
    Case(
        "part-out-is-raw",
        "data",
        ["partition", "--raw", "raw", "--out", "raw"],
        ("--raw raw", "--out raw"),
        setup=raw_tree(),
    ),
    Case(
        "part-out-around-raw",
        "data",
        ["partition", "--raw", "raw", "--out", "."],
        ("--raw raw", "--out ."),
        setup=raw_tree(),
    ),
    Case(
        "pools-out-is-shards",
        "data",
        ["pools", "--shards", "shards", "--out", "shards"],
        ("--shards shards", "--out shards"),
        setup=shards_copy(),
    ),
    # ---- params: the file itself, and keys every stage validates first (run through `report`, the cheapest)
    Case("params-missing-file", "params", [*REPORT, "--params", "absent.yaml"], ("absent.yaml",)),
    Case("params-not-yaml", "params", REPORT, ("params.yaml",), setup=write("params.yaml", "train: [unclosed\n")),
    Case("params-empty-file", "params", REPORT, ("params.yaml",), setup=write("params.yaml", "")),
    Case("params-a-list", "params", REPORT, ("params.yaml",), setup=write("params.yaml", "- 1\n- 2\n")),
    Case("params-unknown-top-key", "params", REPORT, ("trian",), new_keys={"trian": {"rounds": 1}}),
    Case("params-unknown-algorithm-group", "params", REPORT, ("train.fedfoo",), new_keys={"train.fedfoo": {"x": 1}}),
    Case(
        "params-typo-in-fedccrl",
        "params",
        REPORT,
        ("train.fedccrl.lamda1", "lambda1"),
        new_keys={"train.fedccrl.lamda1": 0.1},
    ),
    Case("params-rounds-zero", "params", REPORT, ("train.rounds",), {"train.rounds": 0}),
    Case("params-rounds-float", "params", REPORT, ("train.rounds",), {"train.rounds": 2.5}),
    Case("params-engine-missing", "params", REPORT, ("train.engine",), {"train.engine": DELETE}),
    Case("params-epochs-zero", "params", REPORT, ("train.local_epochs",), {"train.local_epochs": 0}),
    Case("params-batch-zero", "params", REPORT, ("train.batch_size",), {"train.batch_size": 0}),
    Case("params-lr-negative", "params", REPORT, ("train.lr",), {"train.lr": -0.001}),
    Case("params-lr-zero", "params", REPORT, ("train.lr",), {"train.lr": 0}),
    Case("params-lr-string", "params", REPORT, ("train.lr",), {"train.lr": "fast"}),
    Case("params-weight-decay-negative", "params", REPORT, ("train.weight_decay",), {"train.weight_decay": -1}),
    Case("params-schedule-unknown", "params", REPORT, ("train.lr_schedule",), {"train.lr_schedule": "linear"}),
    Case("params-fraction-zero", "params", REPORT, ("train.client_fraction",), {"train.client_fraction": 0}),
    Case("params-fraction-above-1", "params", REPORT, ("train.client_fraction",), {"train.client_fraction": 1.5}),
    Case("params-device-tpu", "params", REPORT, ("train.device",), {"train.device": "tpu"}),
    Case("params-fast-word", "params", REPORT, ("train.fast",), {"train.fast": "maybe"}),
    Case("params-concurrent-zero", "params", REPORT, ("train.concurrent_clients",), {"train.concurrent_clients": 0}),
    Case("params-client-state-unknown", "params", REPORT, ("train.client_state",), {"train.client_state": "sticky"}),
    Case("params-engine-unknown", "params", REPORT, ("train.engine",), {"train.engine": "grpc"}),
    Case("params-algorithms-unknown", "params", REPORT, ("train.algorithms", "nope"), {"train.algorithms": ["nope"]}),
    Case("params-algorithms-string", "params", REPORT, ("train.algorithms",), {"train.algorithms": "fedavg"}),
    Case("params-algorithms-empty", "params", REPORT, ("train.algorithms",), {"train.algorithms": []}),
    Case("params-seeds-float", "params", REPORT, ("train.seeds",), {"train.seeds": [1.5]}),
    Case("params-seeds-duplicate", "params", REPORT, ("train.seeds",), {"train.seeds": [0, 0]}),
    Case("params-held-out-string", "params", REPORT, ("train.held_out",), {"train.held_out": "3"}),
    Case("params-held-out-duplicate", "params", REPORT, ("train.held_out",), {"train.held_out": [1, 1]}),
    Case("params-held-out-empty", "params", REPORT, ("train.held_out",), {"train.held_out": []}),
    Case("params-backbone-unknown", "params", REPORT, ("model.backbone", "vgg99"), {"model.backbone": "vgg99"}),
    Case(
        "params-pretrained-missing-file",
        "params",
        REPORT,
        ("model.pretrained",),
        {"model.pretrained": "weights/absent.pth"},
    ),
    Case("params-flower-mode", "params", REPORT, ("train.flower.mode",), {"train.flower.mode": "cloud"}),
    Case(
        "params-flower-min-clients-zero",
        "params",
        REPORT,
        ("train.flower.min_clients",),
        {"train.flower.min_clients": 0},
    ),
    Case(
        "params-flower-timeout-factor-below-1",
        "params",
        REPORT,
        ("train.flower.timeout_factor",),
        {"train.flower.timeout_factor": 0.5},
    ),
    Case(
        "params-flower-timeout-floor-zero",
        "params",
        REPORT,
        ("train.flower.timeout_floor_s",),
        {"train.flower.timeout_floor_s": 0},
    ),
    Case(
        "params-flower-query-timeout-negative",
        "params",
        REPORT,
        ("train.flower.query_timeout_s",),
        {"train.flower.query_timeout_s": -1},
    ),
    Case(
        "params-flower-superlink-in-simulation",
        "params",
        REPORT,
        ("train.flower.superlink",),
        {"train.flower.mode": "simulation", "train.flower.superlink": "10.0.0.1:9092"},
    ),
    Case(
        "params-flower-unknown-key",
        "params",
        REPORT,
        ("train.flower.min_client",),
        new_keys={"train.flower.min_client": 2},
    ),
    Case("params-fedccrl-r-zero", "params", REPORT, ("train.fedccrl.r",), {"train.fedccrl.r": 0}),
    Case("params-fedccrl-r-above-1", "params", REPORT, ("train.fedccrl.r",), {"train.fedccrl.r": 1.5}),
    Case("params-fedccrl-tau-zero", "params", REPORT, ("train.fedccrl.tau",), {"train.fedccrl.tau": 0}),
    Case("params-fedccrl-variant", "params", REPORT, ("train.fedccrl.variant",), {"train.fedccrl.variant": "code"}),
    Case("params-fedccrl-ccdt-word", "params", REPORT, ("train.fedccrl.ccdt",), {"train.fedccrl.ccdt": "on"}),
    Case("params-fedprox-mu-negative", "params", REPORT, ("train.fedprox.mu",), {"train.fedprox.mu": -0.1}),
    Case("params-evaluate-batch-zero", "params", REPORT, ("evaluate.batch_size",), {"evaluate.batch_size": 0}),
    Case("params-export-agreement-above-1", "params", REPORT, ("export.min_agreement",), {"export.min_agreement": 1.5}),
    Case("params-figures-seed-string", "params", REPORT, ("figures.seed",), {"figures.seed": "x"}),
    # ---- training: the train stage's own inputs (data, held-out entries, algorithm, outputs)
    Case(
        "train-shards-missing",
        "training",
        [
            "train",
            "--shards",
            "nowhere",
            "--pools",
            "{data}/pools",
            "--algorithm",
            "fedavg",
            "--seed",
            "0",
            "--out",
            "out/model",
            "--checkpoints",
            "out/ck",
        ],
        ("nowhere",),
    ),
    Case(
        "train-pools-missing",
        "training",
        [
            "train",
            "--shards",
            "{data}/shards",
            "--pools",
            "nowhere",
            "--algorithm",
            "fedavg",
            "--seed",
            "0",
            "--held-out",
            "0",
            "--out",
            "out/model",
            "--checkpoints",
            "out/ck",
        ],
        ("nowhere",),
    ),
    Case("train-algorithm-unknown", "training", train(algorithm="fedfoo"), ("--algorithm", "fedfoo")),
    Case("train-algorithm-case", "training", train(algorithm="FedAvg"), ("--algorithm", "FedAvg")),
    Case(
        "train-seed-word",
        "training",
        [
            "train",
            "--shards",
            "{data}/shards",
            "--pools",
            "{data}/pools",
            "--algorithm",
            "fedavg",
            "--seed",
            "zero",
            "--out",
            "out/model",
        ],
        ("--seed",),
    ),
    Case("train-held-out-index-too-big", "training", train(held_out="9"), ("9",)),
    Case("train-held-out-unknown-name", "training", train(held_out="moon"), ("moon",)),
    Case("train-held-out-negative", "training", train(held_out="-1"), ("-1",)),
    Case("train-held-out-repeated", "training", train("--held-out", "photo", held_out="0"), ("held",)),
    Case(
        "train-param-held-out-too-big", "training", train(held_out=None), ("train.held_out",), {"train.held_out": [7]}
    ),
    Case(
        "train-param-held-out-unknown",
        "training",
        train(held_out=None),
        ("train.held_out", "moon"),
        {"train.held_out": ["moon"]},
    ),
    Case("train-workers-zero", "training", train("--workers", "0"), ("--workers",)),
    Case("train-workers-word", "training", train("--workers", "many"), ("--workers",)),
    Case(
        "train-batch-one-batchnorm",
        "training",
        train(algorithm="fedbn"),
        ("batch_size",),
        {"train.fedbn.batch_size": 1},
    ),
    Case("train-ccst-without-weights", "training", train(algorithm="ccst"), ("train.ccst.adain_weights",)),
    Case("train-backbone-unknown", "training", train(), ("model.backbone",), {"model.backbone": "resnet999"}),
    Case(
        "train-manifest-broken",
        "training",
        [
            "train",
            "--shards",
            "shards",
            "--pools",
            "{data}/pools",
            "--algorithm",
            "fedavg",
            "--seed",
            "0",
            "--held-out",
            "0",
            "--out",
            "out/model",
            "--checkpoints",
            "out/ck",
        ],
        ("manifest.json",),
        setup=write("shards/manifest.json", "[]"),
    ),
    Case(
        "train-flower-min-clients-too-many",
        "training",
        train(),
        ("min_clients",),
        {"train.engine": "flower", "train.flower.min_clients": 9},
    ),
    Case("train-lr-negative", "training", train(), ("train.lr",), {"train.lr": -1.0}),
    Case("train-rounds-string", "training", train(), ("train.rounds",), {"train.rounds": "ten"}),
    Case(
        "train-fedccrl-lambda-negative",
        "training",
        train(algorithm="fedccrl"),
        ("train.fedccrl.lambda1",),
        {"train.fedccrl.lambda1": -0.1},
    ),
    Case(
        "train-fedsr-l2r-unknown", "training", train(algorithm="fedsr"), ("train.fedsr.l2r",), {"train.fedsr.l2r": "l3"}
    ),
    Case(
        "train-fedadg-label-value",
        "training",
        train(algorithm="fedadg"),
        ("train.fedadg.label_value",),
        {"train.fedadg.label_value": 2.0},
    ),
    Case(
        "train-fedalign-clusters-zero",
        "training",
        train(algorithm="fedalign"),
        ("train.fedalign.n_clusters",),
        {"train.fedalign.n_clusters": 0},
    ),
    Case("train-params-missing", "training", train("--params", "absent.yaml"), ("absent.yaml",)),
    Case(
        "train-pool-file-missing",
        "training",
        [
            "train",
            "--shards",
            "{data}/shards",
            "--pools",
            "pools",
            "--algorithm",
            "fedavg",
            "--seed",
            "0",
            "--held-out",
            "0",
            "--out",
            "out/model",
            "--checkpoints",
            "out/ck",
        ],
        ("art_c0",),
        setup=lambda ws: __import__("shutil").copytree(
            ws.parent / "data" / "pools", ws / "pools", ignore=lambda d, names: [n for n in names if "art_c0" in n]
        ),
    ),
    Case("eval-models-missing", "training", EVALUATE, ("models",)),
    Case("eval-models-empty", "training", EVALUATE, ("models",), setup=mkdirs("models")),
    Case(
        "eval-out-inside-models",
        "training",
        ["evaluate", "--shards", "{data}/shards", "--models", "models", "--out", "models/runs"],
        ("--models models", "--out models/runs"),
    ),
    # ---- export
    Case("export-models-missing", "export", EXPORT, ("models",)),
    Case("export-models-empty", "export", EXPORT, ("models",), setup=mkdirs("models")),
    Case("export-model-not-a-checkpoint", "export", EXPORT, ("model.pt",), setup=a_model_folder()),
    Case("export-model-empty-file", "export", EXPORT, ("model.pt",), setup=a_model_folder(b"")),
    Case(
        "export-single-model-missing",
        "export",
        ["export", "--model", "absent.pt", "--shards", "{data}/shards", "--out", "out/exports", "--no-mlflow"],
        ("absent.pt",),
    ),
    Case(
        "export-neither-model-nor-models",
        "export",
        ["export", "--shards", "{data}/shards", "--out", "out/exports", "--no-mlflow"],
        ("--model",),
    ),
    Case("export-agreement-above-1", "export", [*EXPORT, "--min-agreement", "1.5"], ("--min-agreement",)),
    Case("export-agreement-negative", "export", [*EXPORT, "--min-agreement", "-0.1"], ("--min-agreement",)),
    Case("export-batch-zero", "export", [*EXPORT, "--batch-size", "0"], ("--batch-size",)),
    Case("export-batch-word", "export", [*EXPORT, "--batch-size", "big"], ("--batch-size",)),
    Case(
        "export-model-and-models",
        "export",
        [
            "export",
            "--model",
            "m.pt",
            "--models",
            "models",
            "--shards",
            "{data}/shards",
            "--out",
            "out/exports",
            "--no-mlflow",
        ],
        ("--model",),
        setup=a_model_folder(),
    ),
    Case("export-params-batch-zero", "export", EXPORT, ("export.batch_size",), {"export.batch_size": 0}),
    Case(
        "export-params-unknown-key", "export", EXPORT, ("export.min_agrement",), new_keys={"export.min_agrement": 0.9}
    ),
    Case(
        "export-out-is-a-file",
        "export",
        ["export", "--models", "models", "--shards", "{data}/shards", "--out", "exports.txt", "--no-mlflow"],
        ("exports.txt",),
        setup=both(a_model_folder(), write("exports.txt", "x")),
    ),
    Case("report-runs-missing", "export", REPORT, ("runs",)),
    Case("report-runs-empty", "export", REPORT, ("runs",), setup=mkdirs("runs")),
    Case("figures-models-missing", "export", FIGURES, ("models/", "train stages")),
    Case(
        "figures-out-is-models",
        "export",
        [a if a != "out/plots" else "models" for a in FIGURES],
        ("--models models", "--out models"),
    ),
    Case(
        "figures-params-unknown-key", "export", FIGURES, ("figures.tsne_pionts",), new_keys={"figures.tsne_pionts": 9}
    ),
    # ---- serving
    Case("serve-model-missing", "serving", predict(model="absent.onnx"), ("absent.onnx",), setup=png("imgs/a/0.png")),
    Case(
        "serve-model-not-onnx",
        "serving",
        predict(),
        ("model.onnx",),
        setup=both(write("model.onnx", "not protobuf"), png("imgs/a/0.png")),
    ),
    Case(
        "serve-model-empty",
        "serving",
        predict(),
        ("model.onnx",),
        setup=both(write("model.onnx", b""), png("imgs/a/0.png")),
    ),
    Case(
        "serve-model-is-a-folder",
        "serving",
        predict(),
        ("model.onnx",),
        setup=both(mkdirs("model.onnx"), png("imgs/a/0.png")),
    ),
    Case(
        "serve-too-many-class-names",
        "serving",
        predict(),
        ("model.onnx", "class"),
        setup=both(onnx_model(classes=("a", "b", "c", "d", "e"), logits=4), png("imgs/a/0.png")),
    ),
    Case(
        "serve-duplicate-class-names",
        "serving",
        predict(),
        ("model.onnx", "unique"),
        setup=both(onnx_model(classes=("a", "b", "a", "d")), png("imgs/a/0.png")),
    ),
    Case(
        "serve-nan-mean",
        "serving",
        predict(),
        ("model.onnx", "mean"),
        setup=both(onnx_model(mean="[NaN, 0.5, 0.5]"), png("imgs/a/0.png")),
    ),
    Case(
        "serve-zero-std",
        "serving",
        predict(),
        ("model.onnx", "std"),
        setup=both(onnx_model(std="[0.25, 0.0, 0.25]"), png("imgs/a/0.png")),
    ),
    Case(
        "serve-image-size-disagrees",
        "serving",
        predict(),
        ("model.onnx", "image_size"),
        setup=both(onnx_model(size=4, graph_size=6), png("imgs/a/0.png")),
    ),
    Case(
        "serve-no-fedccrl-metadata",
        "serving",
        predict(),
        ("model.onnx",),
        setup=both(onnx_model(fedccrl_format=""), png("imgs/a/0.png")),
    ),
    Case("serve-inputs-missing", "serving", predict(inputs="absent"), ("absent",), setup=onnx_model()),
    Case("serve-inputs-empty-folder", "serving", predict(), ("imgs",), setup=both(onnx_model(), mkdirs("imgs"))),
    Case("serve-top-k-zero", "serving", predict("--top-k", "0"), ("--top-k",), setup=SERVE_OK),
    Case("serve-top-k-word", "serving", predict("--top-k", "all"), ("--top-k",), setup=SERVE_OK),
    Case("serve-format-xml", "serving", predict("--format", "xml"), ("--format",), setup=SERVE_OK),
    Case(
        "serve-output-in-a-file",
        "serving",
        ["serve", "predict", "model.onnx", "imgs", "--output", "file.txt/preds.jsonl"],
        ("file.txt",),
        setup=both(SERVE_OK, write("file.txt", "x")),
    ),
    Case(
        "serve-output-is-a-folder",
        "serving",
        ["serve", "predict", "model.onnx", "imgs", "--output", "outdir"],
        ("outdir",),
        setup=both(SERVE_OK, mkdirs("outdir")),
    ),
    Case("serve-eval-folder-missing", "serving", evaluate_served(folder="absent"), ("absent",), setup=onnx_model()),
    Case(
        "serve-eval-no-class-folders",
        "serving",
        evaluate_served(),
        ("imgs",),
        setup=both(onnx_model(), png("imgs/0.png")),
    ),
    Case(
        "serve-eval-model-missing",
        "serving",
        evaluate_served(model="absent.onnx"),
        ("absent.onnx",),
        setup=png("imgs/a/0.png"),
    ),
    Case("serve-info-model-missing", "serving", ["serve", "info", "absent.onnx"], ("absent.onnx",)),
    Case(
        "serve-info-model-not-onnx",
        "serving",
        ["serve", "info", "model.onnx"],
        ("model.onnx",),
        setup=write("model.onnx", "{}"),
    ),
]


# ------------------------------------------------------------------ the one check every case gets
def _run(case: Case, ws: Path, data: Path, monkeypatch):
    from click.testing import CliRunner

    monkeypatch.chdir(ws)
    args = [a.replace("{data}", str(data)) for a in case.args]
    if args[0] == "serve":
        from fedccrl_serving.cli import main

        args = args[1:]
    else:
        from fedccrl_pipeline.cli import main
    return CliRunner().invoke(main, args)


def _mlflow_runs(store: Path) -> list[str]:
    if not store.exists():
        return []
    import sqlite3

    with sqlite3.connect(store) as con:
        try:
            return [s for (s,) in con.execute("select status from runs")]
        except sqlite3.OperationalError:  # no tables yet
            return []


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, params, tiny, tmp_path, monkeypatch):
    ws = tmp_path / "ws"
    ws.mkdir()
    if case.setup is not None:
        (tmp_path / "data").symlink_to(tiny / "data")  # shards_copy reads <ws>/../data
        case.setup(ws)
    if not (ws / "params.yaml").exists():
        params({**ONE_ROUND, **case.params}, to=ws, new_keys=case.new_keys)
    res = _run(case, ws, tiny / "data", monkeypatch)
    out = res.output
    assert res.exit_code == case.code, out[-3000:]  # 1. the exit code
    for needle in case.needles:  # 2. names the file or key
        assert needle in out, (needle, out[-3000:])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)  # 3. no traceback
    assert "Traceback" not in out, out[-3000:]
    assert not (ws / "out").exists(), sorted(str(p) for p in (ws / "out").rglob("*"))  # 4. no partial output
    bad = [s for s in _mlflow_runs(tmp_path / "mlflow.db") if s in ("FAILED", "RUNNING")]  # 5. no failed run
    assert not bad, bad


def test_the_suite_covers_every_area():
    """At least 120 cases, every area with a share, and no id twice."""
    per_area = {a: sum(c.area == a for c in CASES) for a in AREAS}
    assert len(CASES) >= 120 and all(n >= 10 for n in per_area.values()), per_area
    assert len({c.id for c in CASES}) == len(CASES)
    assert {c.area for c in CASES} == set(AREAS)
