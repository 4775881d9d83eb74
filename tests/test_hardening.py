"""Issue 17 (and 16's hand-written-code points): faults and bad input handled at their root.

- fedccrl_core.fsio: the one atomic write; temporary paths of dead processes removed by the next run;
- serving: atomic outputs, metadata checked against the graph, non-regular inputs skipped, a deadline;
- download: a deadline for the whole download, not only for each read;
- the data stages: verified known archives, tarfile's data filter, a warning for tiny domains.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fedccrl_core import fsio

REPO = Path(__file__).resolve().parents[1]


def run_py(code: str, cwd: Path, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120, **kw)


def temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if fsio.TEMP_RE.match(p.name))


# ------------------------------------------------------------------ A. one atomic write, one cleanup

KILLED_WRITER = """
    import os, signal
    from pathlib import Path
    from fedccrl_core.fsio import atomic_dir, atomic_file
    with atomic_dir(Path("plots")) as out:               # as `fedccrl figures` writes plots/
        (out / "augmentation_preview.png").write_bytes(b"half a figure")
        with atomic_file(Path("results") / "d0.json", "w") as f:   # and a file being written
            f.write('{"half": ')
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)           # kill -9 mid-write
"""


def test_a_killed_writer_leaves_temps_that_the_next_run_removes(tmp_path):
    killed = run_py(KILLED_WRITER, tmp_path)
    assert killed.returncode == -signal.SIGKILL
    left_plots, left_results = temps(tmp_path), temps(tmp_path / "results")
    assert len(left_plots) == 1 and left_plots[0].startswith(".plots.tmp-")  # what issue 17 found, for good
    assert len(left_results) == 1 and left_results[0].startswith(".d0.json.tmp-")
    assert not (tmp_path / "plots").exists() and not (tmp_path / "results" / "d0.json").exists()

    rerun = run_py("""
        from pathlib import Path
        from fedccrl_core.fsio import atomic_dir, write_text
        with atomic_dir(Path("plots")) as out:
            (out / "augmentation_preview.png").write_bytes(b"a whole figure")
        write_text(Path("results") / "d0.json", "{}")
    """, tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert temps(tmp_path) == [] and temps(tmp_path / "results") == []
    notices = [ln for ln in rerun.stderr.splitlines() if ln.startswith("notice: removed")]
    assert len(notices) == 2 and left_plots[0] in notices[0] + notices[1] and "no longer running" in notices[0]
    assert (tmp_path / "plots" / "augmentation_preview.png").read_bytes() == b"a whole figure"


def test_a_live_writers_temp_is_kept_and_a_reused_pid_is_not_mistaken_for_its_owner(tmp_path):
    live = tmp_path / f".x.tmp-{os.getpid()}-0123abcd"     # this process is alive and started before it
    live.write_text("in progress")
    reused = tmp_path / f".y.tmp-{os.getpid()}-4567cdef"   # same pid, but written long before we started
    reused.write_text("left by an earlier process that had our pid")
    os.utime(reused, (time.time() - 10 * 86400, time.time() - 10 * 86400))
    dead = tmp_path / ".z.tmp-999999999-89abcdef"           # no such process
    dead.mkdir()
    unrelated = tmp_path / ".notes.tmp"                      # not one of ours: never touched
    unrelated.write_text("user file")
    lines: list[str] = []
    removed = fsio.sweep_stale(tmp_path, log=lines.append)
    assert sorted(p.name for p in removed) == sorted([reused.name, dead.name])
    assert live.exists() and unrelated.exists() and not reused.exists() and not dead.exists()
    assert len(lines) == 2


def test_a_an_exception_mid_write_leaves_nothing_that_looks_complete(tmp_path):
    out = tmp_path / "metrics.json"
    fsio.write_text(out, '{"old": 1}')
    with pytest.raises(RuntimeError):
        with fsio.atomic_file(out, "w") as f:
            f.write('{"new": ')
            raise RuntimeError("fault mid-write")
    assert out.read_text() == '{"old": 1}' and temps(tmp_path) == []   # old output intact, no temp
    folder = tmp_path / "runs"
    with pytest.raises(KeyboardInterrupt):
        with fsio.atomic_dir(folder) as d:
            (d / "d0.json").write_text("{}")
            raise KeyboardInterrupt
    assert not folder.exists() and temps(tmp_path) == []
    with pytest.raises(ValueError):  # NaN refused before a byte is written
        fsio.write_json(tmp_path / "nan.json", {"score": float("nan")}, allow_nan=False)
    assert not (tmp_path / "nan.json").exists() and temps(tmp_path) == []


def test_a_verify_refuses_and_previous_keeps_the_fallback(tmp_path):
    p = tmp_path / "ck.pt"
    fsio.write_bytes(p, b"round 1")

    def refuse(tmp: Path):
        raise ValueError(f"unreadable {tmp.read_bytes()!r}")

    with pytest.raises(ValueError, match="round 2"):
        with fsio.atomic_file(p, "wb", verify=refuse, previous=tmp_path / "ck.pt.prev") as f:
            f.write(b"round 2")
    assert p.read_bytes() == b"round 1" and not (tmp_path / "ck.pt.prev").exists() and temps(tmp_path) == []
    with fsio.atomic_file(p, "wb", verify=lambda t: None, previous=tmp_path / "ck.pt.prev") as f:
        f.write(b"round 2")
    assert p.read_bytes() == b"round 2" and (tmp_path / "ck.pt.prev").read_bytes() == b"round 1"


def test_a_unwritable_output_is_one_error_naming_the_path(tmp_path):
    (tmp_path / "file").write_text("a file, not a folder")
    target = tmp_path / "file" / "out.json"
    with pytest.raises(fsio.OutputError, match=str(target)) as e:
        fsio.write_text(target, "{}")
    assert "cannot write" in str(e.value)
    folder = tmp_path / "dir"
    folder.mkdir()
    with pytest.raises(fsio.OutputError, match=f"{folder}: cannot write"):  # an existing folder in the way
        fsio.write_text(folder, "{}")
    assert temps(tmp_path) == []


def test_a_full_disk_is_one_error_naming_the_path(tmp_path):
    """RLIMIT_FSIZE makes writes beyond 64 kB fail with EFBIG, as a full disk fails them with ENOSPC."""
    r = run_py("""
        import resource, signal
        from pathlib import Path
        from fedccrl_core.fsio import OutputError, write_text
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            write_text(Path("big.json"), "x" * 200_000)
        except OutputError as e:
            print(e)
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("big.json: cannot write (File too large")
    assert sorted(os.listdir(tmp_path)) == []
