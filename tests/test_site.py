"""A site prepares its own data (`fedccrl site prepare`, fedccrl_core/data/site.py): the same arrays and statistics
as the central partition and pools stages for the same images, and every bad input refused (or warned of) by name,
with nothing half-written."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from fixtures import temps
from PIL import Image

from fedccrl_core.data import registry
from fedccrl_core.data.manifest import MANIFEST, client_ids, load_manifest
from fedccrl_core.data.partition import PartitionSettings, partition
from fedccrl_core.data.pools import build_pools, check_pools, load_pool, load_pool_manifest
from fedccrl_core.data.shards import load_client
from fedccrl_core.data.site import SiteSettings, prepare_site, read_class_list
from fedccrl_core.foundation.errors import DataError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = registry.get_dataset("imagefolder")
SYN = registry.get_dataset("synthetic")
CLASSES = ["bird", "cat", "dog"]
SIZE = 8
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _raw(root: Path, domains=("art", "photo"), per_class: int = 5, classes=CLASSES) -> Path:
    """root/<domain>/<class>/<i>.png: small random RGB images of varied sizes."""
    for di, d in enumerate(domains):
        for ci, c in enumerate(classes):
            (root / d / c).mkdir(parents=True)
            for i in range(per_class):
                rng = np.random.default_rng([di, ci, i])
                arr = rng.integers(0, 256, (9 + i, 11 + ci, 3), dtype=np.uint8)
                Image.fromarray(arr).save(root / d / c / f"{i}.png")
    return root


def _fed(classes=CLASSES, **kw) -> SiteSettings:
    d = dict(
        dataset="imagefolder", classes=list(classes), image_size=SIZE, val_fraction=0.2, seed=0, mean=MEAN, std=STD
    )
    d.update(kw)
    return SiteSettings(**d)  # type: ignore[arg-type]


def _prepare(images: Path, out: Path, fed: SiteSettings | None = None, domain: str = "photo", cid: str = "site_a"):
    return prepare_site(images, out, fed or _fed(), SPEC, domain, cid, "classes.txt", workers=1, progress=False)


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _nothing_written(parent: Path, out: Path) -> None:
    assert not out.exists(), f"{out} was written"
    assert temps(parent) == []


@pytest.fixture
def raw(tmp_path) -> Path:
    return _raw(tmp_path / "raw")


# ---------------------------------------------------------------- one code path with the partition and pools stages
def test_site_writes_the_central_arrays_and_statistics(raw, tmp_path):
    """The same images: every image the site stores (train or val) holds the array, label and Eq. 6-7 statistics
    the central partition + pools stages store for it; the site's split is stratified at val_fraction."""
    (raw / "photo" / "dog" / "2.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")  # skipped by both
    central = tmp_path / "central"
    partition(
        raw,
        central / "shards",
        SPEC,
        PartitionSettings(SIZE, clients_per_domain=1, val_fraction=0.2),
        workers=1,
        progress=False,
    )
    build_pools(central / "shards", central / "pools", MEAN, STD, progress=False)
    site = tmp_path / "site"
    m = _prepare(raw / "photo", site)

    cm = load_manifest(central / "shards")
    (cid,) = [c.id for c in cm.clients if c.domain == "photo"]
    c = load_client(central / "shards", cid)
    c_mu, c_sigma = load_pool(central / "pools", cid)
    s = load_client(site / "shards", "site_a")
    s_mu, s_sigma = load_pool(site / "pools", "site_a")
    c_rows = {p: (c.train_x[i], c.train_y[i], c_mu[i], c_sigma[i]) for i, p in enumerate(c.train_paths.tolist())}
    c_all = {p: (c.val_x[i], c.val_y[i]) for i, p in enumerate(c.val_paths.tolist())}
    c_all.update({p: v[:2] for p, v in c_rows.items()})
    s_paths = s.train_paths.tolist() + s.val_paths.tolist()
    assert sorted(s_paths) == sorted(c_all), "the site stores exactly the central domain's readable images"
    for i, p in enumerate(s.train_paths.tolist()):
        np.testing.assert_array_equal(s.train_x[i], c_all[p][0], err_msg=p)
        assert s.train_y[i] == c_all[p][1], p
        if p in c_rows:  # a training image in both splits: the same statistics, bit for bit
            np.testing.assert_array_equal(s_mu[i], c_rows[p][2], err_msg=p)
            np.testing.assert_array_equal(s_sigma[i], c_rows[p][3], err_msg=p)
    for i, p in enumerate(s.val_paths.tolist()):
        np.testing.assert_array_equal(s.val_x[i], c_all[p][0], err_msg=p)
    assert [k.to_dict() for k in m.skipped] == [k.to_dict() for k in cm.skipped if k.path.startswith("photo/")]
    assert m.skipped[0].path == "photo/dog/2.png"
    # stratified at val_fraction: 14 readable images (4 dogs), round(0.2 * 14) = 3 val, every class keeps training rows
    assert (s.n_train, s.n_val) == (11, 3)
    assert set(s.train_y.tolist()) == {0, 1, 2}
    assert m.clients[0].train_class_hist == np.bincount(s.train_y, minlength=3).tolist()
    # a pools manifest of the site with the pools stage's format
    pm = load_pool_manifest(site / "pools")
    assert (pm.image_size, pm.mean, pm.std, [e.id for e in pm.clients]) == (SIZE, MEAN, STD, ["site_a"])


