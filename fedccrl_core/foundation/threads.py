"""The project's CPU thread policy, applied by every entry point before torch is imported.

torch's OpenMP worker threads spin-wait between parallel regions by default. On a machine whose cores
are shared with other processes (CI runners, laptops, 2-core VMs) the spinning threads steal the cores
the work needs: one `fedccrl train` measured 3x the wall time and 3.4x the CPU time with the default
policy against OMP_WAIT_POLICY=PASSIVE (`fedccrl-bench threads` re-measures the ratio).
PASSIVE makes idle OpenMP threads sleep instead. A value the user set explicitly is kept.


Floor 0 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import os

POLICY = {
    "OMP_WAIT_POLICY": "PASSIVE",  # libgomp (torch's Linux wheels) and Intel OpenMP
    "KMP_BLOCKTIME": "0",
}  # Intel OpenMP: sleep at once after a parallel region


def apply_thread_policy(environ=os.environ) -> dict:
    """Set the policy in `environ` (and so in every child process) unless the user set it. Returns what
    was applied. OpenMP reads these variables once, when torch loads, so this must run first."""
    applied = {}
    for key, value in POLICY.items():
        if key not in environ:
            environ[key] = value
            applied[key] = value
    # In a process that imported torch first (a script importing pipeline modules as a library), OpenMP
    # has already read its settings: the policy then reaches only the child processes it starts.
    return applied
