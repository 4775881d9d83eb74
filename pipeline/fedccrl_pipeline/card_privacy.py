"""The model card's differential privacy section, with docs/privacy.md's one-line facts quoted word for word
(`QUOTES`; tests/test_model_card.py checks each is still in the doc)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fedccrl_pipeline.card_tables import table

if TYPE_CHECKING:
    from fedccrl_pipeline.card_records import CardRecords

PRIVACY_DOC = "docs/privacy.md"


@dataclass(frozen=True)
class DocQuotes:
    """docs/privacy.md's one-line facts, word for word (its **bold** dropped)."""

    unit: str
    not_covered: str
    server: str
    sweep: str
    seeded: str
    rows: str
    labels: str


QUOTES = DocQuotes(
    unit="the run's ε is image-level, not client-level",
    not_covered="It does not cover the validation images (the clients' val splits, which the server evaluates each "
    "round to pick the best round) nor the held-out target domain",
    server="The guarantee on this channel therefore holds against everyone who sees the global models (the "
    "clients, MLflow, the exports), not against the server, which must be trusted with the weights.",
    sweep="One run's ε bounds what that run's releases reveal about one training image. It is not what a sweep reveals",
    seeded="anyone with the params file removes the noise, so no ε applies",
    rows="one row of channel statistics per sampled image: F_i (Eq. 8), each row the image's exact (μ, σ) over its "
    "3 channels (Eq. 6-7), 6 numbers",
    labels="a site's label distribution is visible to the server, which it is not from n_i alone",
)


def privacy_section(r: CardRecords) -> list[str]:
    """The card's differential privacy section: the run's ε and δ, the sweep's ε per image, and the doc's facts."""
    dp, mark = r.history.dp, r.meta.privacy or (r.history.dp.mark if r.history.dp else None)
    eps = next((x.dp_epsilon for x in reversed(r.history.rounds) if x.dp_epsilon is not None), None)
    out = ["## Differential privacy", ""]
    if mark is not None:
        return [*out, f'Not private: {mark}. docs/privacy.md: "{QUOTES.seeded}".', ""]
    if dp is None:
        return [
            *out,
            "Not private: the run trained without train.privacy; its uploads were neither clipped nor noised. "
            f'What FedCCRL uploads besides its weights (docs/privacy.md): "{QUOTES.rows}".',
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
    out += table(("field", "value"), rows)
    out += [f'- docs/privacy.md: "{q}".' for q in (QUOTES.unit, QUOTES.sweep, QUOTES.not_covered, QUOTES.server)]
    return [*out, ""]
