"""A SuperNode's node config (`flower-supernode --node-config`): the keys the ClientApp reads, and the one way to
write them as the flag's value. Without torch or Flower: `fedccrl site join` builds the command line from it.

Flower (1.42, flwr/common/config.py `parse_config_args`) splits the value into `key=value` pairs with a regular
expression and reads each value as TOML: a quoted value runs to the next quote of its kind. So a string is written
as a TOML basic string ("...", a backslash doubled), and a string holding a double quote or a control character,
which that split cannot carry, is refused."""

from __future__ import annotations

NODE_CLIENT_ID = "client-id"  # this SuperNode's client, e.g. "art_c0"
NODE_PARTITION_ID = "partition-id"  # or: index into the manifest's source clients (simulation sets it)
NODE_SHARDS = "shards"  # folder with manifest.json and <client>.npz
NODE_POOLS = "pools"  # folder with the client's statistics (pools stage)
NODE_STATE_DIR = "state-dir"  # optional: mirror of ClientState on disk (resume after restarts)
NODE_DEVICE = "device"  # optional: auto | cpu | cuda (default: the server's train.device)
NODE_MAX_EPSILON = "max-epsilon"  # optional: the site's ceiling on a run's train.privacy.max_epsilon (site_ceiling.py)
NODE_MAX_DELTA = "max-delta"  # optional, with max-epsilon: the largest delta at which that epsilon may be counted
NODE_MAX_STUDY_EPSILON = "max-study-epsilon"  # optional, with max-epsilon: the site's budget over runs (site_budget.py)


def unsafe_value(value: str) -> str | None:
    """Why `value` cannot be a node config string (None when it can)."""
    if '"' in value:
        return 'holds a double quote (")'
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        return "holds a control character"
    return None


def node_config_arg(config: dict[str, str | int | float | bool]) -> str:
    """The value of `--node-config` for `config` (key -> value); ValueError naming a key whose value it cannot carry."""
    pairs = []
    for key, value in config.items():
        if isinstance(value, str):
            why = unsafe_value(value)
            if why:
                raise ValueError(f"node config '{key}': {value!r} {why}")
            escaped = value.replace("\\", "\\\\")  # TOML basic string: a backslash escapes
            pairs.append(f'{key}="{escaped}"')
        elif isinstance(value, bool):
            pairs.append(f"{key}={'true' if value else 'false'}")
        else:
            pairs.append(f"{key}={value}")
    return " ".join(pairs)