def test_site_and_partition_write_the_same_shard_bytes(raw, tmp_path):
    """Given the same images and the same train/val assignment (the central one), the site's decoder and the shared
    writer produce the central shard file byte for byte."""
    from fedccrl_core.data.shards import decode_labelled, write_client
    from fedccrl_core.data.site import scan_site

    central = tmp_path / "central"
    partition(
        raw, central, SPEC, PartitionSettings(SIZE, clients_per_domain=1, val_fraction=0.2), workers=1, progress=False
    )
    entry = next(c for c in load_manifest(central).clients if c.domain == "photo")
    c = load_client(central, entry.id)
    files, rels, ys, _ = scan_site(raw / "photo", CLASSES, "classes.txt", "photo")
    xs, y, paths, _ = decode_labelled(files, rels, ys, SIZE, 1, False, "site")
    row = {p: i for i, p in enumerate(paths.tolist())}
    tr = np.array([row[p] for p in c.train_paths.tolist()])
    va = np.array([row[p] for p in c.val_paths.tolist()])
    out = tmp_path / "mine"
    out.mkdir()
    got = write_client(out, entry.id, "photo", entry.domain_index, 0, xs, y, paths, tr, va, len(CLASSES))
    assert got == entry
    assert (out / entry.file).read_bytes() == (central / entry.file).read_bytes()


def test_a_site_holding_a_whole_registry_domain_writes_the_central_files(tmp_path):
    """A registry dataset: the site's domain index and the partition stage's Generator are known, so a site holding
    a whole domain (one image truncated) writes, as client `<domain>_c0`, the central stages' shard and statistics
    files at clients_per_domain 1, byte for byte."""
    from fedccrl_core.data.synthetic import generate

    spec = registry.get_dataset("synthetic")
    raw = tmp_path / "raw"
    generate(raw, seed=0, images_per_class=3, progress=False)
    bad = raw / "cartoon" / "star" / "0001.png"
    bad.write_bytes(bad.read_bytes()[:80])
    central = tmp_path / "central"
    partition(
        raw,
        central / "shards",
        spec,
        PartitionSettings(16, clients_per_domain=1, val_fraction=0.3, seed=5),
        workers=1,
        progress=False,
    )
    build_pools(central / "shards", central / "pools", MEAN, STD, progress=False)
    fed = _fed(dataset="synthetic", classes=sorted(spec.classes or []), image_size=16, val_fraction=0.3, seed=5)
    m = prepare_site(raw / "cartoon", tmp_path / "site", fed, spec, "cartoon", "cartoon_c0", "c.txt", 1, False)
    cm = load_manifest(central / "shards")
    assert m.clients == [c for c in cm.clients if c.domain == "cartoon"]
    assert (m.domains, m.skipped) == (cm.domains, [k for k in cm.skipped if k.path.startswith("cartoon/")])
    assert m.clients[0].n_val > 0 and len(m.skipped) == 1
    for part in ("shards", "pools"):
        site_file, central_file = tmp_path / "site" / part / "cartoon_c0.npz", central / part / "cartoon_c0.npz"
        assert site_file.read_bytes() == central_file.read_bytes(), part


