"""Which images each site counts in `fedccrl evaluate-sites` (evaluate_sites.py): the sites asked and each one's split,
"val" (its val split: it trained the model on the rest) or "all" (train + val: it never trained it). Under
train.privacy every site counts its val split (data/shards.py held_out_parts): a site's other rows train the runs of
the study that hold out another domain."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fedccrl_core.foundation import contract

if TYPE_CHECKING:
    from fedccrl_core.federation.history import RunHistory
    from fedccrl_flower.sites import FederationFile

SPLITS = ("auto", "all", "val")  # --split: auto = val for a site that trained the model (any, under DP), else all


def trained_sites(history: RunHistory, fed: FederationFile, held_out: str) -> set[str]:
    """The client ids that trained the model: named in its records, else the federation's sources."""
    prefix = contract.client_train_acc("")
    named = {k[len(prefix) :] for r in history.rounds for k in r.model_extra or {} if k.startswith(prefix)}
    return named or set(fed.sources(held_out))


def choose_splits(fed: FederationFile, sites: str, split: str, trained: set[str], private: bool, where: Path) -> dict:
    """{client id: "val" | "all"} of the sites asked; ValueError naming the site or the rule before any work."""
    known = [s.id for s in fed.sites]
    asked = [s.strip() for s in sites.split(",") if s.strip()] if sites else known
    unknown = [s for s in asked if s not in known]
    if unknown:
        raise ValueError(f"--sites: {', '.join(unknown)} not among the sites of {where} ({', '.join(known)})")
    splits = {c: ("val" if private or c in trained else "all") if split == "auto" else split for c in asked}
    exposed = [c for c, s in splits.items() if s == "all"]
    if private and exposed:
        trained_here = [c for c in exposed if c in trained]
        whose = (
            f"the model trained on {', '.join(trained_here)}"
            if trained_here
            else f"the train rows of {', '.join(exposed)} are training images of the study's other runs"
        )
        raise ValueError(
            f"--split all: under train.privacy {whose}, which would be counted exactly, outside epsilon "
            "(docs/privacy.md); use --split auto or val"
        )
    return splits
