"""`python -m fedccrl_core.foundation.child_guard <parent pid> -- <command> [args...]`: run the command under a
guard that ends with its parent and takes every process the command started with it (procs.guarded builds this
command line).

The guard asks the kernel for SIGTERM when its parent exits (procs.die_with_parent, PR_SET_PDEATHSIG) and ends at
once if its parent is not `<parent pid>` any more (the parent died before). It makes itself the subreaper of what
it starts (procs.become_subreaper, PR_SET_CHILD_SUBREAPER): a grandchild that the command detached into a session
of its own, and that outlives its own parent, is re-parented to the guard, not to init. Flower's SuperLink and
SuperNode start such grandchildren (`flower-superexec`, which starts the ServerApp or ClientApps), and these watch
their parent only by polling, so a launcher killed with SIGKILL could leave them running.

SIGTERM, SIGINT or SIGHUP (the launcher died, or it stops the federation) is passed on to the command, then every
descendant gets SIGTERM and, after STOP_GRACE_S, SIGKILL. When the command ends by itself, its descendants that are
left are ended the same way. The guard then exits as the command did (its exit code, or the same signal), and by
the signal it got when the command never ran. The parent needs no code run between fork and exec.


Floor 0 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from fedccrl_core.foundation.procs import STOP_GRACE_S, become_subreaper, die_with_parent

STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stop(Exception):
    """A stop signal arrived (raised by the handler in the main thread)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame):
    for sig in STOPS:  # once: the launcher signals the group and every descendant, the guard among them
        signal.signal(sig, signal.SIG_IGN)
    raise Stop(signum)


def _alive(p: psutil.Process, child: subprocess.Popen | None) -> bool:
    """Whether `p` still runs; an exited child of the guard is reaped (the command through its Popen)."""
    try:
        if p.status() != psutil.STATUS_ZOMBIE:
            return True
        if child is not None and p.pid == child.pid:
            child.poll()
        elif p.ppid() == os.getpid():
            os.waitpid(p.pid, os.WNOHANG)
    except (psutil.Error, ChildProcessError):
        pass
    return False


def end_descendants(child: subprocess.Popen | None, signalled: set[int], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to every descendant still running (but those in `signalled`), SIGKILL to those left after `grace_s`;
    every one reaped."""
    me, deadline = psutil.Process(), time.monotonic() + grace_s
    while True:
        try:
            left = [p for p in me.children(recursive=True) if _alive(p, child)]
        except psutil.Error:
            continue  # one exited while it was listed: list again
        if not left:
            if child is not None:
                child.wait()
            return
        late = time.monotonic() > deadline
        for p in left:
            if late or p.pid not in signalled:
                try:
                    p.send_signal(signal.SIGKILL if late else signal.SIGTERM)
                except psutil.Error:
                    pass
                signalled.add(p.pid)
        time.sleep(0.05)


def exit_as(code: int | None, signum: int) -> None:
    """Exit with the command's code; by its signal when it was killed by one, by `signum` when it never ran."""
    if code is not None and code >= 0:
        sys.exit(code)
    sig = -code if code is not None else signum
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    sys.exit(128 + sig)  # a signal whose default action does not end the process


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        sys.exit("usage: python -m fedccrl_core.foundation.child_guard <parent pid> -- <command> [args...]")
    for sig in STOPS:
        signal.signal(sig, _stop)
    child: subprocess.Popen | None = None
    signum: int = signal.SIGTERM
    signalled: set[int] = set()
    try:
        die_with_parent(parent=int(argv[0]))
        become_subreaper()
        try:
            child = subprocess.Popen(argv[2:])
        except OSError as e:
            sys.exit(f"child_guard: cannot run {argv[2]}: {e}")
        child.wait()
    except Stop as stop:
        signum = stop.signum
        if child is not None and child.poll() is None:
            child.send_signal(signum)
            signalled.add(child.pid)
    for sig in STOPS:  # from here on the guard ends what is left whatever arrives
        signal.signal(sig, signal.SIG_IGN)
    end_descendants(child, signalled)
    exit_as(child.returncode if child is not None else None, signum)


if __name__ == "__main__":
    main(sys.argv[1:])