def test_the_supernode_reads_a_site_folder(raw, tmp_path):
    """What a SuperNode started with `shards=<site>/shards pools=<site>/pools` reads: its client, its statistics."""
    site = tmp_path / "site"
    _prepare(raw / "art", site, domain="art", cid="museum")
    m = load_manifest(site / "shards")
    assert (m.domains, client_ids(m), m.params["site.client_id"]) == (["art"], ["museum"], "museum")
    check_pools(site / "pools", ["museum"])
    s = load_client(site / "shards", "museum", exclude_domain="photo")  # a run holding out another domain
    mu, sigma = load_pool(site / "pools", "museum")
    assert s.train_x.shape == (s.n_train, SIZE, SIZE, 3) and mu.shape == sigma.shape == (s.n_train, 3)
    assert sorted(p.name for p in site.iterdir()) == ["pools", "shards"]
    # the SuperNode's own loader, with the node config a site passes (fedccrl_flower/site_data.py)
    import torch
    from flwr.common import Context, RecordDict

    from fedccrl_flower.site_data import load_client_data

    node = {"client-id": "museum", "shards": str(site / "shards"), "pools": str(site / "pools")}
    data = load_client_data(Context(1, 1, node, RecordDict(), {}), "museum", torch.device("cpu"), "photo")
    assert (data.client_id, data.domain, len(data.train_y), len(data.val_y)) == ("museum", "art", s.n_train, s.n_val)
    np.testing.assert_array_equal(np.asarray(data.stats_mu), mu)


def test_rerun_with_the_same_settings_replaces_the_site_folder(raw, tmp_path):
    site = tmp_path / "site"
    _prepare(raw / "photo", site)
    first = _digest(site)
    (raw / "photo" / "cat" / "9.png").write_bytes((raw / "photo" / "cat" / "0.png").read_bytes())  # one more image
    _prepare(raw / "photo", site)
    assert load_manifest(site / "shards").domain_sizes == {"photo": 16}
    assert _digest(site) != first
    assert temps(tmp_path) == []


# ---------------------------------------------------------------- bad inputs: a clear error, nothing half-written
def test_a_class_folder_not_in_the_list_is_refused(raw, tmp_path):
    (raw / "photo" / "horse").mkdir()
    (raw / "photo" / "horse" / "0.png").write_bytes((raw / "photo" / "cat" / "0.png").read_bytes())
    with pytest.raises(DataError, match=r"photo/horse: class folder 'horse' is not in the class list classes\.txt"):
        _prepare(raw / "photo", tmp_path / "site")
    _nothing_written(tmp_path, tmp_path / "site")


def test_a_class_the_site_lacks_is_a_warning(raw, tmp_path, capsys):
    import shutil

    shutil.rmtree(raw / "photo" / "cat")
    m = _prepare(raw / "photo", tmp_path / "site")
    err = capsys.readouterr().err
    assert "warning:" in err and "class 'cat'" in err
    assert m.warnings is not None and any("class 'cat'" in w for w in m.warnings)
    assert m.num_classes == 3 and m.clients[0].train_class_hist[1] == 0  # the model keeps cat's output
    assert load_manifest(tmp_path / "site" / "shards").warnings == m.warnings


