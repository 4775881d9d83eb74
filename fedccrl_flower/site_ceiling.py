"""A site's own ceiling on what a run may spend of its images' privacy: site.toml's `max_epsilon` (and `max_delta`),
which its SuperNode's node config carries (node_config.py). A site with a ceiling answers only runs under
train.privacy whose `max_epsilon` is set, at most the ceiling, at a `delta` at most `max_delta` (by default
train.privacy's default delta); any other message of any phase is refused, naming the client, the run's setting and
the site's, before any of the site's images is read. The server drops the site with that reason (refused_clients /
dropped_clients in the round record, `fedccrl federate`'s stderr).

What it guards: the server chooses a run's settings, and the pin (held_out_pin.py) only keeps them from changing
within a run; with a ceiling the site, not the server, decides that its images are released under DP and how much
of ε one run may spend on them. The site noises its own releases with the run's settings (privacy/dp.py), and the
server's accountant stops the run before a release would pass its max_epsilon (privacy/accountant.py); a server that
skipped that check is outside what a site can see. Each run is bounded here; the runs a site trains in, by its
budget over runs (site_budget.py)."""

from __future__ import annotations

from flwr.app import Context

from fedccrl_core.algorithm_params.train import LocalConfig
from fedccrl_core.privacy.settings import PrivacySettings
from fedccrl_flower.node_config import NODE_MAX_DELTA, NODE_MAX_EPSILON

DEFAULT_MAX_DELTA: float = PrivacySettings.model_fields["delta"].default


def node_float(context: Context, key: str) -> float | None:
    v = context.node_config.get(key)
    if v is None or v == "":
        return None
    if isinstance(v, bool):
        raise ValueError(f"SuperNode node config '{key}': {v!r} is not a number")
    try:
        return float(v)  # the node config's TOML number
    except (TypeError, ValueError):
        raise ValueError(f"SuperNode node config '{key}': {v!r} is not a number") from None


def check_ceiling(context: Context, local: LocalConfig, cid: str) -> None:
    """ValueError naming the client, the run's setting and the site's when this site has a ceiling (node config
    max-epsilon) and a run of these settings (the spec's `local`) may spend more than it; nothing without a ceiling."""
    ceiling = node_float(context, NODE_MAX_EPSILON)
    if ceiling is None:
        return
    max_delta = node_float(context, NODE_MAX_DELTA) or DEFAULT_MAX_DELTA
    p = local.privacy
    site = f"this site's max_epsilon {ceiling:g} at delta <= {max_delta:g} (site.toml)"
    if p is None or not local.private:
        raise ValueError(f"client {cid}: refused: the run has train.privacy off; {site} admits only runs under it")
    if p.max_epsilon == 0:
        raise ValueError(f"client {cid}: refused: the run's train.privacy.max_epsilon is 0 (no limit); {site}")
    if p.max_epsilon > ceiling:
        raise ValueError(f"client {cid}: refused: the run's train.privacy.max_epsilon {p.max_epsilon:g} is over {site}")
    if p.delta > max_delta:
        raise ValueError(f"client {cid}: refused: the run's train.privacy.delta {p.delta:g} is over {site}")


def check_eval_split(context: Context, split: str, cid: str) -> None:
    """ValueError for an evaluation-only run (`fedccrl evaluate-sites`) asking a site with a ceiling for counts over
    its train rows (split "all"): exact counts over images that the study's DP runs train on, outside any ε. Its val
    rows, which no run trains on, it counts, as a training run under train.privacy does (data/shards.py
    held_out_parts)."""
    ceiling = node_float(context, NODE_MAX_EPSILON)
    if ceiling is not None and split != "val":
        raise ValueError(
            f"client {cid}: refused: split {split!r} would count the site's train rows; with max_epsilon {ceiling:g} "
            "(site.toml) this site counts its val rows only (fedccrl evaluate-sites --split val)"
        )
