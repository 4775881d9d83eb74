"""Faults and bad input handled at their root.

- fedccrl_core.foundation.fsio: the one atomic write; temporary paths of dead processes removed by the next run
  (temp_paths);
- serving: atomic outputs, metadata checked against the graph, non-regular inputs skipped, a deadline;
- download: a deadline for the whole download, not only for each read;
- the data stages: verified known archives, tarfile's data filter, a warning for tiny domains.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from fixtures import temps, tiny_onnx
from layout import TOP

from fedccrl_core.foundation import fsio, temp_paths
from fedccrl_core.foundation.output_errors import OutputError

REPO = Path(__file__).resolve().parents[1]


def run_py(code: str, cwd: Path, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )


# ------------------------------------------------------------------ A. one atomic write, one cleanup

KILLED_WRITER = """
    import os, signal
    from pathlib import Path
    from fedccrl_core.foundation.fsio import atomic_dir, atomic_file
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
    assert len(left_plots) == 1 and left_plots[0].startswith(
        ".plots.tmp-"
    )  # a kill -9 of `fedccrl figures` left one behind: the next run removes it
    assert len(left_results) == 1 and left_results[0].startswith(".d0.json.tmp-")
    assert not (tmp_path / "plots").exists() and not (tmp_path / "results" / "d0.json").exists()

    rerun = run_py(
        """
        from pathlib import Path
        from fedccrl_core.foundation.fsio import atomic_dir, write_text
        with atomic_dir(Path("plots")) as out:
            (out / "augmentation_preview.png").write_bytes(b"a whole figure")
        write_text(Path("results") / "d0.json", "{}")
    """,
        tmp_path,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert temps(tmp_path) == [] and temps(tmp_path / "results") == []
    notices = [ln for ln in rerun.stderr.splitlines() if ln.startswith("notice: removed")]
    assert len(notices) == 2 and left_plots[0] in notices[0] + notices[1] and "no longer running" in notices[0]
    assert (tmp_path / "plots" / "augmentation_preview.png").read_bytes() == b"a whole figure"


def test_a_live_writers_temp_is_kept_and_a_reused_pid_is_not_mistaken_for_its_owner(tmp_path):
    live = tmp_path / f".x.tmp-{os.getpid()}-0123abcd"  # this process is alive and started before it
    live.write_text("in progress")
    reused = tmp_path / f".y.tmp-{os.getpid()}-4567cdef"  # same pid, but written long before we started
    reused.write_text("left by an earlier process that had our pid")
    os.utime(reused, (time.time() - 10 * 86400, time.time() - 10 * 86400))
    dead = tmp_path / ".z.tmp-999999999-89abcdef"  # no such process
    dead.mkdir()
    unrelated = tmp_path / ".notes.tmp"  # not one of ours: never touched
    unrelated.write_text("user file")
    lines: list[str] = []
    removed = temp_paths.sweep_stale(tmp_path, log=lines.append)
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
    assert out.read_text() == '{"old": 1}' and temps(tmp_path) == []  # old output intact, no temp
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
    with pytest.raises(OutputError, match=str(target)) as e:
        fsio.write_text(target, "{}")
    assert "cannot write" in str(e.value)
    folder = tmp_path / "dir"
    folder.mkdir()
    with pytest.raises(OutputError, match=f"{folder}: cannot write"):  # an existing folder in the way
        fsio.write_text(folder, "{}")
    assert temps(tmp_path) == []


def test_a_full_disk_is_one_error_naming_the_path(tmp_path):
    """RLIMIT_FSIZE makes writes beyond 64 kB fail with EFBIG, as a full disk fails them with ENOSPC."""
    r = run_py(
        """
        import resource, signal
        from pathlib import Path
        from fedccrl_core.foundation.fsio import write_text
        from fedccrl_core.foundation.output_errors import OutputError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            write_text(Path("big.json"), "x" * 200_000)
        except OutputError as e:
            print(e)
    """,
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("big.json: cannot write (File too large")
    assert sorted(os.listdir(tmp_path)) == []


# ------------------------------------------------------------------ B. serving


def serve(*args, **kw):
    from click.testing import CliRunner

    from fedccrl_serving.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False, **kw)


def one_error(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedccrl-serve: error: ") and "Traceback" not in result.stderr, (
        result.stderr
    )
    return lines[0]


@pytest.mark.parametrize(
    "case, over, needle",
    [
        ("image_size disagrees with the graph's input", dict(size=8, graph_size=4), "image_size=8"),
        ("7 class names, 6 logits", dict(classes=tuple("abcdefg"), logits=6), "names 7 classes"),
        ("duplicate class names", dict(classes=("a", "b", "a", "c")), "repeated: 'a'"),
        ("NaN in the mean", dict(mean="[NaN, 0.5, 0.5]"), "finite"),
        ("inf in the std", dict(std="[0.2, Infinity, 0.2]"), "finite"),
    ],
)
def test_b_metadata_is_checked_against_the_graph(tmp_path, images, case, over, needle):
    model = tiny_onnx(tmp_path / "m.onnx", **over)
    for args in (("info", model), ("predict", model, images), ("evaluate", model, images)):
        r = serve(*args)
        assert r.exit_code == 2 and needle in one_error(r) and str(model) in r.stderr, (case, args, r.stderr)
        assert r.stdout == ""


def test_b_logit_count_checked_on_the_batch_when_the_graph_leaves_it_symbolic(tmp_path, images):
    import numpy as np

    from fedccrl_serving.console import Fatal
    from fedccrl_serving.runtime import ServedModel

    model = tiny_onnx(tmp_path / "m.onnx", classes=tuple("abcdefg"), logits="K")  # declared symbolic, 7 wide
    assert serve("predict", model, images / "a" / "0.png").exit_code == 0
    served = ServedModel(model, "cpu")

    class SixLogits:  # a graph whose width only shows at run time
        def run(self, names, feeds):
            return [np.zeros((len(feeds["images"]), 6), np.float32)]

    served.session = SixLogits()
    with pytest.raises(Fatal, match=r"m.onnx: the model returned logits of shape \[2, 6\] for 7 class names"):
        served.logits(np.zeros((2, 3, 4, 4), np.float32))


def test_b_non_finite_scores_are_error_records_and_the_json_stays_json(tmp_path, images):
    model = tiny_onnx(tmp_path / "m.onnx", nan=True)
    strict = dict(parse_constant=lambda c: pytest.fail(f"{c} in the output is not JSON"))
    r = serve("predict", model, images / "a")
    assert r.exit_code == 3
    recs = [json.loads(ln, **strict) for ln in r.stdout.splitlines()]
    assert len(recs) == 6 and all("non-finite" in rec["error"] for rec in recs)
    r = serve("evaluate", model, images, "--output", tmp_path / "rep.json")
    assert r.exit_code == 3
    rep = json.loads((tmp_path / "rep.json").read_text(), **strict)
    assert rep["n_failed"] == 12 and rep["accuracy"] is None


@pytest.mark.parametrize("command", ["predict", "evaluate"])
def test_b_unwritable_output_is_one_line_before_any_work(tmp_path, images, command, monkeypatch):
    import fedccrl_serving.preprocess

    model = tiny_onnx(tmp_path / "m.onnx")
    (tmp_path / "file").write_text("not a folder")
    decoded = []
    monkeypatch.setattr(fedccrl_serving.preprocess, "load_u8", lambda *a: decoded.append(a) or pytest.fail("decoded"))
    out = tmp_path / "file" / "out.json"
    r = serve(command, model, images, "--output", out)
    assert r.exit_code == 2 and f"{out}: cannot write" in one_error(r) and not decoded


@pytest.mark.parametrize("command", ["predict", "evaluate"])
def test_b_full_disk_is_one_line_and_no_half_written_output(tmp_path, images, command):
    """RLIMIT_FSIZE: a write past 256 bytes fails (EFBIG) as a full disk fails it (ENOSPC)."""
    model = tiny_onnx(tmp_path / "m.onnx")
    out = tmp_path / "out" / "o.json"
    r = run_py(
        f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256, 256))
        from fedccrl_serving.cli import main
        sys.argv = ["fedccrl-serve", "{command}", "{model}", "{images}", "--output", "{out}", "-q"]
        main()
    """,
        tmp_path,
    )
    assert r.returncode == 2, r.stderr
    assert f"fedccrl-serve: error: {out}: cannot write (File too large)" in r.stderr and "Traceback" not in r.stderr
    assert not out.parent.exists()  # no half-written o.json, no temporary file, not even the folder it made


def test_b_output_is_atomic_an_interrupted_run_keeps_the_old_one(tmp_path, images, monkeypatch):
    import fedccrl_serving.runtime

    model = tiny_onnx(tmp_path / "m.onnx")
    out = tmp_path / "pred.jsonl"
    out.write_text("the previous complete output\n")
    real = fedccrl_serving.runtime.softmax
    calls = []

    def fault(z):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C after the first batch was written
        return real(z)

    monkeypatch.setattr(fedccrl_serving.runtime, "softmax", fault)
    r = serve("predict", model, images, "--output", out, "--batch-size", 4)
    assert r.exit_code != 0
    assert out.read_text() == "the previous complete output\n" and temps(tmp_path) == []


def test_b_a_fifo_named_like_an_image_is_skipped_never_opened(tmp_path, images):
    fifo = images / "a" / "x.jpg"
    os.mkfifo(fifo)
    os.mkfifo(tmp_path / "y.png")
    model = tiny_onnx(tmp_path / "m.onnx")
    for args in ([images], [images / "a" / "*.jpg", images / "a" / "0.png"], [tmp_path / "y.png", images / "b"]):
        r = run_py(
            f"""
            import sys
            from fedccrl_serving.cli import main
            sys.argv = ["fedccrl-serve", "predict", "{model}", *{[str(a) for a in args]!r}, "-q"]
            main()
        """,
            tmp_path,
        )  # a subprocess: if the FIFO were opened, the timeout would fail the test, not hang it
        assert r.returncode == 0, r.stderr
        paths = [json.loads(ln)["path"] for ln in r.stdout.splitlines()]
        assert paths and not any(p.endswith(("x.jpg", "y.png")) for p in paths)
        assert "a FIFO, not a regular file" in r.stderr
    r = run_py(
        f"""
        import sys
        from fedccrl_serving.cli import main
        sys.argv = ["fedccrl-serve", "evaluate", "{model}", "{images}", "-q", "--json"]
        main()
    """,
        tmp_path,
    )
    assert r.returncode == 0 and json.loads(r.stdout)["n_images"] == 12 and "x.jpg" in r.stderr


@pytest.mark.parametrize("command, workers", [("predict", 1), ("evaluate", 2)])
def test_b_deadline_stops_the_run_and_writes_no_output(tmp_path, images, command, workers, monkeypatch):
    import fedccrl_serving.preprocess

    model = tiny_onnx(tmp_path / "m.onnx")
    real = fedccrl_serving.preprocess.load_u8
    monkeypatch.setattr(fedccrl_serving.preprocess, "load_u8", lambda *a: time.sleep(0.3) or real(*a))  # a slow disk
    out = tmp_path / "out.json"
    t0 = time.monotonic()
    r = serve(command, model, images, "--output", out, "--deadline", 0.5, "--workers", workers, "-q")
    assert time.monotonic() - t0 < 1.5  # 12 images x 0.3 s would take 3.6 s (1.8 s on two threads)
    assert r.exit_code == 2 and "--deadline 0.5 s passed" in one_error(r)
    assert not out.exists() and temps(tmp_path) == []
    assert serve(command, model, images, "--deadline", 0).exit_code == 2  # must be > 0
    assert serve("predict", model, images, "--deadline", 60, "-q").exit_code == 0


# ------------------------------------------------------------------ C. a deadline for the whole download


@pytest.fixture
def trickling_server():
    """127.0.0.1: promises 1 MB, then sends one byte every 20 ms (each read returns within any timeout)."""
    import http.server
    import threading

    stop = threading.Event()

    class Trickle(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/zip")
            self.send_header("Content-Length", str(1 << 20))
            self.end_headers()
            try:
                while not stop.is_set():
                    self.wfile.write(b"P")
                    self.wfile.flush()
                    time.sleep(0.02)
            except OSError:  # the client gave up
                pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/pacs.zip"
    stop.set()
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.timeout(60)  # without the deadline the download never ends
def test_c_a_trickling_server_meets_the_whole_download_deadline(trickling_server, tmp_path):
    from fedccrl_core.data.http import download_url
    from fedccrl_core.foundation.errors import DataError

    t0 = time.monotonic()
    with pytest.raises(DataError) as e:
        download_url(trickling_server, tmp_path / "a.zip", timeout_s=5, retries=2, deadline_s=1.5, progress=False)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert msg.startswith(f"{trickling_server}: the download did not finish within download.deadline_s=1.5 s")
    assert "received" in msg and 1.5 <= took < 4  # not retried: the deadline covers every attempt
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(60)
def test_c_the_download_stage_takes_its_deadline_from_params(trickling_server, params, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from fedccrl_pipeline.cli import main
    from fedccrl_pipeline.params_yaml import read_yaml

    defaults = read_yaml(REPO / "params.yaml")["download"]
    assert defaults["deadline_s"] >= defaults["timeout_s"]
    slow = {
        "dataset.name": "pacs",
        "dataset.source": trickling_server,
        "dataset.sha256": None,
        "download.timeout_s": 1,
        "download.deadline_s": 2,
        "download.retries": 0,
    }
    params(slow)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(
        main, ["download", "--out", "data/raw", "--report", "data/report.json"], catch_exceptions=False
    )
    assert r.exit_code == 2 and r.stderr.strip().splitlines()[-1].startswith(
        f"error: {trickling_server}: the download did not finish within download.deadline_s=2 s"
    )
    assert not (tmp_path / "data").exists() or os.listdir(tmp_path / "data") == []  # no output, no temp
    params({**slow, "download.timeout_s": 60, "download.deadline_s": 30})
    r = CliRunner().invoke(main, ["download", "--out", "data/raw", "--report", "data/report.json"])
    assert r.exit_code == 2 and "download.deadline_s" in r.stderr and "download.timeout_s=60" in r.stderr


# ------------------------------------------------------------------ D. data: verified known archives, extraction


def _tiny_tree(root: Path) -> Path:
    import numpy as np
    from PIL import Image

    for d in ("a", "b"):
        for c in ("x", "y"):
            (root / "TINY" / d / c).mkdir(parents=True)
            for i in range(2):
                Image.fromarray(np.full((8, 8, 3), 40 * i + (d == "b") * 90, np.uint8)).save(
                    root / "TINY" / d / c / f"{i}.png"
                )
    return root


def test_d_an_archive_the_registry_knows_by_hash_is_reported_verified(tmp_path):
    import hashlib
    import shutil
    from dataclasses import replace

    from fedccrl_core.data.registry import DatasetSpec, KnownArchive
    from fedccrl_core.data.sources import prepare_raw

    archive = Path(shutil.make_archive(str(tmp_path / "tiny"), "zip", _tiny_tree(tmp_path / "src")))
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    spec = DatasetSpec(
        name="tiny",
        domains=("a", "b"),
        classes=("x", "y"),
        domain_counts=(4, 4),
        total=8,
        sources=(),
        image_size=16,
        backbone="small_cnn",
        pretrained="none",
    )
    rep = prepare_raw(spec, str(archive), tmp_path / "raw", tmp_path / "r.json", progress=False)
    arch = rep["source"]["archives"][0]
    assert arch["verified"] is False and arch["expected_sha256"] is None  # unknown: computed only
    known = replace(spec, known_archives=(KnownArchive(digest, "tiny.zip", "test copy"),))
    rep = prepare_raw(known, str(archive), tmp_path / "raw", tmp_path / "r.json", progress=False)
    arch = json.loads((tmp_path / "r.json").read_text())["source"]["archives"][0]
    assert arch == {**arch, "sha256": digest, "expected_sha256": digest, "verified": True, "known_as": "tiny.zip"}


@pytest.mark.shared
def test_d_the_local_pacs_archive_is_verified_against_the_registry(pacs128):
    from fedccrl_core.data.registry import get_dataset
    from fedccrl_core.data.sources import _local_archive

    rec = _local_archive(
        pacs128, None, get_dataset("pacs")
    )  # dataset.sha256: null, as in the PACS recipe (docs/experiments.md)
    assert rec.verified is True and rec.known_as == "pacs_128.zip"
    assert rec.expected_sha256 == rec.sha256 == "0239f4e21fc401b5da9ccc497cdafe8064b81c9e918613c7ebba92b72547f578"


def test_d_tar_members_go_through_tarfiles_data_filter(tmp_path, monkeypatch):
    import io
    import stat
    import tarfile

    from fedccrl_core.data import archives
    from fedccrl_core.foundation.errors import UnsafeArchiveError

    archive = tmp_path / "a.tar"
    with tarfile.open(archive, "w") as t:
        info = tarfile.TarInfo("TINY/a/x/0.png")
        info.size, info.mode = 3, 0o6777  # setuid, setgid, world-writable: none of it may reach the disk
        t.addfile(info, io.BytesIO(b"png"))
    filters = []
    real = tarfile.TarFile.extract
    monkeypatch.setattr(
        tarfile.TarFile,
        "extract",
        lambda self, m, path="", **kw: filters.append(kw.get("filter")) or real(self, m, path, **kw),
    )
    assert archives.safe_extract(archive, tmp_path / "out", progress=False) == 1
    assert filters == ["data"]
    mode = (tmp_path / "out" / "TINY" / "a" / "x" / "0.png").stat().st_mode
    assert not mode & (stat.S_ISUID | stat.S_ISGID | stat.S_IWOTH)

    # the filter is the second line of defence: with our own check switched off it still refuses a link
    # that leaves the folder, as UnsafeArchiveError naming the member
    with tarfile.open(tmp_path / "evil.tar", "w") as t:
        info = tarfile.TarInfo("TINY/a/x/1.png")
        info.size = 1
        t.addfile(info, io.BytesIO(b"1"))
    plan = archives._plan_tar

    def unchecked(tf, path):  # as if our check had let `../../escape.png` through
        from pathlib import PurePosixPath

        p = plan(tf, path)
        p.files = [(m, PurePosixPath("../../escape.png")) for m, _ in p.files]
        return p

    monkeypatch.setattr(archives, "_plan_tar", unchecked)
    with pytest.raises(UnsafeArchiveError, match="refused by tarfile's data filter"):
        archives.safe_extract(tmp_path / "evil.tar", tmp_path / "out2", progress=False)
    assert not (tmp_path.parent / "escape.png").exists() and not (tmp_path / "escape.png").exists()


def test_d_fedalign_kmeans_recovers_known_clusters_numbered_by_first_appearance():
    """FedAlign's k-means (Sec. 3.3) through its wrapper: three well-separated blobs, interleaved, are found
    exactly, numbered by first appearance, with their means as centers; k is capped by the distinct points;
    the rng gives one draw, so the same rng state gives the same clustering."""
    import numpy as np

    from fedccrl_core.algorithms.fedalign import kmeans

    g = np.random.default_rng(0)
    truth = np.array([2, 0, 1] * 40)  # first appearance: blob 2, then 0, then 1
    x = np.array([[0, 0], [50, 0], [0, 50]], dtype=float)[truth] + g.normal(scale=0.5, size=(120, 2))
    rng = np.random.default_rng(5)
    labels, centers = kmeans(x, 3, rng)
    assert labels.tolist() == [0, 1, 2] * 40  # blob 2 -> 0, blob 0 -> 1, blob 1 -> 2
    assert np.allclose(centers, [x[truth == b].mean(0) for b in (2, 0, 1)])
    assert rng.bit_generator.state == (r := np.random.default_rng(5), r.integers(2**31 - 1))[0].bit_generator.state
    again, _ = kmeans(x, 3, np.random.default_rng(5))
    assert again.tolist() == labels.tolist()
    two = np.array([[1.0, 1.0]] * 5 + [[9.0, 9.0]] * 5)
    labels2, centers2 = kmeans(two, 4, np.random.default_rng(1))  # 4 asked, 2 distinct points: 2 clusters
    assert labels2.tolist() == [0] * 5 + [1] * 5 and np.allclose(centers2, [[1, 1], [9, 9]])
    dup = np.repeat(x[:2], 5, axis=0)  # 2 distinct points: at most 2 clusters, no warning
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kmeans(dup, 3, np.random.default_rng(0))[0].max() == 1


# ------------------------------------------------------------------ E. data warnings and layout errors that say why


def _imagefolder(root: Path, per_domain: dict[str, int], classes=("x", "y")) -> Path:
    import numpy as np
    from PIL import Image

    for di, (d, n) in enumerate(per_domain.items()):
        for ci, c in enumerate(classes):
            (root / d / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(np.full((8, 8, 3), (30 * di + 7 * ci + i) % 256, np.uint8)).save(
                    root / d / c / f"{i}.png"
                )
    return root


def test_e_a_domain_with_one_image_per_class_is_warned_of_at_partition_time(tmp_path, capsys):
    from fedccrl_core.data import registry
    from fedccrl_core.data.manifest import load_manifest
    from fedccrl_core.data.partition import PartitionSettings, partition

    spec = registry.get_dataset("imagefolder")
    raw = _imagefolder(tmp_path / "raw", {"art": 6, "photo": 6, "tiny": 1})
    partition(
        raw,
        tmp_path / "shards",
        spec,
        PartitionSettings(8, clients_per_domain=2, val_fraction=0.1, seed=0),
        progress=False,
    )
    err = capsys.readouterr().err
    warned = [ln for ln in err.splitlines() if ln.startswith("warning: partition:")]
    assert len(warned) == 1 and "domain 'tiny'" in warned[0] and "has 1 image(s) for 2 client(s)" in warned[0]
    assert "partition.clients_per_domain" in warned[0]
    assert load_manifest(tmp_path / "shards").to_dict()["warnings"] == [warned[0].removeprefix("warning: ")]

    raw = _imagefolder(tmp_path / "raw2", {"art": 4, "photo": 4})  # 2 images per class per client: enough
    partition(
        raw,
        tmp_path / "shards2",
        spec,
        PartitionSettings(8, clients_per_domain=2, val_fraction=0.0, seed=0),
        progress=False,
    )
    assert "warning" not in capsys.readouterr().err and "warnings" not in load_manifest(tmp_path / "shards2").to_dict()


def test_e_a_dataset_wrapped_in_two_folders_is_found_and_a_wrong_layout_says_why(tmp_path):
    from fedccrl_core.data import registry
    from fedccrl_core.data.sources import prepare_raw
    from fedccrl_core.foundation.errors import DataError

    spec = registry.get_dataset("imagefolder")
    _imagefolder(tmp_path / "src" / "export" / "mydata", {"art": 2, "photo": 2})
    rep = prepare_raw(spec, str(tmp_path / "src"), tmp_path / "raw", None, progress=False)
    assert rep["source"]["root"] == "export/mydata" and rep["domains"] == ["art", "photo"] and rep["total"] == 8

    _imagefolder(tmp_path / "one" / "mydata", {"art": 2})  # one domain: a domain folder is never stripped
    with pytest.raises(DataError, match=r"holds 1 domain folder\(s\) \(art\)"):
        prepare_raw(spec, str(tmp_path / "one"), tmp_path / "raw", None, progress=False)

    _imagefolder(tmp_path / "two" / "a" / "deep", {"art": 1})
    _imagefolder(tmp_path / "two" / "b" / "deep", {"art": 1})
    with pytest.raises(DataError) as e:
        prepare_raw(spec, str(tmp_path / "two"), tmp_path / "raw", None, progress=False)
    assert "the first file, a/deep/art/x/0.png, is 4 folder level(s) below the source" in str(e.value)
    assert "this level holds 2 (a, b)" in str(e.value)

    (tmp_path / "flat" / "cats").mkdir(parents=True)
    (tmp_path / "flat" / "cats" / "1.png").write_bytes(b"x")
    with pytest.raises(DataError, match=r"cats/1.png, is 1 folder level\(s\) below the source; add the missing"):
        prepare_raw(spec, str(tmp_path / "flat"), tmp_path / "raw", None, progress=False)
    assert sorted(os.listdir(tmp_path / "raw")) == ["art", "photo"] and temps(tmp_path) == []  # the good run's


# ------------------------------------------------------------------ F. found by `make chaos` (scripts/chaos.py)


def test_f_a_failed_write_leaves_no_folder_it_created(tmp_path):
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError):
        with fsio.atomic_file(tmp_path / "a" / "b" / "f.json", "w") as f:
            f.write("{")
            raise RuntimeError("the body failed")
    assert not (tmp_path / "a").exists()
    with pytest.raises(RuntimeError):
        with fsio.atomic_dir(tmp_path / "kept" / "c" / "plots"):
            raise RuntimeError("the body failed")
    assert sorted(os.listdir(tmp_path)) == ["kept"] and os.listdir(tmp_path / "kept") == []  # its own only


def test_f_a_new_mlflow_store_is_created_whole(tmp_path, monkeypatch):
    """MLflow migrates a new SQLite store in many steps; kill -9 among them left a store that failed every
    rerun. The store is now built in a scratch folder and linked into place; a dead process's scratch folder
    is removed by the next run."""
    import sqlite3

    from fedccrl_pipeline.mlflow_store import mlflow_module

    stale = tmp_path / ".new.db.tmp-999999999-0123abcd"  # a creation killed midway (no such pid)
    stale.mkdir()
    (stale / "new.db").write_bytes(b"half a migration")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'new.db'}")
    mlflow_module()
    assert not stale.exists() and sorted(os.listdir(tmp_path)) == ["new.db"]
    with sqlite3.connect(tmp_path / "new.db") as con:
        tables = {t for (t,) in con.execute("select name from sqlite_master where type = 'table'")}
    assert {"experiments", "runs", "metrics", "alembic_version"} <= tables
    assert not [t for t in tables if t.startswith("_alembic_tmp")]


def test_f_a_resumed_run_logs_the_rounds_it_lacks(tmp_path):
    """A worker checkpoints a round before the parent has logged it: kill -9 between the two, and the
    resumed run lacked that round in MLflow. At completion it logs what it lacks, and only that."""
    from fedccrl_core.federation.round_record import RoundRecord
    from fedccrl_pipeline.tracking import ChildRun, parent_run_id

    def rec(rnd: int, acc: float) -> RoundRecord:
        fields = dict(val_acc=acc, val_pred_classes=2, seconds=1.0, bytes_up=1, bytes_down=1)
        return RoundRecord(round=rnd, target_acc=acc, **fields)

    parent = parent_run_id("bf", "k", {})
    first = ChildRun("bf", parent, "r", {}, {})
    first.log_round(rec(2, 0.5))  # round 1 never reached MLflow
    resumed = ChildRun("bf", parent, "r", {}, {}, resume_run_id=first.run_id)
    history = [
        rec(1, 0.25),
        rec(2, 0.5),
        rec(3, 0.75),
    ]  # history.json's, as fedccrl_core/federation/history.py reads it
    resumed.log_round(history[2])
    assert resumed.backfill(history) == [1]
    steps = sorted((m.step, m.value) for m in resumed.client.get_metric_history(first.run_id, "target_acc"))
    assert steps == [(1, 0.25), (2, 0.5), (3, 0.75)]
    fresh = ChildRun("bf", parent, "f", {}, {})
    for r in history:
        fresh.log_round(r)
    assert fresh.backfill(history) == []


def test_f_a_run_left_running_by_a_dead_process_is_marked_killed(tmp_path, capsys):
    """kill -9 leaves the run RUNNING; a rerun that cannot continue it (a new configuration) closes it."""
    from fedccrl_pipeline.orphan_runs import OWNER_TAG
    from fedccrl_pipeline.tracking import ChildRun, parent_run_id

    tags = {"held_out": "photo", "algorithm": "fedavg", "seed": "0"}
    parent = parent_run_id("orph", "k", {})
    dead = ChildRun("orph", parent, "r", {}, tags)
    dead.client.set_tag(dead.run_id, OWNER_TAG, f"{__import__('socket').gethostname()}:999999999:{int(time.time())}")
    other = ChildRun("orph", parent, "o", {}, {**tags, "held_out": "sketch"})  # another training: untouched
    alive = ChildRun("orph", parent, "a", {}, tags)  # this process: alive, untouched by the next one
    rerun = ChildRun("orph", parent, "r2", {}, tags)
    status = {r: rerun.client.get_run(r.run_id).info.status for r in (dead, other, alive, rerun)}
    assert status == {dead: "KILLED", other: "RUNNING", alive: "RUNNING", rerun: "RUNNING"}
    assert f"MLflow run {dead.run_id} was left RUNNING by process 999999999" in capsys.readouterr().err


# ---- process tricks, read from the syntax tree of the product code ------------------------------------------------
BANNED_CALLS = {  # a fork after imports, a priority change, an exit past Python's own teardown
    "os.fork": "forks",
    "os.forkpty": "forks",
    "os.nice": "changes the priority",
    "os._exit": "exits past Python's teardown",
    "atexit._run_exitfuncs": "runs the exit handlers by hand",
}
OWN_PACKAGES = set(TOP)  # import names: a private name of one of these is ours to use


def _imported(tree: ast.Module) -> dict[str, str]:
    """Each name an import binds -> the dotted name it stands for (`import os as o`: o -> os; `from os import
    _exit`: _exit -> os._exit); a relative import is ours (a leading dot)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            for a in node.names:
                names[a.asname or a.name] = f"{module}.{a.name}"
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return names.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, names)
        return f"{base}.{node.attr}" if base else None
    return None


