"""Evaluated runs as results: the leave-one-domain-out table (FedCCRL Table 1 form, mean ± std across seeds; the
report stage) and the per-round series the figures draw. The runs are re-evaluated by fedccrl_core/outcomes/runs.py; the
layout and field names are fedccrl_core/foundation/contract.py's. Plain data only: no torch, no model code.


Floor 3 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fedccrl_core.foundation import contract
from fedccrl_core.outcomes.evaluated import EvaluatedRun, load_result

if TYPE_CHECKING:
    from fedccrl_core.federation.history import RunHistory

# FedCCRL's Table 1 row order, then the other seed papers' methods (FedFD-A's Table 1 frameworks, FedAlign)
PAPER_ORDER = (
    "fedavg",
    "fedprox",
    "fedadg",
    "ga",
    "fedsr",
    "fediir",
    "ccst",
    "fedccrl",
    "fedbn",
    "silobn",
    "fedfd",
    "fedfd_a",
    "fedalign",
)
SELECTIONS = (
    (contract.FINAL_TARGET_ACC, "final round"),
    (contract.BEST_VAL_TARGET_ACC, "round selected by source validation"),
)


# ---- the report stage: the table over evaluated runs ----------------------------------------------
def load_results(runs_dir: Path) -> list[EvaluatedRun]:
    """Every evaluated run under runs_dir, in table order (paper order, then algorithm, then seed); DataError
    naming the file and the key of one that is not an evaluated run."""
    files = sorted(Path(runs_dir).rglob(f"*{contract.RESULT_SUFFIX}"))
    if not files:
        raise FileNotFoundError(f"{runs_dir}: no evaluation results (run the evaluate stage first)")
    runs = [load_result(f) for f in files]
    runs.sort(
        key=lambda r: (
            PAPER_ORDER.index(r.algorithm) if r.algorithm in PAPER_ORDER else 99,
            r.algorithm,
            r.seed,
        )
    )
    return runs


def held_out_domains(runs: list[EvaluatedRun]) -> list[str]:
    return [d for _, d in sorted({(r.held_out_index or 0, r.held_out_domain) for r in runs})]


@dataclass(frozen=True)
class MeanStd:
    """One selection's target accuracy over seeds: mean, population std (0 for one seed) and number of seeds."""

    mean: float
    std: float
    n: int

    @classmethod
    def of(cls, vals: list[float]) -> MeanStd:
        return cls(statistics.fmean(vals), statistics.pstdev(vals) if len(vals) > 1 else 0.0, len(vals))

    def cell(self) -> str:
        """In percent, with ± std when there are several seeds."""
        return f"{100 * self.mean:.2f} ± {100 * self.std:.2f}" if self.n > 1 else f"{100 * self.mean:.2f}"


@dataclass(frozen=True)
class DomainResult:
    """One algorithm on one held-out domain: each selection's (SELECTIONS) accuracy over the seeds."""

    accuracy: dict[str, MeanStd]  # selection key (contract.FINAL_TARGET_ACC, ...) -> over seeds
    seeds: list[int]


@dataclass(frozen=True)
class AlgorithmResult:
    """One algorithm's row of the table: per held-out domain, the communication per round (MB, all clients), and
    each selection's average over the domains (None unless every domain has runs)."""

    domains: dict[str, DomainResult]
    comm_mb_up: float
    comm_mb_down: float
    avg: dict[str, float] | None

    def to_dict(self) -> dict:
        """results/metrics.json's entry: {domain: {selection: {mean, std, n}, seeds}, comm_mb_per_round: {up,
        down}, avg: {selection: mean}}."""
        out: dict = {
            d: {**{k: asdict(v) for k, v in r.accuracy.items()}, "seeds": r.seeds} for d, r in self.domains.items()
        }
        out.update(comm_mb_per_round={"up": self.comm_mb_up, "down": self.comm_mb_down})
        return out if self.avg is None else {**out, "avg": self.avg}


def summarize(runs: list[EvaluatedRun]) -> dict[str, AlgorithmResult]:
    """Per algorithm and held-out domain: mean and std over seeds of each selection's target accuracy; the
    communication per round; and the average over the domains when every domain has runs."""
    domains = held_out_domains(runs)
    by: dict[str, dict[str, list[EvaluatedRun]]] = {}
    for r in runs:
        by.setdefault(r.algorithm, {}).setdefault(r.held_out_domain, []).append(r)
    metrics: dict[str, AlgorithmResult] = {}
    for alg, per_dom in by.items():
        cells = {
            dom: DomainResult(
                {key: MeanStd.of([getattr(x, key) for x in rs]) for key, _ in SELECTIONS}, sorted(x.seed for x in rs)
            )
            for dom, rs in per_dom.items()
        }
        every = [x for rs in per_dom.values() for x in rs]
        avg = None
        if len(per_dom) == len(domains):
            avg = {key: statistics.fmean(cells[d].accuracy[key].mean for d in domains) for key, _ in SELECTIONS}
        metrics[alg] = AlgorithmResult(
            cells,
            statistics.fmean(x.bytes_up_per_round for x in every) / 1e6,
            statistics.fmean(x.bytes_down_per_round for x in every) / 1e6,
            avg,
        )
    return metrics


