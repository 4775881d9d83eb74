"""An evaluation-only federated run's result (`fedccrl evaluate-sites`): each site's counts of a trained model on its
own images, scored per site, per domain and pooled, typed where it is made (`score_sites`), written by `write_scores`
and read back by `load_scores`, the one writer and the one reader; `markdown` renders it.

A site returns counts only (fedccrl_flower/evalsets.py SiteCounts): per class k, its images of class k, how many of
them the model gets right, and how many images it predicts as k (the confusion matrix's diagonal and margins). From
them: n, accuracy = correct / n with its 95 % Wilson score interval (`wilson`), per-class accuracy, and the pooled
confusion counts (per class, summed over the sites).


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import json
from pathlib import Path

from fedccrl_core.foundation.errors import DataError
from fedccrl_core.foundation.fsio import write_text
from fedccrl_core.foundation.records import Record, parse_record
from fedccrl_core.outcomes.intervals import wilson_interval


def wilson(correct: int, n: int) -> list[float] | None:
    """The 95 % Wilson score interval of correct / n (intervals.py), None for n = 0 (no images: no accuracy)."""
    return None if n == 0 else list(wilson_interval(correct, n))


class ClassScore(Record):
    """One class: its images, how many the model got right, how many images it predicted as this class."""

    name: str
    n: int
    correct: int
    predicted: int
    accuracy: float | None  # None: no image of the class


class Score(Record):
    """A set of images (a site's, a domain's, or all of them): n, accuracy and its 95 % Wilson interval, per class."""

    n: int
    correct: int
    accuracy: float | None
    ci95: list[float] | None  # [low, high]
    per_class: list[ClassScore]


class SiteScore(Record):
    client: str
    domain: str
    split: str  # "val" (the site trained the model) or "all" (train + val)
    score: Score


class DomainScore(Record):
    domain: str
    sites: list[str]
    score: Score


class SiteProblem(Record):
    """A site refused (its data does not fit the model: classes, image size) or dropped (it did not answer)."""

    client: str
    reason: str


class SitesEvaluated(Record):
    """The evaluation-only run of one model over the sites of a federation file."""

    model: str  # the model file evaluated
    run_key: str | None  # the model's run key (its meta's params_hash)
    mlflow_run_id: str | None  # the model's MLflow run
    algorithm: str | None
    held_out_domain: str | None
    classes: list[str]
    split: str  # what was asked: auto | all | val
    sites: list[SiteScore]
    domains: list[DomainScore]
    pooled: Score
    refused: list[SiteProblem]
    dropped: list[SiteProblem]


def score(labels: list[int], correct: list[int], predicted: list[int], classes: list[str]) -> Score:
    """Per-class counts (one entry per class, in label order) -> a Score."""
    n, right = sum(labels), sum(correct)
    per_class = [
        ClassScore(name=c, n=k, correct=r, predicted=p, accuracy=r / k if k else None)
        for c, k, r, p in zip(classes, labels, correct, predicted, strict=True)
    ]
    return Score(n=n, correct=right, accuracy=right / n if n else None, ci95=wilson(right, n), per_class=per_class)


def pooled(scores: list[Score], classes: list[str]) -> Score:
    """The sum of several Scores' per-class counts, scored."""
    k = range(len(classes))
    return score(
        [sum(s.per_class[j].n for s in scores) for j in k],
        [sum(s.per_class[j].correct for s in scores) for j in k],
        [sum(s.per_class[j].predicted for s in scores) for j in k],
        classes,
    )


def by_domain(sites: list[SiteScore], classes: list[str]) -> list[DomainScore]:
    """Each domain's sites pooled, domains in name order."""
    out = []
    for domain in sorted({s.domain for s in sites}):
        mine = [s for s in sites if s.domain == domain]
        out.append(
            DomainScore(domain=domain, sites=[s.client for s in mine], score=pooled([s.score for s in mine], classes))
        )
    return out


def write_scores(result: SitesEvaluated, path: str | Path) -> Path:
    return write_text(path, json.dumps(result.model_dump(mode="json"), indent=1) + "\n")


def load_scores(path: str | Path) -> SitesEvaluated:
    """A SitesEvaluated file; DataError naming the file (and the key) when it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable evaluate-sites result ({e.__class__.__name__}: {e})") from None
    return parse_record(SitesEvaluated, data, str(path))


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def _row(name: str, extra: str, s: Score) -> str:
    ci = "-" if s.ci95 is None else f"[{_pct(s.ci95[0])}, {_pct(s.ci95[1])}]"
    per = " ".join(f"{_pct(c.accuracy)}" for c in s.per_class)
    return f"| {name} | {extra} | {s.n} | {_pct(s.accuracy)} | {ci} | {per} |"


def markdown(r: SitesEvaluated) -> str:
    """The result as Markdown: one table per site and per domain (accuracy %, its 95 % Wilson interval, per-class
    accuracy in class order), the pooled confusion counts, and the sites refused or dropped."""
    head = "| {} | {} | n | accuracy % | 95 % CI (Wilson) | per-class accuracy % ({}) |"
    rule = "|---|---|---|---|---|---|"
    lines = [f"# Evaluation of {r.model} at the sites", ""]
    lines += [
        f"run key {r.run_key or '-'}, algorithm {r.algorithm or '-'}, held-out {r.held_out_domain or '-'}, "
        f"split {r.split}",
        "",
    ]
    lines += [head.format("site", "domain (split)", ", ".join(r.classes)), rule]
    lines += [_row(s.client, f"{s.domain} ({s.split})", s.score) for s in r.sites]
    lines += ["", head.format("domain", "sites", ", ".join(r.classes)), rule]
    lines += [_row(d.domain, ", ".join(d.sites), d.score) for d in r.domains]
    lines += [_row("all", f"{len(r.sites)} site(s)", r.pooled), ""]
    lines += [
        "Pooled confusion counts (all sites):",
        "",
        "| class | images | correct | predicted as |",
        "|---|---|---|---|",
    ]
    lines += [f"| {c.name} | {c.n} | {c.correct} | {c.predicted} |" for c in r.pooled.per_class]
    for what, rows in (("Refused", r.refused), ("Dropped", r.dropped)):
        if rows:
            lines += ["", f"{what}:", ""] + [f"- {p.client}: {p.reason}" for p in rows]
    return "\n".join(lines) + "\n"