# Module attributes a library documents as its settings, to be assigned by its users.
PUBLIC_SETTINGS = {
    "torch.backends.cudnn.benchmark": "cuDNN autotuning (fedccrl_core/foundation/fastpath.py)",
}


def _imported_module(node: ast.AST, names: dict[str, str]) -> str | None:
    """The dotted module name `node` stands for when it is a name an import bound, or an attribute chain on one
    (`fastpath`, `augmix`, `torch.backends.cudnn`); None for any other object (a local, `self`, a call's result)."""
    base = node
    while isinstance(base, ast.Attribute):
        base = base.value
    if isinstance(base, ast.Name) and base.id in names:
        return _dotted(node, names)
    return None


def _own(node: ast.AST) -> bool:
    """`self` or `cls`: an object's own attributes are its own business."""
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _function_like(value: ast.AST, defs: set[str], factories: set[str], names: dict[str, str]) -> bool:
    """An expression that makes a function: a lambda, a function of the module, a call of a function of the module
    that returns a function it defines, functools.partial, types.MethodType, a descriptor's __get__."""
    if isinstance(value, ast.Lambda) or (isinstance(value, ast.Name) and value.id in defs):
        return True
    if isinstance(value, ast.Call):
        func = _dotted(value.func, names) or ""
        return (
            (isinstance(value.func, ast.Name) and value.func.id in factories)
            or func in ("functools.partial", "types.MethodType")
            or (isinstance(value.func, ast.Attribute) and value.func.attr == "__get__")
        )
    return False


