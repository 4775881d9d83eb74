"""A model card: the Markdown text of the card file beside an export's model.onnx (serving/fedccrl_serving/metadata.py
`card_path`), and the description of its registered MLflow model version (model_registry.py). `render` is a pure
function of the run's typed records (`CardRecords`, gathered by pipeline/fedccrl_pipeline/card_records.py): it reads
no file and imports no torch, so a test builds the records and reads every number back.

Accuracies carry a 95 % Wilson score interval computed from their counts (card_tables.py `wilson_interval`). The
privacy facts are quoted from docs/privacy.md (card_privacy.py `QUOTES`; tests/test_model_card.py checks each is
still in the doc, word for word)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from fedccrl_pipeline.card_privacy import PRIVACY_DOC, QUOTES, privacy_section
from fedccrl_pipeline.card_tables import ACC_HEADER, acc_row, count_row, pct, table

if TYPE_CHECKING:
    from fedccrl_core.data.manifest import ShardManifest
    from fedccrl_core.outcomes.evaluated import Scored
    from fedccrl_flower.sites import FederationFile
    from fedccrl_pipeline.card_records import CardRecords


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
    out = ["## Model", "", *table(("field", "value"), rows)]
    hp = sorted((m.hparams or {}).items())
    out += [f"### Settings (train.{m.algorithm})", ""]
    out += table(("setting", "value"), [(k, json.dumps(v)) for k, v in hp]) if hp else ["none recorded", ""]
    return out


def _research_data(r: CardRecords, manifest: ShardManifest) -> list[str]:
    held = r.meta.held_out_domain
    sources = [c for c in manifest.clients if c.domain != held]
    mixed = any(c.train_domain_counts is not None for c in sources)
    out = [
        f"The shards of `{manifest.dataset}` (partition seed {manifest.seed}); the clients of the training domains:",
        "",
    ]
    out += table(
        ("client", "domain", "training images", "validation images"),
        [(c.id, c.domain, c.n_train, c.n_val) for c in sources],
    )
    if mixed:
        out += ["Mixed clients hold rows of several domains: no per-class count of the training domains alone.", ""]
        return out
    per_class = [sum(c.train_class_hist[i] for c in sources) for i in range(manifest.num_classes)]
    out += ["Training images per class:", ""]
    return out + table(("class", "training images"), list(zip(manifest.classes, per_class)))


def _deployment_data(r: CardRecords, fed: FederationFile) -> list[str]:
    held = r.meta.held_out_domain or ""
    last = r.history.rounds[-1]
    out = [f"A Flower deployment of `{fed.dataset}`: each site keeps its images.", ""]
    roles = [(s.id, s.domain, "evaluation (held-out)" if s.domain == held else "training") for s in fed.sites]
    out += table(("site", "domain", "role"), roles)
    out += table(
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
        rows.append((name, pct(acc), *counts))
    return table(("class", "accuracy", "correct", "images"), rows)


def _accuracy(r: CardRecords) -> list[str]:
    p, ev = r.parity, r.evaluated
    out = ["## Held-out accuracy", "", f"Held-out domain: {r.meta.held_out_domain} (no client trained on it).", ""]
    if r.history.private:
        out += [
            "Trained under train.privacy: every count below over the study's images (its shards, its sites) is over "
            "the held-out domain's val rows only, images no run of the study trains on; a deployment's own test "
            'folder, no site\'s images, is counted whole (docs/privacy.md, "What a site returns for evaluation").',
            "",
        ]
    rows = []
    if ev is not None and ev.n_test:
        who = ev.evaluated_on or "the evaluate stage"
        rows.append((f"final round, measured by {who}", ev.final_target_acc, ev.n_test))
        out += [f"From the evaluate stage's result {r.evaluated_note}.", ""]
    elif ev is not None:
        out += [
            f"The evaluate stage's result {r.evaluated_note} gives the final round's accuracy "
            f"{pct(ev.final_target_acc)} without its image count (no interval); the rows below are the export's.",
            "",
        ]
    else:
        out += [f"No evaluate stage result ({r.evaluated_note}): the accuracy is the export's parity check only.", ""]
    if p.onnx_accuracy is not None:  # parity on the held-out images; on generated ones it measures agreement only
        rows.append(("export parity check: ONNX float32", p.onnx_accuracy, p.n_images))
    else:
        out += [f"The export's parity check ran on {p.n_images} generated images (no test folder): no accuracy.", ""]
    if p.int8 is not None:
        rows.append(("export parity check: INT8 copy", p.int8.int8_accuracy, p.int8.n_images))
    out += table(ACC_HEADER, [acc_row(*row) for row in rows])
    sizes = [("model.onnx (float32)", p.onnx_bytes)]
    if p.int8 is not None:
        sizes.append((f"{p.int8.file} (INT8)", p.int8.bytes))
    out += table(("file", "bytes"), sizes)
    detail = ev.detail.final if ev is not None else None
    if detail is not None and detail.per_class_acc is not None:
        on = f" on {ev.detail_on} ({ev.detail_n_test} images)" if ev is not None and ev.detail_on else ""
        out += [f"### Per class (final round{on})", "", *_per_class(detail)]
    return out


def _sites(r: CardRecords) -> list[str]:
    """The sites' evaluation of this model (`fedccrl evaluate-sites`), when one ran: per site, per domain, pooled."""
    ev = r.sites
    if ev is None:
        return []
    out = [
        "## The sites' evaluation",
        "",
        f"`fedccrl evaluate-sites` (split {ev.split}: a site that trained the model counts its val split, any other "
        "site its whole folder), from each site's counts.",
        "",
    ]
    rows = [count_row(f"site {s.client} ({s.domain}, {s.split})", s.score.correct, s.score.n) for s in ev.sites]
    rows += [count_row(f"domain {d.domain}", d.score.correct, d.score.n) for d in ev.domains]
    rows.append(count_row("all sites pooled", ev.pooled.correct, ev.pooled.n))
    out += table(ACC_HEADER, rows)
    missing = [f"{p.client} refused: {p.reason}" for p in ev.refused] + [
        f"{p.client} dropped: {p.reason}" for p in ev.dropped
    ]
    return out + ([f"Not evaluated: {'; '.join(missing)}.", ""] if missing else [])


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
        *table(("field", "value"), [(k, v if v is not None else "not recorded") for k, v in rows]),
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
        out.append(f'- The sites\' evaluation counts (docs/privacy.md): "{QUOTES.labels}".')
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
    parts = [head, _model(r), _data(r), _accuracy(r), _sites(r), privacy_section(r), _provenance(r), _limits(r)]
    return "\n".join(line for part in parts for line in part).rstrip("\n") + "\n"
