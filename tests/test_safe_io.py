"""What stands at an output path decides how it is written (fedccrl_core/foundation/output_target.py): a symlink
keeps pointing at the file written, a FIFO's reader gets every record, a full device is one clear error and
stays a device, a regular file is complete or absent, `-` is stdout, a folder is refused before any work.

First the library, then every CLI output that takes a user's path, each against every kind of node. Full
devices are made under the test's folder (mknod 1,7: /dev/full's numbers); the real /dev is never touched.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from fixtures import temps, tiny_onnx

from fedccrl_core.foundation import fsio
from fedccrl_core.foundation.output_errors import OutputError

REPO = Path(__file__).resolve().parents[1]


def full_device(path: Path) -> Path:
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except PermissionError:
        pytest.skip("making a character device needs CAP_MKNOD (root)")
    return path


class FifoReader:
    """A FIFO at `path` and a thread reading it to the end."""

    def __init__(self, path: Path):
        os.mkfifo(path)
        self.path, self.data = path, b""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        with open(self.path, "rb") as f:
            self.data = f.read()

    def bytes(self) -> bytes:
        self.thread.join(timeout=20)
        assert not self.thread.is_alive(), "the writer never closed the FIFO"
        return self.data


# ------------------------------------------------------------------ the library
def test_a_chain_of_links_writes_the_file_it_ends_at(tmp_path):
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "out.json"
    target.write_text("old")
    (tmp_path / "l1").symlink_to("real/out.json")
    (tmp_path / "l2").symlink_to(tmp_path / "l1")
    fsio.write_json(tmp_path / "l2", {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    assert os.readlink(tmp_path / "l2") == str(tmp_path / "l1") and os.readlink(tmp_path / "l1") == "real/out.json"
    assert temps(tmp_path) == [] and temps(tmp_path / "real") == []


def test_a_dangling_link_writes_the_path_it_names(tmp_path):
    (tmp_path / "link").symlink_to("sub/new.txt")
    fsio.write_text(tmp_path / "link", "hello")
    assert (tmp_path / "sub" / "new.txt").read_text() == "hello" and (tmp_path / "link").is_symlink()


def test_a_link_loop_and_a_folder_are_refused_before_writing(tmp_path):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(OutputError, match=f"^{tmp_path / 'a'}: cannot write \\(too many levels"):
        fsio.write_text(tmp_path / "a", "x")
    (tmp_path / "d").mkdir()
    (tmp_path / "to_d").symlink_to("d")
    for p in (tmp_path / "d", tmp_path / "to_d"):
        with pytest.raises(OutputError, match=f"^{p}: cannot write \\(is a folder, not a file\\)"):
            with fsio.atomic_file(p, "w"):
                raise AssertionError("the body ran")  # refused before any work
    assert sorted(os.listdir(tmp_path / "d")) == [] and temps(tmp_path) == []


def test_a_fifo_reader_gets_every_byte_and_the_fifo_stays(tmp_path):
    reader = FifoReader(tmp_path / "fifo")
    lines = [f"record {i}\n" for i in range(20000)]  # far beyond a pipe's buffer
    with fsio.atomic_file(tmp_path / "fifo", "w") as f:
        for line in lines:
            f.write(line)
    assert reader.bytes().decode() == "".join(lines)
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode) and temps(tmp_path) == []


def test_a_unix_socket_is_streamed_into(tmp_path):
    path = tmp_path / "sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    got = []

    def serve():
        conn, _ = srv.accept()
        with conn:
            got.append(b"".join(iter(lambda: conn.recv(65536), b"")))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    fsio.write_bytes(path, b"x" * 300_000)
    t.join(timeout=60)
    srv.close()
    assert got == [b"x" * 300_000] and stat.S_ISSOCK(os.lstat(path).st_mode)


def test_a_full_device_is_one_error_naming_it_and_stays_a_device(tmp_path):
    dev = full_device(tmp_path / "full")
    (tmp_path / "to_full").symlink_to("full")
    for p in (dev, tmp_path / "to_full"):
        with pytest.raises(OutputError) as e:
            fsio.write_text(p, "x" * 100)
        assert str(e.value) == f"{p}: cannot write (No space left on device)"
    assert stat.S_ISCHR(os.lstat(dev).st_mode) and os.lstat(dev).st_rdev == os.makedev(1, 7)
    assert (tmp_path / "to_full").is_symlink() and temps(tmp_path) == []


def test_dash_is_stdout(capsysbinary, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where wrong code would make a file named "-"
    fsio.write_text("-", "to stdout\n")
    fsio.write_bytes("-", b"\x00bytes")
    assert capsysbinary.readouterr().out == b"to stdout\n\x00bytes" and os.listdir(tmp_path) == []


def test_a_link_to_stdout_onto_a_file_appends_in_order(tmp_path):
    """/dev/stdout is a link into /proc: reopened, it would write from offset 0 over what stdout already holds;
    the process's own descriptor is duplicated instead, and never replaced by a rename. The link here is made
    under the test's folder (as /dev/stdout is: -> /proc/self/fd/1), so wrong code cannot replace /dev/stdout."""
    (tmp_path / "stdout").symlink_to("/proc/self/fd/1")
    code = textwrap.dedent(f"""
        from fedccrl_core.foundation import fsio
        print("before", flush=True)
        fsio.write_text({str(tmp_path / "stdout")!r}, "via the link\\n")
        fsio.write_text("-", "via -\\n")
        print("after")
    """)
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        r = subprocess.run(
            [sys.executable, "-c", code],
            stdout=f,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert r.returncode == 0, r.stderr
    assert out.read_text() == "before\nvia the link\nvia -\nafter\n"
    assert os.readlink(tmp_path / "stdout") == "/proc/self/fd/1"


def test_a_regular_file_is_complete_or_absent(tmp_path):
    p = tmp_path / "out.json"
    p.write_text("old")
    for exc in (KeyboardInterrupt, OSError(5, "Input/output error")):
        with pytest.raises((KeyboardInterrupt, OSError)):
            with fsio.atomic_file(p, "w") as f:
                f.write("half")
                raise exc
        assert p.read_text() == "old" and temps(tmp_path) == []


def test_a_folder_output_through_a_symlink_replaces_the_folder_it_names(tmp_path):
    """atomic_dir (every stage's --out folder): the link stays and points at the new, complete folder."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "stale.json").write_text("{}")
    (tmp_path / "out").symlink_to("real")
    with fsio.atomic_dir(tmp_path / "out") as d:
        (d / "new.json").write_text("[]")
    assert os.readlink(tmp_path / "out") == "real" and sorted(os.listdir(tmp_path / "real")) == ["new.json"]
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OutputError, match=f"^{tmp_path / 'fifo'}: cannot write \\(is a FIFO, not a folder\\)"):
        with fsio.atomic_dir(tmp_path / "fifo"):
            raise AssertionError("the body ran")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode) and temps(tmp_path) == []


# ------------------------------------------------------------------ every CLI output
@pytest.fixture
def ws(tmp_path, images):
    """A workspace for every CLI below: an ONNX model, labelled images, report inputs, params.yaml."""
    tiny_onnx(tmp_path / "model.onnx")
    for seed, acc in ((0, 0.5), (1, 0.7)):
        doc = {
            "dataset": "toy",
            "algorithm": "fedavg",
            "seed": seed,
            "held_out_domain": "a",
            "held_out_index": 0,
            "final_target_acc": acc,
            "best_val_target_acc": acc,
            "best_round": 1,
            "per_round": [{"round": 1, "target_acc": acc, "val_acc": 0.5}],
            "bytes_up_per_round": 1e6,
            "bytes_down_per_round": 1e6,
            "classes": ["x", "y"],
            "platform": "cpu x86_64 AVX2, torch 2.14.1",
            "n_test": 10,
            "mlflow_run_id": None,
            "final_val_acc": 0.5,
            "detail": {"final": {"target_acc": acc, "round": 2}, "best_val": {"target_acc": acc, "round": 1}},
        }
        p = tmp_path / "runs" / "fedavg" / f"s{seed}" / "d0.json"
        p.parent.mkdir(parents=True)
        p.write_text(json.dumps(doc))
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    (tmp_path / "o").mkdir()
    return tmp_path


# name -> (command group, arguments with {out} for the output under test); the other outputs go to o/
CLIS = {
    "serve predict --output": ("serve", ["predict", "model.onnx", "imgs", "-q", "--output", "{out}"]),
    "serve predict --format csv --output": (
        "serve",
        ["predict", "model.onnx", "imgs", "-q", "--format", "csv", "--output", "{out}"],
    ),
    "serve evaluate --output": ("serve", ["evaluate", "model.onnx", "imgs", "-q", "--output", "{out}"]),
    "report --metrics": (
        "fedccrl",
        ["report", "--runs", "runs", "--metrics", "{out}", "--table", "o/t.md", "--curves", "o/c.csv"],
    ),
    "report --table": (
        "fedccrl",
        ["report", "--runs", "runs", "--metrics", "o/m.json", "--table", "{out}", "--curves", "o/c.csv"],
    ),
    "report --curves": (
        "fedccrl",
        ["report", "--runs", "runs", "--metrics", "o/m.json", "--table", "o/t.md", "--curves", "{out}"],
    ),
    "report --summary": (
        "fedccrl",
        [
            "report",
            "--runs",
            "runs",
            "--metrics",
            "o/m.json",
            "--table",
            "o/t.md",
            "--curves",
            "o/c.csv",
            "--summary",
            "{out}",
        ],
    ),
}


def run_cli(ws: Path, name: str, out: str, monkeypatch):
    from click.testing import CliRunner

    group, args = CLIS[name]
    if group == "serve":
        from fedccrl_serving.cli import main
    else:
        from fedccrl_pipeline.cli import main
    monkeypatch.chdir(ws)
    return CliRunner().invoke(main, [a.replace("{out}", out) for a in args])


def reference(ws: Path, name: str, monkeypatch) -> bytes:
    """The bytes of the output written to a regular file (what every other kind of node must receive)."""
    res = run_cli(ws, name, "ref.out", monkeypatch)
    assert res.exit_code == 0, res.output[-2000:]
    data = (ws / "ref.out").read_bytes()
    assert len(data.splitlines()) >= 2
    return data


def clean_error(res, out: str, prefix: str) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output[-2000:]
    assert "Traceback" not in res.output
    errors = [ln for ln in lines if ln.startswith(prefix)]
    assert len(errors) == 1, res.stderr
    return errors[0]


def prefix_of(name: str) -> str:
    return "fedccrl-serve: error: " if CLIS[name][0] == "serve" else "error: "


@pytest.mark.parametrize("name", CLIS)
def test_cli_output_through_a_symlink(name, ws, monkeypatch):
    ref = reference(ws, name, monkeypatch)
    (ws / "real").mkdir()
    (ws / "real" / "target").write_text("old")
    (ws / "link").symlink_to("real/target")
    res = run_cli(ws, name, "link", monkeypatch)
    assert res.exit_code == 0, res.output[-2000:]
    assert (ws / "link").is_symlink() and os.readlink(ws / "link") == "real/target"
    assert (ws / "real" / "target").read_bytes() == ref and temps(ws) == [] and temps(ws / "real") == []


@pytest.mark.parametrize("name", CLIS)
def test_cli_output_into_a_fifo(name, ws, monkeypatch):
    ref = reference(ws, name, monkeypatch)
    reader = FifoReader(ws / "fifo")
    res = run_cli(ws, name, "fifo", monkeypatch)
    assert res.exit_code == 0, res.output[-2000:]
    assert reader.bytes() == ref
    assert stat.S_ISFIFO(os.lstat(ws / "fifo").st_mode) and temps(ws) == []


@pytest.mark.parametrize("name", CLIS)
def test_cli_output_onto_a_full_device(name, ws, monkeypatch):
    dev = full_device(ws / "full")
    res = run_cli(ws, name, "full", monkeypatch)
    line = clean_error(res, "full", prefix_of(name))
    assert line == f"{prefix_of(name)}full: cannot write (No space left on device)"
    assert stat.S_ISCHR(os.lstat(dev).st_mode) and os.lstat(dev).st_rdev == os.makedev(1, 7) and temps(ws) == []


@pytest.mark.parametrize("name", CLIS)
def test_cli_output_onto_a_folder_is_refused(name, ws, monkeypatch):
    (ws / "adir").mkdir()
    res = run_cli(ws, name, "adir", monkeypatch)
    assert res.exit_code == 2 and "adir" in res.stderr and "Traceback" not in res.output, res.output[-2000:]
    assert sorted(os.listdir(ws / "adir")) == []


@pytest.mark.parametrize("name", CLIS)
def test_cli_output_to_a_regular_file_is_complete_or_absent(name, ws, monkeypatch):
    """An interrupt after every byte is written but before the rename (the fsync that precedes it): the old
    file stays whole and no temporary file is left; then an uninterrupted run replaces it whole."""
    ref = reference(ws, name, monkeypatch)
    out = ws / "out.txt"
    out.write_text("old")
    real_fsync = os.fsync

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    res = run_cli(ws, name, "out.txt", monkeypatch)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert res.exit_code != 0
    assert out.read_text() == "old" and temps(ws) == []
    res = run_cli(ws, name, "out.txt", monkeypatch)
    assert res.exit_code == 0 and out.read_bytes() == ref


@pytest.mark.parametrize("name", CLIS)
def test_cli_output_dash_is_stdout(name, ws, monkeypatch):
    ref = reference(ws, name, monkeypatch)
    res = run_cli(ws, name, "-", monkeypatch)
    assert res.exit_code == 0, res.output[-2000:]
    assert res.stdout_bytes == ref and not (ws / "-").exists()


@pytest.mark.full("three downloads of the synthetic dataset, about 15 s")
def test_download_report_through_a_symlink_into_a_fifo_and_onto_a_full_device(tmp_path, monkeypatch):
    """`fedccrl download --report`: the data report of the stage, written by fedccrl_core.data.sources."""
    from click.testing import CliRunner

    from fedccrl_pipeline.cli import main

    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    monkeypatch.chdir(tmp_path)

    def download(report: str):
        return CliRunner().invoke(main, ["download", "--out", f"raw-{report}", "--report", report])

    (tmp_path / "reports").mkdir()
    (tmp_path / "link").symlink_to("reports/download.json")
    res = download("link")
    assert res.exit_code == 0, res.output[-2000:]
    doc = json.loads((tmp_path / "reports" / "download.json").read_text())
    assert doc["status"] == "ok" and doc["total"] == 960 and (tmp_path / "link").is_symlink()

    reader = FifoReader(tmp_path / "fifo")
    res = download("fifo")
    assert res.exit_code == 0, res.output[-2000:]
    streamed = json.loads(reader.bytes())
    assert streamed["status"] == "ok" and streamed["total"] == 960 and streamed.keys() == doc.keys()
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)

    full_device(tmp_path / "full")
    res = download("full")
    assert clean_error(res, "full", "error: ") == "error: full: cannot write (No space left on device)"
    assert stat.S_ISCHR(os.lstat(tmp_path / "full").st_mode) and temps(tmp_path) == []


@pytest.mark.full("the tiny trained run (conftest.py `trained`, about 20 s) and three ONNX exports")
def test_export_summary_through_a_symlink_into_a_fifo_and_onto_a_full_device(trained, tiny, tmp_path, monkeypatch):
    """`fedccrl export --summary`: the worst parity over the sweep's runs, a DVC metric."""
    from click.testing import CliRunner

    from fedccrl_pipeline.cli import main

    monkeypatch.chdir(trained)

    def export(summary: Path, out: str):
        return CliRunner().invoke(
            main,
            [
                "export",
                "--models",
                "models",
                "--shards",
                str(tiny / "data" / "shards"),
                "--out",
                str(tmp_path / out),
                "--summary",
                str(summary),
                "--no-mlflow",
                "--params",
                "params.yaml",
            ],
        )

    (tmp_path / "link").symlink_to("parity.json")
    res = export(tmp_path / "link", "e1")
    assert res.exit_code == 0, res.output[-2000:]
    doc = json.loads((tmp_path / "parity.json").read_text())
    assert doc["runs"] == 1 and doc["min_top1_agreement"] >= 0.999 and (tmp_path / "link").is_symlink()

    reader = FifoReader(tmp_path / "fifo")
    res = export(tmp_path / "fifo", "e2")
    assert res.exit_code == 0, res.output[-2000:]
    assert json.loads(reader.bytes()) == doc and stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)

    full_device(tmp_path / "full")
    res = export(tmp_path / "full", "e3")
    assert clean_error(res, "full", "error: ") == f"error: {tmp_path / 'full'}: cannot write (No space left on device)"
    assert stat.S_ISCHR(os.lstat(tmp_path / "full").st_mode) and temps(tmp_path) == []