def _returns_a_function_it_defines(fn: ast.FunctionDef) -> bool:
    inner = {n.name for n in ast.walk(fn) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n is not fn}
    return any(
        isinstance(n, ast.Return)
        and (isinstance(n.value, ast.Lambda) or (isinstance(n.value, ast.Name) and n.value.id in inner))
        for n in ast.walk(fn)
    )


def method_names(sources: list[str]) -> set[str]:
    """Every name a class of these modules defines a method under (`forward`, `train`, `save`, ...)."""
    return {
        item.name
        for src in sources
        for node in ast.walk(ast.parse(src))
        if isinstance(node, ast.ClassDef)
        for item in node.body
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def process_tricks(source: str, methods: set[str] = frozenset()) -> list[str]:
    """`line: what` for each process trick in a module's source, read from its syntax tree: a banned call
    (BANNED_CALLS), a multiprocessing "fork" start method, a `preexec_fn=` (code run between fork and exec in a
    threaded process), a private attribute of another object or package read, assigned or imported (`self._x`
    and `cls._x` are an object's own; a private name of our own packages may be imported), a stand-in module
    (types.ModuleType, or a SimpleNamespace with a __name__) handed to a library in place of its own, and a method of
    another object replaced (`obj.forward = ...` or `setattr(obj, "forward", ...)` with a function, where
    `forward` is a method name of `methods` or of this module's classes)."""
    tree = ast.parse(source)
    names = _imported(tree)
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    defs = {f.name for f in functions}
    factories = {f.name for f in functions if _returns_a_function_it_defines(f)}
    methods = set(methods) | method_names([source])
    found = []

    def replaced(owner: ast.AST, attr: str, value: ast.AST | None, line: int) -> None:
        if _own(owner):
            return
        if _private(attr):
            found.append(f"{line}: assigns the private attribute {attr} of {ast.unparse(owner)}")
        elif attr in methods and value is not None and _function_like(value, defs, factories, names):
            found.append(f"{line}: replaces the method {attr} of {ast.unparse(owner)}")

    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Call):
            func = _dotted(node.func, names) or ""
            if func in BANNED_CALLS:
                found.append(f"{line}: {func} {BANNED_CALLS[func]}")
            method = [a.value for a in node.args[:1] if isinstance(a, ast.Constant)]
            method += [k.value.value for k in node.keywords if k.arg == "method" and isinstance(k.value, ast.Constant)]
            if func.rsplit(".", 1)[-1] in ("get_context", "set_start_method") and "fork" in method:
                found.append(f"{line}: {func}('fork') forks")
            if any(k.arg == "preexec_fn" for k in node.keywords):
                found.append(f"{line}: preexec_fn= runs code between fork and exec")
            if func == "setattr" and len(node.args) == 3 and isinstance(node.args[1], ast.Constant):
                replaced(node.args[0], str(node.args[1].value), node.args[2], line)
            if func in ("getattr", "hasattr") and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                if _private(str(node.args[1].value)) and not _own(node.args[0]):
                    found.append(
                        f"{line}: reads the private attribute {node.args[1].value} of {ast.unparse(node.args[0])}"
                    )
            if func == "types.ModuleType" or (
                func == "types.SimpleNamespace" and any(k.arg == "__name__" for k in node.keywords)
            ):
                found.append(f"{line}: builds a stand-in module")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute):
                        replaced(t.value, t.attr, node.value, line)
                        module = _imported_module(t.value, names) if isinstance(t.ctx, ast.Store) else None
                        if module and f"{module}.{t.attr}" not in PUBLIC_SETTINGS:
                            found.append(f"{line}: assigns the attribute {t.attr} of the module {module}")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            if _private(node.attr) and not _own(node.value):
                found.append(f"{line}: reads the private attribute {ast.unparse(node)}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom) and node.level:
                continue  # relative: ours
            module = node.module if isinstance(node, ast.ImportFrom) else None
            dotted = [f"{module}.{a.name}" if module else a.name for a in node.names]
            for d in dotted:
                if d.split(".")[0] not in OWN_PACKAGES and any(_private(part) for part in d.split(".")):
                    found.append(f"{line}: imports the private name {d}")
        elif isinstance(node, ast.Name) and node.id == "mlflow_clock":
            found.append(f"{line}: times an MLflow call")
    return sorted(set(found), key=lambda f: int(f.split(":")[0]))


def product_sources() -> dict[Path, str]:
    """Every product module: the packages pyproject.toml declares (benchmarks included) and the scripts, but for
    scripts/chaos_hooks, whose purpose is to inject faults into a run under test (scripts/chaos.py)."""
    files = [f for folder in TOP.values() for f in (REPO / folder).rglob("*.py")]
    files += [f for f in (REPO / "scripts").rglob("*.py") if "chaos_hooks" not in f.parts]
    return {f: f.read_text() for f in sorted(set(files))}


def test_no_process_tricks_in_product_code():
    """Each stage is a plain process: no fork after imports, no priority change, no exit past Python's own
    teardown, no code between fork and exec, no private attribute of another package, no method replaced on an
    object, no MLflow call timed in product code."""
    sources = product_sources()
    assert {"fedccrl_core", "benchmarks", "scripts"} <= {f.relative_to(REPO).parts[0] for f in sources}
    methods = method_names(list(sources.values()))
    found = [f"{f.relative_to(REPO)}:{hit}" for f, src in sources.items() for hit in process_tricks(src, methods)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        "import os\nos.fork()",
        "from os import forkpty\nforkpty()",
        "import os as o\no.nice(5)",
        "import os\nos._exit(0)",
        "import atexit\natexit._run_exitfuncs()",
        "import multiprocessing as mp\nmp.get_context('fork')",
        "import multiprocessing\nmultiprocessing.set_start_method(method='fork')",
        "import subprocess\nsubprocess.Popen(['x'], preexec_fn=None)",
        "from benchmarks import children\nchildren.run(['x'], preexec_fn=print)",
        "obj._private = 1",
        "a.b._c += 1",
        "x = concurrent.futures.process._RemoteTraceback",
        "from concurrent.futures.process import _RemoteTraceback",
        "import mlflow\nmlflow.store._x",
        "bn.forward = lambda x: x",
        "def f(x):\n    return x\nbn.forward = f",
        "import types\nbn.forward = types.MethodType(lambda self, x: x, bn)",
        "import functools\nbn.forward = functools.partial(print, 1)",
        "def wrap(fn):\n    def run(*a):\n        return fn(*a)\n    return run\ntr.train = wrap(tr.train)",
        "setattr(bn, 'forward', lambda x: x)",
        "setattr(obj, '_cache', {})",
        "getattr(exc, '_tb', '')",
        "import types\nflavor = types.SimpleNamespace(__name__='mlflow.pyfunc', save_model=print)",
        "import types\nfake = types.ModuleType('mlflow.pyfunc')",
        "with mlflow_clock():\n    pass",
        "from fedccrl_core.foundation import fastpath\nfastpath.enabled = print",
        "def go():\n    from fedccrl_core.augment import augmix\n\n    augmix.COMPACT_DEVICES = ()",
        "import fedccrl_core.augment.augmix\nfedccrl_core.augment.augmix.COMPACT_DEVICES += ('cuda',)",
    ],
)
def test_the_process_trick_checker_sees_each_banned_form(snippet):
    """A `forward` or `train` method is declared by product classes: here by the `methods` argument."""
    assert process_tricks(snippet, {"forward", "train"}), snippet


def test_the_process_trick_checker_lets_plain_code_pass():
    snippet = """
import functools
import multiprocessing as mp
import subprocess
import types

import torch

from fedccrl_core.foundation.procs import _private_helper


class Layer:
    def forward(self, x):
        return x

    def reset(self):
        self._x = 1
        self.forward = functools.partial(print)
        cls = type(self)
        cls._count = 2
        return self._x, self.__class__, x.__dict__


def build(parent, name, module, state):
    setattr(parent, name, module)  # a child module replaced through nn.Module's own setattr
    state.forward_count = 3
    state.train = None
    getattr(state, "train", None)
    options = types.SimpleNamespace(a=1)
    mp.get_context("spawn")
    subprocess.Popen(["x"], start_new_session=True)
    job.flower_train = functools.partial(print, 1)  # a field that holds a callable: no method of a class
    torch.backends.cudnn.benchmark = True  # a library's documented setting (PUBLIC_SETTINGS)
"""
    assert process_tricks(snippet, {"train"}) == []


def test_the_fedccrl_command_keeps_exit_codes_and_errors(tmp_path):
    """The console script (fedccrl_pipeline.cli:entry): a stage's known error is its `error:` line and exit code 2; --help 0."""
    fedccrl = Path(sys.executable).parent / "fedccrl"
    p = subprocess.run(
        [str(fedccrl), "pools", "--shards", str(tmp_path / "nowhere"), "--out", str(tmp_path / "p")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stderr.startswith("error: params.yaml: "), p.stderr  # no params.yaml in tmp_path
    p = subprocess.run([str(fedccrl), "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and all(f"  {stage} " in p.stdout for stage in ("pools", "evaluate", "export", "figures"))
    assert "publish" not in p.stdout
