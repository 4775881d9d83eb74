"""A model card: the Markdown text of the card file beside an export's model.onnx (serving/fedccrl_serving/metadata.py
`card_path`), and the description of its registered MLflow model version (model_registry.py). `render` is a pure
function of the run's typed records (`CardRecords`, gathered by pipeline/fedccrl_pipeline/card_records.py): it reads
no file and imports no torch, so a test builds the records and reads every number back.

Accuracies carry a 95 % Wilson score interval computed from their counts (`wilson_interval`). The privacy facts are
quoted from docs/privacy.md (`QUOTES`; tests/test_model_card.py checks each is still in the doc, word for word)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedccrl_core.data.manifest import ShardManifest
    from fedccrl_core.federation.history import RunHistory
    from fedccrl_core.learning.model_meta import ModelMeta
    from fedccrl_core.outcomes.evaluated import EvaluatedRun, Scored
    from fedccrl_flower.sites import FederationFile

PRIVACY_DOC = "docs/privacy.md"
Z95 = NormalDist().inv_cdf(0.975)  # the two-sided 95 % normal quantile, 1.95996...

# docs/privacy.md's one-line facts, word for word (its **bold** dropped)
QUOTES = {
    "unit": "the run's ε is image-level, not client-level",
    "not_covered": "It does not cover the validation images (the clients' val splits, which the server evaluates each "
    "round to pick the best round) nor the held-out target domain",
    "server": "The guarantee on this channel therefore holds against everyone who sees the global models (the "
    "clients, MLflow, the exports), not against the server, which must be trusted with the weights.",
    "sweep": "One run's ε bounds what that run's releases reveal about one training image. It is not what a sweep "
    "reveals",
    "seeded": "anyone with the params file removes the noise, so no ε applies",
    "rows": "one row of channel statistics per sampled image: F_i (Eq. 8), each row the image's exact (μ, σ) over its "
    "3 channels (Eq. 6-7), 6 numbers",
    "labels": "a site's label distribution is visible to the server, which it is not from n_i alone",
}


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a proportion correct/n (Wilson 1927, J. Am. Stat. Assoc. 22, eq. for the limits of
    p): (p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)."""
    if n <= 0 or not 0 <= correct <= n:
        raise ValueError(f"wilson_interval: {correct} correct of {n}")
    p = correct / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def correct_of(accuracy: float, n: int) -> int | None:
    """The count behind an accuracy measured on n images: accuracy x n, rounded (a float32 mean is off by far less
    than WHOLE); None when it is no whole count (records that disagree)."""
    k = accuracy * n
    return round(k) if abs(k - round(k)) <= WHOLE else None


WHOLE = 0.01  # how far accuracy x n may lie from a whole count


@dataclass(frozen=True)
class SweepEpsilon:
    """The sweep's ε per image (the MLflow parent's dp_epsilon_sweep_per_image), or why it is not known here."""

    value: float | None
    runs: int | None = None  # how many finished runs it composes
    why_not: str = ""


@dataclass(frozen=True)
class CardRecords:
    """What a card is made from: the exported model's meta, the run's history, the export's parity figures
    (parity.json, with "int8" when the copy was written), the evaluate stage's result (None: `evaluated_note` says
    why), the training data (the research pipeline's shard manifest, or a deployment's federation file) and the
    dataset's hash, and the sweep's ε per image."""

    meta: ModelMeta
    history: RunHistory
    parity: dict
    evaluated: EvaluatedRun | None
    evaluated_note: str  # where the result was read, or why there is none
    manifest: ShardManifest | None
    federation: FederationFile | None
    dataset_hash: tuple[str, str]  # (what was hashed, sha256)
    sweep: SweepEpsilon


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return [*out, ""]


def _acc_row(what: str, accuracy: float, n: int) -> tuple:
    k = correct_of(accuracy, n)
    if k is None:
        return (what, _pct(accuracy), f"not a whole count ({accuracy:g} x {n})", n, "not computed")
    lo, hi = wilson_interval(k, n)
    return (what, _pct(accuracy), k, n, f"{_pct(lo)} – {_pct(hi)}")


ACC_HEADER = ("measure", "accuracy", "correct", "images", "95 % interval (Wilson)")


