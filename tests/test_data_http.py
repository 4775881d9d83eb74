"""The real URL path: archives served over HTTP on 127.0.0.1 (PACS 128 from ../shared, and tiny zips)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import threading
import zipfile
from pathlib import Path

import pytest
from PIL import Image

from fedccrl_core.data import registry
from fedccrl_core.data.http import download_url
from fedccrl_core.data.registry import DatasetSpec
from fedccrl_core.data.sources import prepare_raw
from fedccrl_core.foundation.errors import ChecksumError, DataError

PACS_128_SHA256 = "0239f4e21fc401b5da9ccc497cdafe8064b81c9e918613c7ebba92b72547f578"
TINY = DatasetSpec(
    name="tiny",
    domains=("a", "b"),
    classes=("x", "y"),
    domain_counts=(2, 2),
    total=4,
    sources=(),
    image_size=16,
    backbone="small_cnn",
    pretrained="none",
)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class _Behaviour:
    """Per-path misbehaviour of the test server: drop midway, fail N times, or send HTML."""

    def __init__(self):
        self.drop: set[str] = set()
        self.fail_first: dict[str, int] = {}
        self.html: set[str] = set()
        self.requests: list[str] = []


def _handler(directory: Path, behaviour: _Behaviour):
    class Handler(_Quiet):
        def do_GET(self):
            name = self.path.lstrip("/")
            behaviour.requests.append(name)
            if behaviour.fail_first.get(name, 0) > 0:
                behaviour.fail_first[name] -= 1
                self.send_error(503, "try again")
                return
            if name in behaviour.html:
                body = b"<html><body>Google Drive can't scan this file for viruses</body></html>"
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if name in behaviour.drop:
                data = (directory / name).read_bytes()
                self.send_response(200)
                self.send_header("Content-Type", "application/zip")
                self.send_header("Content-Length", str(len(data)))  # promise everything ...
                self.end_headers()
                self.wfile.write(data[: len(data) // 3])  # ... send a third, hang up
                self.wfile.flush()
                self.close_connection = True
                return
            super().do_GET()

    return functools.partial(Handler, directory=str(directory))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    behaviour = _Behaviour()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(root, behaviour))
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}", behaviour
    httpd.shutdown()
    httpd.server_close()


def _leftovers(parent: Path) -> list[str]:
    return sorted(os.listdir(parent)) if parent.exists() else []


# ------------------------------------------------------------------ PACS 128 over HTTP (once per module)
_PACS_RUN: dict = {}


@pytest.fixture
def pacs_over_http(pacs128, server, tmp_path_factory):
    """Download + extract + validate PACS 128 from the local server ONCE for this module."""
    if not _PACS_RUN:
        root, base, _ = server
        link = root / "pacs_128.zip"
        if not link.exists():
            link.symlink_to(pacs128)
        work = tmp_path_factory.mktemp("pacs_http")
        rep = prepare_raw(
            registry.get_dataset("pacs"),
            f"{base}/pacs_128.zip",
            work / "raw",
            work / "report.json",
            sha256=PACS_128_SHA256,
            timeout_s=30,
            retries=0,
            progress=False,
        )
        _PACS_RUN.update(report=rep, work=work)
    return _PACS_RUN


@pytest.mark.shared
def test_pacs_url_with_correct_sha256(pacs_over_http):
    rep, work = pacs_over_http["report"], pacs_over_http["work"]
    assert rep["status"] == "ok" and rep["total"] == 9991 and rep["n_bad"] == 0
    assert rep["domains"] == ["photo", "art_painting", "cartoon", "sketch"]
    assert rep["domain_totals"] == {"photo": 1670, "art_painting": 2048, "cartoon": 2344, "sketch": 3929}
    arch = rep["source"]["archives"][0]
    assert arch["sha256"] == PACS_128_SHA256 and arch["verified"] and arch["known_as"] == "pacs_128.zip"
    assert rep["source"]["root"] == "PACS"
    raw = work / "raw"
    files = [p for p in raw.rglob("*") if p.is_file()]
    assert len(files) == 9991
    assert {p.relative_to(raw).parts[0] for p in files} == set(rep["domains"])
    assert all(len(p.relative_to(raw).parts) == 3 and p.suffix in (".jpg", ".png") for p in files)
    assert sum(1 for p in (raw / "sketch" / "person").iterdir()) == rep["counts"]["sketch"]["person"]
    assert _leftovers(work) == ["raw", "report.json"]


@pytest.mark.shared
def test_pacs_url_with_wrong_sha256_leaves_nothing(pacs_over_http, server, tmp_path):
    _, base, _ = server
    out = tmp_path / "data" / "raw"
    with pytest.raises(ChecksumError, match=r"sha256 mismatch.*expected 1{64}, got " + PACS_128_SHA256):
        prepare_raw(
            registry.get_dataset("pacs"),
            f"{base}/pacs_128.zip",
            out,
            tmp_path / "data" / "r.json",
            sha256="1" * 64,
            retries=0,
            progress=False,
        )
    assert _leftovers(tmp_path / "data") == []


@pytest.mark.shared
def test_pacs_connection_dropped_midway_fails_and_leaves_nothing(pacs_over_http, pacs128, server, tmp_path, capsys):
    _root, base, behaviour = server
    behaviour.drop.add("pacs_128.zip")
    size = pacs128.stat().st_size
    try:
        with pytest.raises(
            DataError,
            match=rf"download failed after 2 attempt\(s\): connection dropped: "
            rf"received {size // 3} of {size} bytes",
        ):
            prepare_raw(
                registry.get_dataset("pacs"),
                f"{base}/pacs_128.zip",
                tmp_path / "data" / "raw",
                tmp_path / "data" / "r.json",
                sha256=None,
                retries=1,
                backoff_s=0.01,
                progress=True,
            )
    finally:
        behaviour.drop.discard("pacs_128.zip")
    assert _leftovers(tmp_path / "data") == []
    assert "retrying" in capsys.readouterr().err


# ------------------------------------------------------------------ tiny archives over HTTP
def _tiny_zip(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for d in TINY.domains:
            for c in TINY.classes:
                for i in range(1):
                    img = Path(path.parent / f"_{d}{c}{i}.png")
                    Image.new("RGB", (8, 8), (len(d) * 50, len(c) * 40, i)).save(img)
                    z.write(img, f"tiny-1.0/{d}/{c}/{i}.png")
                    img.unlink()
    return path


def test_url_without_known_sha256_warns_and_reports_it(server, tmp_path, capsys):
    root, base, _ = server
    archive = _tiny_zip(root / "tiny.zip")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    rep = prepare_raw(TINY, f"{base}/tiny.zip", tmp_path / "raw", tmp_path / "r.json", progress=False)
    err = capsys.readouterr().err
    assert f"sha256 is {digest}" in err and "dataset.sha256" in err
    assert rep["source"]["archives"][0]["sha256"] == digest and rep["source"]["archives"][0]["verified"] is False
    assert any(digest in w for w in rep["warnings"]) and rep["total"] == 4


def test_registry_source_from_a_mirror(server, tmp_path, monkeypatch):
    """FEDCCRL_DATASET_MIRROR: `registry` fetches <base>/<the registry's file name>, with its sha256 checked."""
    import dataclasses

    from fedccrl_core.data.sources import MIRROR_ENV

    root, base, behaviour = server
    digest = hashlib.sha256(_tiny_zip(root / "tiny-mirror.zip").read_bytes()).hexdigest()
    spec = dataclasses.replace(
        TINY, sources=(registry.Source("https://unreachable.invalid/t.zip", digest, None, "tiny-mirror.zip"),)
    )
    monkeypatch.setenv(MIRROR_ENV, base + "/")
    rep = prepare_raw(spec, "registry", tmp_path / "raw", tmp_path / "r.json", progress=False)
    arch = rep["source"]["archives"][0]
    assert arch["url"] == f"{base}/tiny-mirror.zip" and arch["verified"] and rep["total"] == 4
    assert behaviour.requests[-1] == "tiny-mirror.zip"
    bad = dataclasses.replace(spec, sources=(dataclasses.replace(spec.sources[0], sha256="0" * 64),))
    with pytest.raises(ChecksumError):  # the mirror's file is checked as the URL's
        prepare_raw(bad, "registry", tmp_path / "raw2", None, retries=0, progress=False)
    monkeypatch.setenv(MIRROR_ENV, "/srv/datasets")
    with pytest.raises(DataError, match=f"{MIRROR_ENV}='/srv/datasets': not an http"):
        prepare_raw(spec, "registry", tmp_path / "raw3", None, progress=False)


