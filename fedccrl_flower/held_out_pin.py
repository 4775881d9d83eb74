"""A site keeps the held-out domain of a run's first message, and whether it ran under train.privacy, and refuses a
later message of that run that changes either. The held-out domain decides what a site returns: a source site trains on its images and returns counts on
its val split, an evaluation site returns counts on its images of the held-out domain (evalsets.py). A spec that
changed its held_out within a run would have a source site count the global model's predictions on its own training
images, exactly, outside what train.privacy accounts for (docs/privacy.md, "What a site returns for evaluation").
Likewise a spec that dropped train.privacy within a run would have an evaluation site count its train rows, which the
study's other runs train on, where under train.privacy it counts its val rows only (data/shards.py held_out_parts).

The run is the spec's `run_key` (ClientSpec: the hash of the ServerSpec's run_info, which holds the run key of
fedccrl_core/federation/plan.py); the pin lives in the node's Context.state, which Flower keeps per Flower run.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context

from fedccrl_flower import messages as M
from fedccrl_flower.spec import ClientSpec

PRIVATE = ":private"  # a pin's second key: <run key>:private, whether the run's first message ran under train.privacy


def pin_held_out(context: Context, spec: ClientSpec, cid: str) -> None:
    """The spec's held_out and train.privacy, pinned for its run on the first message; ValueError naming both when a
    later message of that run changes either (the server drops the site from that phase with this reason)."""
    pins = M.record(context.state, M.STATE_HELD_OUT, ConfigRecord) if M.STATE_HELD_OUT in context.state else None
    if pins is None:
        pins = context.state[M.STATE_HELD_OUT] = ConfigRecord()
    first = pins.get(spec.run_key)  # a str: what this function stored
    private = spec.local.private
    if first is None:
        pins[spec.run_key] = spec.held_out
        pins[spec.run_key + PRIVATE] = private
        return
    first_private = bool(pins.get(spec.run_key + PRIVATE))
    if first_private != private:
        now, then = ("on", "off") if private else ("off", "on")
        raise ValueError(
            f"client {cid}: refused: this message has train.privacy {now}, but the run (run key {spec.run_key}) had "
            f"it {then} in its first message to this site; a run's privacy does not change (an evaluation site "
            "would count images the study's other runs train on)"
        )
    if first != spec.held_out:
        raise ValueError(
            f"client {cid}: refused: this message holds out '{spec.held_out}', but the run (run key "
            f"{spec.run_key}) held out '{first!s}' in its first message to this site; a run's held-out domain "
            "does not change (a source site would count predictions on its own training images)"
        )