@pytest.mark.timeout(60)  # a FIFO that were opened would block the decoder for ever
def test_what_is_not_an_image_file_is_skipped_listed_and_never_opened(raw, tmp_path, capsys):
    """In --images: a FIFO, a symlink loop and a symlink leaving the folder (a file, or a class folder) are skipped,
    listed under `skipped` with why and named on stderr; the FIFO is never opened and the symlinks not followed. A
    symlink to an image inside the folder is a sample."""
    import os

    photo = raw / "photo"
    os.mkfifo(photo / "cat" / "pipe.png")
    (photo / "dog" / "loop.png").symlink_to("loop.png")
    (tmp_path / "outside.png").write_bytes((photo / "bird" / "0.png").read_bytes())
    (photo / "bird" / "out.png").symlink_to(tmp_path / "outside.png")
    _raw(tmp_path / "elsewhere", domains=("x",), classes=["eel"])
    (photo / "eel").symlink_to(tmp_path / "elsewhere" / "x" / "eel", target_is_directory=True)
    (photo / "cat" / "again.png").symlink_to(photo / "dog" / "0.png")
    m = _prepare(photo, tmp_path / "site")
    why = {s.path: s.reason for s in m.skipped}
    assert why == {
        "photo/bird/out.png": f"a symlink to {tmp_path / 'outside.png'}, outside {photo}; not followed",
        "photo/cat/pipe.png": "a FIFO, not a regular file; never opened",
        "photo/dog/loop.png": "a symlink loop; not followed",
        "photo/eel": f"a symlink to {tmp_path / 'elsewhere' / 'x' / 'eel'}, outside {photo}; not followed",
    }
    err = capsys.readouterr().err
    for path, reason in why.items():
        assert f"notice: skipped {raw / path} ({reason})" in err
    s = load_client(tmp_path / "site" / "shards", "site_a")
    stored = set(s.train_paths.tolist()) | set(s.val_paths.tolist())
    assert len(stored) == 16 and "photo/cat/again.png" in stored and not stored & set(why)
    assert load_manifest(tmp_path / "site" / "shards").skipped == m.skipped


def test_unreadable_images_are_skipped_and_listed(raw, tmp_path):
    (raw / "photo" / "bird" / "1.png").write_bytes((raw / "photo" / "bird" / "1.png").read_bytes()[:60])  # truncated
    (raw / "photo" / "dog" / "notes.png").write_text("not an image")
    m = _prepare(raw / "photo", tmp_path / "site")
    assert sorted(s.path for s in m.skipped) == ["photo/bird/1.png", "photo/dog/notes.png"]
    s = load_client(tmp_path / "site" / "shards", "site_a")
    stored = set(s.train_paths.tolist()) | set(s.val_paths.tolist())
    assert len(stored) == 14 and not stored & {"photo/bird/1.png", "photo/dog/notes.png"}


def test_no_readable_image_is_refused(tmp_path):
    raw = _raw(tmp_path / "raw", domains=("photo",), per_class=1)
    for f in raw.rglob("*.png"):
        f.write_bytes(b"broken")
    with pytest.raises(DataError, match=r"none of its 3 images is readable"):
        _prepare(raw / "photo", tmp_path / "site")
    _nothing_written(tmp_path, tmp_path / "site")


@pytest.mark.parametrize("setup", ["empty", "empty_class_folders", "missing"])
def test_an_empty_image_folder_is_refused(tmp_path, setup):
    images = tmp_path / "photo"
    if setup != "missing":
        images.mkdir()
    if setup == "empty_class_folders":
        for c in CLASSES:
            (images / c).mkdir()
    match = "image folder not found" if setup == "missing" else "no image found"
    with pytest.raises(DataError, match=rf"--images {images}: {match}"):
        _prepare(images, tmp_path / "site")
    _nothing_written(tmp_path, tmp_path / "site")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("bird\ncat\nbird\n", r"line 3: class 'bird' is listed twice \(first on line 1\)"),
        ("bird\n\ncat\n", r"line 2 is empty"),
        ("bird\ncat \n", r"line 2: class name 'cat ' has leading or trailing whitespace"),
        ("bird\n", r"1 class\(es\)"),
        ("bird\nart/cat\n", r"line 2: 'art/cat' is not a folder name"),
    ],
)
def test_a_bad_class_file_is_refused(tmp_path, text, match):
    path = tmp_path / "classes.txt"
    path.write_text(text)
    with pytest.raises(DataError, match=rf"{path}: {match}"):
        read_class_list(path)


def test_a_class_list_other_than_the_registrys_is_refused(tmp_path):
    spec = registry.get_dataset("synthetic")
    fed = _fed(dataset="synthetic", classes=["triangle", "circle"])
    with pytest.raises(DataError, match=r"my-classes\.txt: the class list differs from the federation's \(synthetic"):
        prepare_site(tmp_path, tmp_path / "site", fed, spec, "photo", "a", "my-classes.txt", progress=False)
    _nothing_written(tmp_path, tmp_path / "site")


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"image_size": 16}, "preprocess.image_size 8 (now 16)"),
        ({"classes": ["bird", "cat", "dog", "eel"]}, "classes"),
        ({"val_fraction": 0.3}, "partition.val_fraction 0.2 (now 0.3)"),
        ({"std": [0.5, 0.5, 0.5]}, "preprocess.std"),
    ],
)
def test_rerun_with_other_federation_settings_is_refused(raw, tmp_path, change, key):
    site = tmp_path / "site"
    _prepare(raw / "photo", site)
    before = _digest(site)
    with pytest.raises(DataError, match=rf"{site}/shards/manifest\.json: this site folder was prepared with other "):
        _prepare(raw / "photo", site, _fed(**change))
    with pytest.raises(DataError, match=re.escape(key)):
        _prepare(raw / "photo", site, _fed(**change))
    assert _digest(site) == before and temps(tmp_path) == []


