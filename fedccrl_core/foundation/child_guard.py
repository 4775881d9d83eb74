"""`python -m fedccrl_core.foundation.child_guard <parent pid> -- <command> [args...]`: run the command as a child
that dies with its parent (procs.guarded builds this command line). It asks the kernel for SIGTERM when its parent
exits (procs.die_with_parent, PR_SET_PDEATHSIG), ends at once if its parent is not `<parent pid>` any more (the
parent died before), then replaces itself with the command (exec: the same pid and process group; the death signal
survives exec). So the parent needs no code run between fork and exec in the child.


Floor 0 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import os
import sys

from fedccrl_core.foundation.procs import die_with_parent


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        sys.exit("usage: python -m fedccrl_core.foundation.child_guard <parent pid> -- <command> [args...]")
    die_with_parent(parent=int(argv[0]))
    try:
        os.execvp(argv[2], argv[2:])
    except OSError as e:
        sys.exit(f"child_guard: cannot run {argv[2]}: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