def _model(r: CardRecords) -> list[str]:
    m = r.meta
    rows = [
        ("algorithm", m.algorithm),
        ("backbone", m.backbone),
        ("image size", m.image_size),
        ("resize", m.resize),
        ("normalization mean", json.dumps(m.mean)),
        ("normalization std", json.dumps(m.std)),
        ("classes", f"{m.num_classes}: {', '.join(m.classes)}"),
        ("seed", m.seed),
        ("rounds", len(r.history.rounds)),
        ("weights of round", m.round),
    ]
    out = ["## Model", "", *_table(("field", "value"), rows)]
    hp = sorted((m.hparams or {}).items())
    out += [f"### Settings (train.{m.algorithm})", ""]
    out += _table(("setting", "value"), [(k, json.dumps(v)) for k, v in hp]) if hp else ["none recorded", ""]
    return out


def _research_data(r: CardRecords, manifest: ShardManifest) -> list[str]:
    held = r.meta.held_out_domain
    sources = [c for c in manifest.clients if c.domain != held]
    mixed = any(c.train_domain_counts is not None for c in sources)
    out = [
        f"The shards of `{manifest.dataset}` (partition seed {manifest.seed}); the clients of the training domains:",
        "",
    ]
    out += _table(
        ("client", "domain", "training images", "validation images"),
        [(c.id, c.domain, c.n_train, c.n_val) for c in sources],
    )
    if mixed:
        out += ["Mixed clients hold rows of several domains: no per-class count of the training domains alone.", ""]
        return out
    per_class = [sum(c.train_class_hist[i] for c in sources) for i in range(manifest.num_classes)]
    out += ["Training images per class:", ""]
    return out + _table(("class", "training images"), list(zip(manifest.classes, per_class)))


def _deployment_data(r: CardRecords, fed: FederationFile) -> list[str]:
    held = r.meta.held_out_domain or ""
    last = r.history.rounds[-1]
    out = [f"A Flower deployment of `{fed.dataset}`: each site keeps its images.", ""]
    roles = [(s.id, s.domain, "evaluation (held-out)" if s.domain == held else "training") for s in fed.sites]
    out += _table(("site", "domain", "role"), roles)
    out += _table(
        ("count (last round's record)", "images"),
        [
            ("val_n: the training sites' validation images", last.val_n),
            ("target_n: the held-out images", last.target_n),
        ],
    )
    out += [
        "The run's records give the sites' counts above and nothing more: the images per site and per class stay "
        "with the sites, and this card does not know them.",
        "",
    ]
    return out


def _data(r: CardRecords) -> list[str]:
    held = r.meta.held_out_domain
    training = [d for d in (r.meta.domains or []) if d != held]
    out = ["## Training data", "", f"Training domains: {', '.join(training) or 'not recorded'}.", ""]
    if r.federation is not None:
        return out + _deployment_data(r, r.federation)
    assert r.manifest is not None  # card_records gives one of the two
    return out + _research_data(r, r.manifest)


def _per_class(scored: Scored) -> list[str]:
    assert scored.per_class_acc is not None
    cm = scored.confusion
    rows = []
    for i, (name, acc) in enumerate(scored.per_class_acc.items()):
        counts = (cm[i][i], sum(cm[i])) if cm is not None else ("", "")
        rows.append((name, _pct(acc), *counts))
    return _table(("class", "accuracy", "correct", "images"), rows)


def _accuracy(r: CardRecords) -> list[str]:
    p, ev = r.parity, r.evaluated
    out = ["## Held-out accuracy", "", f"Held-out domain: {r.meta.held_out_domain} (no client trained on it).", ""]
    rows = []
    if ev is not None and ev.n_test:
        who = ev.evaluated_on or "the evaluate stage"
        rows.append((f"final round, measured by {who}", ev.final_target_acc, ev.n_test))
        out += [f"From the evaluate stage's result {r.evaluated_note}.", ""]
    elif ev is not None:
        out += [
            f"The evaluate stage's result {r.evaluated_note} gives the final round's accuracy "
            f"{_pct(ev.final_target_acc)} without its image count (no interval); the rows below are the export's.",
            "",
        ]
    else:
        out += [f"No evaluate stage result ({r.evaluated_note}): the accuracy is the export's parity check only.", ""]
    rows.append(("export parity check: ONNX float32", p["onnx_accuracy"], p["n_images"]))
    if "int8" in p:
        rows.append(("export parity check: INT8 copy", p["int8"]["int8_accuracy"], p["int8"]["n_images"]))
    out += _table(ACC_HEADER, [_acc_row(*row) for row in rows])
    sizes = [("model.onnx (float32)", p["onnx_bytes"])]
    if "int8" in p:
        sizes.append((f"{p['int8']['file']} (INT8)", p["int8"]["bytes"]))
    out += _table(("file", "bytes"), sizes)
    detail = ev.detail.final if ev is not None else None
    if detail is not None and detail.per_class_acc is not None:
        on = f" on {ev.detail_on} ({ev.detail_n_test} images)" if ev is not None and ev.detail_on else ""
        out += [f"### Per class (final round{on})", "", *_per_class(detail)]
    return out


