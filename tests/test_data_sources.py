"""The download stage on local sources: folders, zip / tar.gz archives, unsafe archives, validation."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import stat
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedccrl_core.data import registry
from fedccrl_core.data.archives import safe_extract
from fedccrl_core.data.registry import DatasetSpec
from fedccrl_core.data.sources import prepare_raw
from fedccrl_core.foundation.errors import ChecksumError, DataError, UnsafeArchiveError

TINY = DatasetSpec(
    name="tiny",
    domains=("a", "b"),
    classes=("x", "y"),
    domain_counts=(6, 6),
    total=12,
    sources=(),
    image_size=16,
    backbone="small_cnn",
    pretrained="none",
)


def make_tree(root: Path, domains=("a", "b"), classes=("x", "y"), n=3) -> Path:
    """root/<domain>/<class>/<i>.png with distinct solid colours."""
    for di, d in enumerate(domains):
        for ci, c in enumerate(classes):
            (root / d / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.new("RGB", (8, 8), (40 * di, 60 * ci, 20 * i)).save(root / d / c / f"{i}.png")
    return root


def zip_dir(src: Path, archive: Path, prefix: str = "TINY") -> Path:
    with zipfile.ZipFile(archive, "w") as z:
        for p in sorted(src.rglob("*")):
            if p.is_file():
                z.write(p, f"{prefix}/{p.relative_to(src).as_posix()}")
    return archive


def run(tmp_path: Path, source, spec=TINY, **kw):
    out, report = tmp_path / "work" / "raw", tmp_path / "work" / "report.json"
    kw.setdefault("progress", False)
    return prepare_raw(spec, str(source), out, report, **kw), out, report


def assert_nothing_left(tmp_path: Path):
    work = tmp_path / "work"
    left = sorted(os.listdir(work)) if work.exists() else []
    assert left == [], f"left behind: {left}"


def test_local_folder(tmp_path):
    src = make_tree(tmp_path / "src" / "wrapper")
    rep, out, report = run(tmp_path, tmp_path / "src")
    assert sorted(os.listdir(out)) == ["a", "b"]
    assert sorted(os.listdir(out / "a" / "x")) == ["0.png", "1.png", "2.png"]
    assert (src / "a" / "x" / "0.png").is_file()  # a folder source is copied, not moved
    on_disk = json.loads(report.read_text())
    assert on_disk == rep and rep["status"] == "ok" and rep["source"]["kind"] == "folder"
    assert rep["counts"] == {"a": {"x": 3, "y": 3}, "b": {"x": 3, "y": 3}} and rep["total"] == 12
    assert rep["source"]["root"] == "wrapper" and rep["n_bad"] == 0 and len(rep["tree_sha256"]) == 64
    assert sorted(os.listdir(tmp_path / "work")) == ["raw", "report.json"]


def test_local_zip_with_sha256_and_rerun_replaces_out(tmp_path):
    archive = zip_dir(make_tree(tmp_path / "src"), tmp_path / "tiny.zip")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    rep, out, _ = run(tmp_path, archive, sha256=digest)
    arch = rep["source"]["archives"][0]
    assert rep["source"]["kind"] == "archive" and arch["sha256"] == digest and arch["verified"] is True
    assert rep["sha256"] == digest
    (out / "stale.txt").write_text("from an old run")
    rep2, out, _ = run(tmp_path, archive)  # no sha256: computed, not verified
    assert not (out / "stale.txt").exists() and rep2["source"]["archives"][0]["verified"] is False
    assert rep2["tree_sha256"] == rep["tree_sha256"]


def test_local_tar_gz(tmp_path):
    src = make_tree(tmp_path / "src")
    archive = tmp_path / "tiny.tar.gz"
    with tarfile.open(archive, "w:gz") as t:
        t.add(src, arcname="data/TINY")
    rep, out, _ = run(tmp_path, archive)
    assert rep["source"]["root"] == "data/TINY" and rep["total"] == 12
    assert (
        np.asarray(Image.open(out / "b" / "y" / "2.png")).tolist()
        == np.asarray(Image.open(src / "b" / "y" / "2.png")).tolist()
    )


def test_interrupted_run_leaves_old_out_and_no_temp(tmp_path, monkeypatch):
    src = make_tree(tmp_path / "src")
    _, out, _ = run(tmp_path, src)
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("fedccrl_core.data.validate.validate_tree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, zip_dir(src, tmp_path / "t.zip"))
    assert sorted(os.listdir(tmp_path / "work")) == ["raw", "report.json"]  # the earlier complete run only
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before


def test_wrong_sha256_is_refused_before_extraction(tmp_path):
    archive = tmp_path / "evil.zip"
    with zipfile.ZipFile(archive, "w") as z:  # unsafe AND the wrong hash:
        z.writestr("../evil.png", b"x")  # the checksum must win
    with pytest.raises(ChecksumError, match="sha256 mismatch.*nothing was extracted"):
        run(tmp_path, archive, sha256="0" * 64)
    assert_nothing_left(tmp_path)
    assert not (tmp_path / "evil.png").exists()


# ------------------------------------------------------------------ unsafe archives
def _zip_symlink(z: zipfile.ZipFile, name: str, target: str) -> None:
    info = zipfile.ZipInfo(name)
    info.create_system = 3
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    z.writestr(info, target)


def _tar_add(t: tarfile.TarFile, name: str, data: bytes = b"x", **attrs) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data) if attrs.get("type", tarfile.REGTYPE) == tarfile.REGTYPE else 0
    for k, v in attrs.items():
        setattr(info, k, v)
    t.addfile(info, io.BytesIO(data) if info.size else None)


UNSAFE = {
    "zip-slip": ("zip", lambda z: z.writestr("TINY/../../evil.png", b"x"), "TINY/../../evil.png"),
    "zip-absolute": ("zip", lambda z: z.writestr("/tmp/evil-abs.png", b"x"), "/tmp/evil-abs.png"),
    "zip-backslash": ("zip", lambda z: z.writestr("..\\evil.png", b"x"), "..\\evil.png"),
    "zip-symlink": (
        "zip",
        lambda z: _zip_symlink(z, "TINY/a/x/link.png", "../../../../etc/passwd"),
        "TINY/a/x/link.png",
    ),
    "tar-slip": ("tar", lambda t: _tar_add(t, "../evil.png"), "../evil.png"),
    "tar-absolute": ("tar", lambda t: _tar_add(t, "/tmp/evil-abs.png"), "/tmp/evil-abs.png"),
    "tar-symlink": (
        "tar",
        lambda t: _tar_add(t, "TINY/a/x/link.png", type=tarfile.SYMTYPE, linkname="/etc/passwd"),
        "TINY/a/x/link.png",
    ),
    "tar-hardlink": (
        "tar",
        lambda t: _tar_add(t, "TINY/a/x/hl.png", type=tarfile.LNKTYPE, linkname="../outside.png"),
        "TINY/a/x/hl.png",
    ),
    "tar-device": (
        "tar",
        lambda t: _tar_add(t, "TINY/a/x/dev", type=tarfile.CHRTYPE, devmajor=1, devminor=3),
        "TINY/a/x/dev",
    ),
}


@pytest.mark.parametrize("case", sorted(UNSAFE))
def test_unsafe_archives_are_rejected_naming_the_member(tmp_path, case):
    kind, add, member = UNSAFE[case]
    src = make_tree(tmp_path / "src")
    archive = tmp_path / ("bad.zip" if kind == "zip" else "bad.tar.gz")
    if kind == "zip":
        zip_dir(src, archive)
        with zipfile.ZipFile(archive, "a") as z:
            add(z)
    else:
        with tarfile.open(archive, "w:gz") as t:
            t.add(src, arcname="TINY")
            add(t)
    with pytest.raises(UnsafeArchiveError, match=re.escape(repr(member))):
        run(tmp_path, archive)
    assert_nothing_left(tmp_path)
    assert not (tmp_path / "evil.png").exists() and not Path("/tmp/evil-abs.png").exists()


def test_links_inside_the_archive_become_copies(tmp_path):
    src = make_tree(tmp_path / "src")
    archive = tmp_path / "links.tar"
    with tarfile.open(archive, "w") as t:
        t.add(src, arcname="TINY")
        _tar_add(t, "TINY/a/x/sym.png", type=tarfile.SYMTYPE, linkname="0.png")
    spec = dataclasses.replace(TINY, domain_counts=(7, 6), total=13)
    _rep, out, _ = run(tmp_path, archive, spec=spec)
    link = out / "a" / "x" / "sym.png"
    assert link.is_file() and not link.is_symlink()
    assert link.read_bytes() == (src / "a" / "x" / "0.png").read_bytes()


def test_safe_extract_refuses_to_overwrite(tmp_path):
    a = tmp_path / "a.zip"
    with zipfile.ZipFile(a, "w") as z:
        z.writestr("x/1.png", b"1")
    safe_extract(a, tmp_path / "dest", progress=False)
    with pytest.raises(DataError, match="would overwrite"):
        safe_extract(a, tmp_path / "dest", progress=False)


# ------------------------------------------------------------------ validation
def _add_bad_files(root: Path) -> None:
    good = io.BytesIO()
    Image.new("RGB", (32, 32), (1, 2, 3)).save(good, format="JPEG")
    (root / "a" / "x" / "corrupt.jpg").write_bytes(good.getvalue()[:150])
    (root / "a" / "x" / "empty.png").write_bytes(b"")
    (root / "a" / "y" / "readme.txt").write_text("notes")
    (root / "a" / "y" / ".DS_Store").write_bytes(b"\x00")  # hidden: ignored, not bad


def test_bad_files_are_reported_by_name(tmp_path):
    src = make_tree(tmp_path / "src")
    _add_bad_files(src)
    spec = dataclasses.replace(TINY, domain_counts=(9, 6), total=15)  # bad files count toward the count
    rep, out, report = run(tmp_path, src, spec=spec, max_bad_fraction=0.25)
    bad = {b["path"]: b["reason"] for b in json.loads(report.read_text())["bad"]}
    assert set(bad) == {"a/x/corrupt.jpg", "a/x/empty.png", "a/y/readme.txt"}
    assert "truncated" in bad["a/x/corrupt.jpg"] or "corrupt" in bad["a/x/corrupt.jpg"]
    assert bad["a/x/empty.png"] == "zero-byte file" and "not an image" in bad["a/y/readme.txt"]
    assert rep["n_bad"] == 3 and rep["bad_fraction"] == pytest.approx(3 / 15, abs=1e-6)
    assert {"path": "a/y/.DS_Store", "reason": "hidden or system file"} in rep["ignored"]
    assert (out / "a" / "x" / "empty.png").exists()  # raw mirrors the source


def test_too_many_bad_files_fail(tmp_path):
    src = make_tree(tmp_path / "src")
    _add_bad_files(src)
    spec = dataclasses.replace(TINY, domain_counts=(9, 6), total=15)
    with pytest.raises(DataError, match=r"3 of 15 images are unreadable .*max_bad_fraction.*a/x/corrupt\.jpg"):
        run(tmp_path, src, spec=spec, max_bad_fraction=0.1)
    assert not (tmp_path / "work" / "raw").exists()
    failed = json.loads((tmp_path / "work" / "report.json").read_text())
    assert failed["status"] == "failed" and len(failed["bad"]) == 3
    assert sorted(os.listdir(tmp_path / "work")) == ["report.json"]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda r: shutil.rmtree(r / "b"), r"domain 'b' is missing"),
        (lambda r: shutil.rmtree(r / "b" / "y"), r"domain 'b': class 'y' is missing"),
        (lambda r: (r / "b" / "y" / "1.png").unlink(), r"domain 'b' has 5 images, expected 6"),
        (lambda r: make_tree(r, domains=("b",), classes=("z",), n=1), r"domain 'b': unexpected class folder 'z'"),
    ],
)
def test_layout_and_count_errors_name_the_culprit(tmp_path, damage, message):
    src = make_tree(tmp_path / "src")
    damage(src)
    archive = zip_dir(src, tmp_path / "t.zip")
    with pytest.raises(DataError, match=message):
        run(tmp_path, archive)
    assert not (tmp_path / "work" / "raw").exists()
    work = tmp_path / "work"  # fsio removes the folders a failed write created: work/ may be gone too
    assert not [p for p in (os.listdir(work) if work.exists() else []) if p.startswith(".")]


def test_registry_domain_aliases_and_order(tmp_path):
    spec = dataclasses.replace(TINY, domains=("b", "Real_World"), domain_aliases=(("Real World", "Real_World"),))
    src = make_tree(tmp_path / "src", domains=("b", "Real World"))
    rep, out, _ = run(tmp_path, src, spec=spec)
    assert rep["domains"] == ["b", "Real_World"] and (out / "Real_World" / "x" / "0.png").is_file()


def test_imagefolder_discovers_domains_and_checks_classes(tmp_path):
    spec = registry.get_dataset("imagefolder")
    src = make_tree(tmp_path / "src" / "mydata", domains=("zeta", "alpha", "mid"), n=2)
    rep, _out, _ = run(tmp_path, tmp_path / "src", spec=spec)
    assert rep["domains"] == ["alpha", "mid", "zeta"] and rep["classes"] == ["x", "y"] and rep["total"] == 12
    make_tree(src, domains=("mid",), classes=("extra",), n=1)
    with pytest.raises(DataError, match=r"domain 'alpha' lacks class\(es\) extra"):
        run(tmp_path, tmp_path / "src", spec=spec)


def test_split_file_layout_minidomainnet_style(tmp_path):
    """Dassl layout: images + splits_mini/<domain>_{train,test}.txt; only listed images are kept."""
    spec = dataclasses.replace(
        registry.get_dataset("minidomainnet"), total=4 * 2 * 2, expected_num_classes=2, sources=()
    )
    src = tmp_path / "src" / "domainnet"
    make_tree(src, domains=spec.domains, classes=("apple", "zebra"), n=3)
    (src / "splits_mini").mkdir()
    for d in spec.domains:
        (src / "splits_mini" / f"{d}_train.txt").write_text(f"{d}/apple/0.png 0\n{d}/zebra/0.png 1\n")
        (src / "splits_mini" / f"{d}_test.txt").write_text(f"{d}/apple/1.png 0\n{d}/zebra/1.png 1\n")
    (src / "real" / "zebra" / "1.png").unlink()  # listed but missing
    rep, out, _ = run(tmp_path, tmp_path / "src", spec=spec, max_bad_fraction=0.1)
    assert rep["classes"] == ["apple", "zebra"] and rep["total"] == 16
    assert {"path": "real/zebra/1.png", "reason": "listed in real_test.txt but missing from the source"} in rep["bad"]
    assert not (out / "clipart" / "apple" / "2.png").exists()  # not in any split file
    (src / "splits_mini" / "sketch_test.txt").unlink()
    with pytest.raises(DataError, match="sketch_test.txt is missing"):
        run(tmp_path, tmp_path / "src", spec=spec)


def test_bad_source_params(tmp_path):
    with pytest.raises(DataError, match="neither 'registry', an http"):
        run(tmp_path, tmp_path / "nowhere.zip")
    assert_nothing_left(tmp_path)


def test_a_registry_source_without_a_download_is_refused_naming_the_dataset(tmp_path):
    """imagefolder has no registry download: source 'registry' is a DataError naming it, and nothing is written."""
    with pytest.raises(DataError, match="no download for 'imagefolder'"):
        prepare_raw(
            registry.get_dataset("imagefolder"), "registry", tmp_path / "raw", tmp_path / "r.json", progress=False
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == []
