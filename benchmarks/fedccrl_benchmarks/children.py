"""The child processes of the benches: each measurement runs in a fresh `python -m <bench module> --child '<json>'`
(its own peak RSS, no warm caches from another path), which prints one JSON line of figures. A child dies with
the bench that started it (fedccrl_core/foundation/procs.py), so a `kill -9` of the bench leaves none running."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable


def run_child(module: str, spec: dict, what: str, env: dict | None = None) -> dict:
    """`python -m module --child json(spec)` -> its last stdout line as JSON; RuntimeError naming `what` with the
    child's stderr when it fails."""
    p = subprocess.run(
        [sys.executable, "-m", module, "--child", json.dumps(spec)], capture_output=True, text=True, env=env
    )
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def child_main(module: str, command: str, measure: Callable[[dict], dict]) -> None:
    """A bench module's `__main__`: with `--child '<json>'`, measure(spec) in this process, which dies with its
    parent; otherwise a usage line naming the user's command, exit status 2."""
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        from fedccrl_core.foundation.procs import die_with_parent

        die_with_parent()
        print(json.dumps(measure(json.loads(sys.argv[2]))), flush=True)
    else:
        print(f"internal: python -m {module} --child '<json>' (use `{command}`)", file=sys.stderr)
        sys.exit(2)
