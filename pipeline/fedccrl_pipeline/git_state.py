"""What git says about the working tree a stage runs in: the commit (with `-dirty` for uncommitted changes to
tracked files) and a file as committed at HEAD. Without git (or outside a repository) there is no answer: "unknown"
and None."""

from __future__ import annotations

import subprocess


def _git(*args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git, or it hung: no answer
        return None


def git_commit() -> str:
    head, status = _git("rev-parse", "HEAD"), _git("status", "--porcelain", "--untracked-files=no")
    sha = head.stdout.strip() if head is not None else ""
    if not sha or status is None:
        return "unknown"
    return sha + ("-dirty" if status is not None and status.stdout.strip() else "")


def committed_text(path: str) -> str | None:
    """`git show HEAD:<path>`: the file as committed, None without git or without that file at HEAD."""
    p = _git("show", f"HEAD:{path}")
    return p.stdout if p is not None and p.returncode == 0 else None