def test_rerun_as_another_client_is_refused(raw, tmp_path):
    site = tmp_path / "site"
    _prepare(raw / "photo", site)
    before = _digest(site)
    with pytest.raises(DataError, match=r"--client-id 'site_a' \(now 'site_b'\)"):
        _prepare(raw / "photo", site, cid="site_b")
    assert _digest(site) == before


@pytest.mark.parametrize("what", ["a file", "central shards"])
def test_an_existing_output_folder_that_is_not_a_site_is_refused(raw, tmp_path, what):
    out = tmp_path / "out"
    if what == "a file":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        match = r"exists and is not a site folder \(it holds notes\.txt\)"
    else:
        partition(
            raw,
            out / "shards",
            SPEC,
            PartitionSettings(SIZE, clients_per_domain=1, val_fraction=0.2),
            workers=1,
            progress=False,
        )
        match = r"shards/manifest\.json: these are a partition stage's shards, not a site's"
    before = _digest(out)
    with pytest.raises(DataError, match=match):
        _prepare(raw / "photo", out)
    assert _digest(out) == before and temps(tmp_path) == []


# ---------------------------------------------------------------- the command
def test_the_command_prepares_a_site_and_names_a_bad_input(raw, tmp_path, params):
    """The operator's params.yaml names no dataset.source (a site's images come from --images)."""
    from fedccrl_pipeline.cli import main

    p = params({"dataset.name": "imagefolder", "preprocess.image_size": SIZE})
    (tmp_path / "classes.txt").write_text("\n".join(CLASSES) + "\n")
    args = ["site", "prepare", "--images", raw / "photo", "--domain", "photo", "--client-id", "photo_c0"]
    args += ["--classes", tmp_path / "classes.txt", "--params", p]
    res = CliRunner().invoke(main, [*map(str, args), "--out", str(tmp_path / "site")])
    assert res.exit_code == 0, res.output
    m = load_manifest(tmp_path / "site" / "shards")
    assert (m.classes, m.image_size, m.params["partition.val_fraction"]) == (CLASSES, SIZE, 0.1)
    assert (tmp_path / "site" / "pools" / MANIFEST).is_file()
    (tmp_path / "bad.txt").write_text("bird\ncat\ncat\n")
    args[args.index(tmp_path / "classes.txt")] = tmp_path / "bad.txt"
    res = CliRunner().invoke(main, [*map(str, args), "--out", str(tmp_path / "other")])
    assert res.exit_code == 2
    assert f"error: {tmp_path / 'bad.txt'}: line 3: class 'cat' is listed twice" in res.output
    _nothing_written(tmp_path, tmp_path / "other")


def test_the_command_refuses_an_output_inside_the_images(raw, tmp_path, params):
    from fedccrl_pipeline.cli import main

    p = params({"dataset.source": "data/site-images", "dataset.name": "imagefolder", "preprocess.image_size": SIZE})
    (tmp_path / "classes.txt").write_text("\n".join(CLASSES) + "\n")
    args = ["site", "prepare", "--images", raw / "photo", "--domain", "photo", "--client-id", "a"]
    args += ["--classes", tmp_path / "classes.txt", "--params", p, "--out", raw / "photo" / "site"]
    res = CliRunner().invoke(main, [*map(str, args)])
    assert res.exit_code == 2 and "the same folder, or one inside the other" in res.output
    assert not (raw / "photo" / "site").exists()


def test_site_classes_prints_the_registrys_class_file(tmp_path, params):
    from fedccrl_pipeline.cli import main

    res = CliRunner().invoke(main, ["site", "classes", "--params", str(params({"dataset.name": "synthetic"}))])
    assert res.exit_code == 0, res.output
    path = tmp_path / "classes.txt"
    path.write_text(res.output)
    assert read_class_list(path) == sorted(registry.get_dataset("synthetic").classes or [])
    res = CliRunner().invoke(main, ["site", "classes", "--params", str(params()), "--images", str(tmp_path)])
    assert res.exit_code == 2 and f"error: --images {tmp_path}: dataset.name synthetic" in res.output
    assert "has its classes; drop --images" in res.output


def test_site_classes_of_an_imagefolder_reads_a_folder(raw, tmp_path, params):
    """imagefolder: the class folders of a `<class>/<image>` folder that hold a file, sorted; no dataset.source."""
    from fedccrl_pipeline.cli import main

    (raw / "photo" / "aardvark").mkdir()  # empty: not a class
    p = params({"dataset.name": "imagefolder"}, to=tmp_path / "if")
    res = CliRunner().invoke(main, ["site", "classes", "--params", str(p), "--images", str(raw / "photo")])
    assert res.exit_code == 0, res.output
    (tmp_path / "classes.txt").write_text(res.output)
    assert read_class_list(tmp_path / "classes.txt") == CLASSES
    res = CliRunner().invoke(main, ["site", "classes", "--params", str(p)])
    assert res.exit_code == 2 and f"error: {p}: dataset.name imagefolder discovers its classes" in res.output
    assert "fedccrl site classes --images DIR" in res.output
    res = CliRunner().invoke(main, ["site", "classes", "--params", str(p), "--images", str(raw / "photo" / "cat")])
    assert res.exit_code == 2 and "0 class folder(s) holding a file" in res.output


def _federation_args(tmp_path, p, *sites, classes=CLASSES):
    (tmp_path / "classes.txt").write_text("\n".join(classes) + "\n")
    args = ["site", "federation", "--params", str(p), "--classes", str(tmp_path / "classes.txt")]
    return [*args, *(a for s in sites for a in ("--site", s)), "--out", str(tmp_path / "federation.json")]


def test_site_federation_writes_the_file_each_sites_manifest_agrees_with(raw, tmp_path, params):
    """The operator's federation file from its sites (ID=DOMAIN), the class file and params.yaml: its dataset,
    classes, image size and resize policy are what a site's prepare writes into its manifest, and its domains the
    sites' (sorted for imagefolder, the registry's order otherwise); fedccrl federate reads it."""
    from fedccrl_flower.sites import read_federation
    from fedccrl_pipeline.cli import main

    p = params({"dataset.name": "imagefolder", "preprocess.image_size": SIZE})
    args = _federation_args(tmp_path, p, "photo_c0=photo", "art_c0=art", "art_c1=art")
    res = CliRunner().invoke(main, [*args, "--node-id", "art_c0=17"])
    assert res.exit_code == 0, res.output
    fed = read_federation(tmp_path / "federation.json")
    assert fed.domains == ["art", "photo"] and [(s.id, s.domain, s.node_id) for s in fed.sites] == [
        ("photo_c0", "photo", None),
        ("art_c0", "art", "17"),
        ("art_c1", "art", None),
    ]
    m = _prepare(raw / "photo", tmp_path / "site", cid="photo_c0")
    assert (fed.dataset, fed.classes, fed.image_size, fed.resize_policy) == (
        m.dataset,
        m.classes,
        m.image_size,
        m.resize_policy,
    )
    syn = params({"dataset.name": "synthetic"}, to=tmp_path / "syn")
    args = _federation_args(tmp_path / "syn", syn, "b=sketch", "a=art", classes=sorted(SYN.classes or []))
    assert CliRunner().invoke(main, args).exit_code == 0
    assert read_federation(tmp_path / "syn" / "federation.json").domains == list(
        registry.get_dataset("synthetic").domains
    )