def _privacy(r: CardRecords) -> list[str]:
    dp, mark = r.history.dp, r.meta.privacy or (r.history.dp.mark if r.history.dp else None)
    eps = next((x.dp_epsilon for x in reversed(r.history.rounds) if x.dp_epsilon is not None), None)
    out = ["## Differential privacy", ""]
    if mark is not None:
        return [*out, f'Not private: {mark}. docs/privacy.md: "{QUOTES["seeded"]}".', ""]
    if dp is None:
        return [
            *out,
            "Not private: the run trained without train.privacy; its uploads were neither clipped nor noised. "
            f'What FedCCRL uploads besides its weights (docs/privacy.md): "{QUOTES["rows"]}".',
            "",
        ]
    sweep = r.sweep
    sweep_text = (
        f"{sweep.value:.4g} over {sweep.runs} runs" if sweep.value is not None else f"not recorded ({sweep.why_not})"
    )
    rows = [
        ("epsilon per run", f"{eps:.4g}" if eps is not None else "not recorded"),
        ("delta", f"{dp.delta:g}"),
        ("epsilon per image over the sweep", sweep_text),
        ("noise", dp.noise),
    ]
    out += _table(("field", "value"), rows)
    out += [f'- docs/privacy.md: "{QUOTES[k]}".' for k in ("unit", "sweep", "not_covered", "server")]
    return [*out, ""]


def _provenance(r: CardRecords) -> list[str]:
    m = r.meta
    what, sha = r.dataset_hash
    rows = [
        ("git commit", m.git_commit),
        ("params hash (run key)", m.params_hash),
        (f"dataset: sha256 of {what}", sha),
        ("platform", m.platform),
        ("MLflow run", m.mlflow_run_id),
    ]
    return [
        "## Provenance",
        "",
        *_table(("field", "value"), [(k, v if v is not None else "not recorded") for k, v in rows]),
    ]


def _limits(r: CardRecords) -> list[str]:
    m = r.meta
    out = [
        "## Intended use and limits",
        "",
        f"- Image classification into the {m.num_classes} classes above; the model always answers one of them, "
        "never 'none of these'.",
        f"- Measured on one held-out domain ({m.held_out_domain}) of {m.dataset}. On another domain (another style, "
        "camera or class mix) the accuracy is not measured here and can be much lower: measure it on labelled images "
        "of that domain with `fedccrl-serve evaluate model.onnx <folder>`.",
        "- The interval covers the sampling of the held-out images only, not the training's randomness (seed).",
        "- Feed images through `fedccrl-serve` or the MLflow pyfunc, which apply the preprocessing above from the "
        "file's metadata; the bare ONNX graph expects normalized tensors.",
    ]
    if r.federation is not None:
        out.append(f'- The sites\' evaluation counts (docs/privacy.md): "{QUOTES["labels"]}".')
    out += [f"- What the uploads reveal and what ε covers: {PRIVACY_DOC}.", ""]
    return out


def render(r: CardRecords) -> str:
    """The card's Markdown text."""
    m = r.meta
    head = [
        f"# Model card: {m.algorithm} on {m.dataset}, held-out {m.held_out_domain}, seed {m.seed}",
        "",
        "Generated by `fedccrl export` from the run's records (model meta, history.json, the evaluate stage's "
        "result, parity.json, the training data's manifest); re-export to change it.",
        "",
    ]
    parts = [head, _model(r), _data(r), _accuracy(r), _privacy(r), _provenance(r), _limits(r)]
    return "\n".join(line for part in parts for line in part).rstrip("\n") + "\n"