def table_markdown(runs: list[EvaluatedRun], metrics: dict[str, AlgorithmResult]) -> list[str]:
    """The paper-style tables (one column per held-out domain, Avg.) and the communication per round."""
    domains = held_out_domains(runs)

    def cell(alg, dom, key):
        return metrics[alg].domains[dom].accuracy[key].cell() if dom in metrics[alg].domains else "–"

    lines = []
    for p in sorted({json.dumps(r.partition, sort_keys=True) for r in runs}):
        # the partition the runs were trained on (one line; several if runs were mixed)
        lines += [
            "Partition: "
            + (", ".join(f"{k.removeprefix('partition.')}={v}" for k, v in json.loads(p).items()) or "not recorded"),
            "",
        ]
    for platform in sorted({r.platform or "not recorded" for r in runs}):
        # the kernels that made the numbers (fedccrl_core/foundation/numerics.py): they differ in the last digits by CPU
        lines += [f"Platform: {platform}", ""]
    for key, title in SELECTIONS:
        lines += [
            f"### {runs[0].dataset}: target accuracy (%), {title}",
            "",
            "| Algorithm | " + " | ".join(domains) + " | Avg. |",
            "|---" * (len(domains) + 2) + "|",
        ]
        for alg, m in metrics.items():
            avg_cell = f"{100 * m.avg[key]:.2f}" if m.avg is not None else "–"
            lines.append(f"| {alg} | " + " | ".join(cell(alg, d, key) for d in domains) + f" | {avg_cell} |")
        lines.append("")
    lines += [
        "### Communication per round (MB, all clients together): what the papers argue about",
        "",
        "| Algorithm | up (weights + statistics / style bank) | down |",
        "|---|---|---|",
    ]
    for alg, m in metrics.items():
        lines.append(f"| {alg} | {m.comm_mb_up:.3f} | {m.comm_mb_down:.3f} |")
    lines.append("")
    return lines


def table_rows(runs: list[EvaluatedRun], metrics: dict[str, AlgorithmResult]) -> list[list]:
    """The same numbers as CSV rows: one per (selection, algorithm)."""
    domains = held_out_domains(runs)
    rows: list[list] = [
        ["selection", "algorithm", *[f"{d}_mean" for d in domains], *[f"{d}_std" for d in domains], "avg"]
    ]
    for key, _ in SELECTIONS:
        for alg, m in metrics.items():
            cells = [m.domains[d].accuracy[key] if d in m.domains else None for d in domains]
            rows.append(
                [
                    key,
                    alg,
                    *[c.mean if c is not None else "" for c in cells],
                    *[c.std if c is not None else "" for c in cells],
                    m.avg[key] if m.avg is not None else "",
                ]
            )
    return rows


def curve_rows(runs: list[EvaluatedRun]) -> list[list]:
    """Per-round target accuracy in long form, one row per (run, round) with its series
    <algorithm>/s<seed>/<domain> (DVC plots: one line per series, .dvc/plots/series.json)."""
    rows: list[list] = [["series", "algorithm", "seed", "held_out", contract.ROUND, contract.TARGET_ACC]]
    for r in runs:
        for p in sorted(r.per_round, key=lambda p: p.round):
            rows.append(
                [
                    f"{r.algorithm}/s{r.seed}/{r.held_out_domain}",
                    r.algorithm,
                    r.seed,
                    r.held_out_domain,
                    p.round,
                    p.target_acc,
                ]
            )
    return rows


def summary_of(metrics: dict[str, AlgorithmResult], domains: list[str]) -> dict:
    """The compact DVC metric: per algorithm, the mean final target accuracy of each held-out domain, and avg."""
    key = contract.FINAL_TARGET_ACC
    return {
        alg: {
            **{d: round(m.domains[d].accuracy[key].mean, 4) for d in domains if d in m.domains},
            **({"avg": round(m.avg[key], 4)} if m.avg is not None else {}),
        }
        for alg, m in metrics.items()
    }


# ---- the figures stage: the training histories ---------------------------------------------------------
def round_series(runs: list[RunHistory]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{metric: {algorithm: [(round, mean over seeds)]}} for target and validation accuracy, the loss and every
    loss term, over runs of one held-out domain."""
    import numpy as np

    metrics = [contract.TARGET_ACC, contract.VAL_ACC, contract.LOSS]
    metrics += sorted({k for r in runs for k in r.rounds[0].loss_terms()})
    series: dict = {m: {} for m in metrics}
    for alg in sorted({str(r.meta.algorithm) for r in runs}):
        rs = [r for r in runs if str(r.meta.algorithm) == alg]
        for m in metrics:
            pts = []
            for i, rec in enumerate(rs[0].rounds):
                vals = [v for r in rs if i < len(r.rounds) and (v := r.rounds[i].metric(m)) is not None]
                if vals:
                    pts.append((rec.round, float(np.mean(vals))))
            series[m][alg] = pts
    return series