@pytest.mark.parametrize(
    ("sites", "match"),
    [
        (["photo_c0=photo", "photo_c0=art"], r"--site 'photo_c0=art': client id 'photo_c0' is given twice"),
        (["photo_c0"], r"--site 'photo_c0' \(ID=DOMAIN\): --domain '': not a folder name"),
        (["../x=art"], r"--site '\.\./x=art' \(ID=DOMAIN\): --client-id '\.\./x'"),
        (["a=art", "--node-id", "b=3"], r"--node-id 'b=3' \(ID=NODE\): 'b' is not a site given by --site"),
        (["a=art", "--node-id", "a=x"], r"--node-id 'a=x' \(ID=NODE\): one number per site"),
    ],
)
def test_site_federation_refuses_a_bad_site_naming_it(tmp_path, params, sites, match):
    from fedccrl_pipeline.cli import main

    p = params({"dataset.name": "imagefolder"})
    extra = sites[sites.index("--node-id") :] if "--node-id" in sites else []
    res = CliRunner().invoke(main, [*_federation_args(tmp_path, p, *sites[: len(sites) - len(extra)]), *extra])
    assert res.exit_code == 2 and re.search(match, res.output), res.output
    assert not (tmp_path / "federation.json").exists()


def test_a_domain_or_client_id_the_federation_cannot_have_is_refused(tmp_path):
    spec = registry.get_dataset("synthetic")
    fed = _fed(dataset="synthetic", classes=sorted(spec.classes or []))
    with pytest.raises(DataError, match=r"--domain 'photos' is not a domain of synthetic \(domains: photo, art"):
        prepare_site(tmp_path, tmp_path / "site", fed, spec, "photos", "a", "c.txt", progress=False)
    with pytest.raises(DataError, match=r"--client-id '../a': letters, digits"):
        prepare_site(tmp_path, tmp_path / "site", fed, spec, "photo", "../a", "c.txt", progress=False)
    _nothing_written(tmp_path, tmp_path / "site")


def test_the_command_refuses_a_central_partition_scheme(raw, tmp_path, params):
    from fedccrl_pipeline.cli import main

    p = params({"dataset.source": "data/site-images", "dataset.name": "imagefolder", "partition.scheme": "reference"})
    (tmp_path / "classes.txt").write_text("\n".join(CLASSES) + "\n")
    args = ["site", "prepare", "--images", raw / "photo", "--domain", "photo", "--client-id", "a"]
    args += ["--classes", tmp_path / "classes.txt", "--params", p, "--out", tmp_path / "site"]
    res = CliRunner().invoke(main, [*map(str, args)])
    assert res.exit_code == 2 and f"error: {p}: partition.scheme is 'reference'" in res.output
    _nothing_written(tmp_path, tmp_path / "site")


def test_a_sites_node_id_is_checked_and_left_out_of_the_run_key_and_status_maps_it(tmp_path):
    """The federation file's optional `sites[].node_id`: a number, or an error naming the file and key; the run's
    description (its key) is the same with or without it; `fedccrl federation status` maps the SuperLink's nodes to
    the sites by it (fedccrl_flower/site_status.py)."""
    from fedccrl_core.foundation.errors import DataError
    from fedccrl_flower.site_status import site_statuses
    from fedccrl_flower.sites import read_federation

    doc = {
        "dataset": "embedded",
        "domains": ["art", "photo", "sketch"],
        "classes": ["dog"],
        "image_size": 32,
        "resize_policy": "resize",
        "sites": [{"id": "art_c0", "domain": "art"}, {"id": "photo_c0", "domain": "photo"}],
    }
    path = tmp_path / "federation.json"
    path.write_text(json.dumps(doc))
    plain = read_federation(path)
    doc["sites"] = [{**doc["sites"][0], "node_id": "11"}, {**doc["sites"][1], "node_id": "22"}]
    doc["sites"].append({"id": "sketch_c0", "domain": "sketch"})
    path.write_text(json.dumps(doc))
    keyed = read_federation(path)
    assert keyed.run_description()["sites"][:2] == plain.run_description()["sites"] == plain.to_dict()["sites"]
    rows = site_statuses(keyed, {"11": "online", "22": "offline", "33": "online"})
    assert [(r.client_id, r.node_id, r.node_status, r.connected) for r in rows] == [
        ("art_c0", "11", "online", True),
        ("photo_c0", "22", "offline", False),
        ("sketch_c0", None, "no node_id in the federation file", False),
    ]
    assert site_statuses(keyed, {})[0].node_status == "not registered"
    doc["sites"][0]["node_id"] = "art"
    path.write_text(json.dumps(doc))
    with pytest.raises(DataError, match=r"federation.json.*node_id"):
        read_federation(path)