def test_transient_server_errors_are_retried(server, tmp_path):
    root, base, behaviour = server
    _tiny_zip(root / "flaky.zip")
    behaviour.fail_first["flaky.zip"] = 2
    n0 = behaviour.requests.count("flaky.zip")
    digest = download_url(f"{base}/flaky.zip", tmp_path / "f.zip", retries=3, backoff_s=0.01, progress=False)
    assert behaviour.requests.count("flaky.zip") - n0 == 3
    assert digest == hashlib.sha256((root / "flaky.zip").read_bytes()).hexdigest()


def test_not_found_html_and_refused_fail_clearly(server, tmp_path):
    root, base, behaviour = server
    with pytest.raises(DataError, match=r"missing\.zip: HTTP 404"):
        download_url(f"{base}/missing.zip", tmp_path / "m.zip", retries=3, backoff_s=0.01, progress=False)
    assert behaviour.requests.count("missing.zip") == 1  # a 404 is not retried
    _tiny_zip(root / "page.zip")
    behaviour.html.add("page.zip")
    with pytest.raises(DataError, match="HTML page, not an archive"):
        download_url(f"{base}/page.zip", tmp_path / "p.zip", retries=0, progress=False)
    with pytest.raises(DataError, match=r"after 1 attempt\(s\): cannot connect"):
        download_url("http://127.0.0.1:9/x.zip", tmp_path / "r.zip", retries=0, timeout_s=5, progress=False)
    assert _leftovers(tmp_path) == []
