"""Registry entries and image decoding (load_rgb) / the resize policy (resize_u8)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from fedccrl_core.data import registry
from fedccrl_core.data.images import RESIZE_POLICY, check_images, decode_images, load_rgb, resize_u8
from fedccrl_core.foundation.errors import DataError


# ------------------------------------------------------------------ registry
@pytest.mark.parametrize("name", list(registry.dataset_names()))
def test_registry_entries_are_consistent(name):
    spec = registry.get_dataset(name)
    assert spec.name == name
    if spec.classes is not None:
        assert list(spec.classes) == sorted(spec.classes) and len(set(spec.classes)) == len(spec.classes)
    if spec.domain_counts is not None:
        assert len(spec.domain_counts) == len(spec.domains)
        assert sum(spec.domain_counts) == spec.total
    for s in spec.sources:
        assert s.url.startswith(("http://", "https://"))
        assert s.sha256 is None or len(s.sha256) == 64
    assert spec.image_size in (32, 128, 224)


def test_registry_facts():
    pacs = registry.get_dataset("pacs")
    assert pacs.domains == ("photo", "art_painting", "cartoon", "sketch")  # paper order P, A, C, S
    assert dict(zip(pacs.domains, pacs.domain_counts)) == {
        "photo": 1670,
        "art_painting": 2048,
        "cartoon": 2344,
        "sketch": 3929,
    }
    assert pacs.total == 9991 and len(pacs.classes) == 7
    assert pacs.sources[0].sha256 is None and pacs.sources[0].folder == "kfold"  # unknown: never invented
    assert {k.filename for k in pacs.known_archives} == {"pacs_128.zip", "pacs_224.zip"}
    oh = registry.get_dataset("officehome")
    assert len(oh.classes) == 65 and oh.total == 15588 and oh.classes[0] == "Alarm_Clock"
    assert oh.canonical_domain("Real World") == "Real_World" == oh.canonical_domain("Real_World")
    mdn = registry.get_dataset("minidomainnet")
    assert mdn.domains == ("clipart", "painting", "real", "sketch") and mdn.total == 140006
    assert mdn.num_classes == 126 and mdn.image_size == 128
    syn = registry.get_dataset("synthetic")
    assert (syn.image_size, syn.backbone, syn.pretrained) == (32, "small_cnn", "none")
    assert (pacs.backbone, pacs.pretrained) == ("mobilenet_v3_large", "imagenet")


def test_resolve_auto():
    """`auto` is the registry's default; any other value is kept (the schema bounds it: test_schema_bounds.py)."""
    assert registry.resolve_image_size("auto", "minidomainnet") == 128
    assert registry.resolve_backbone("auto", "minidomainnet") == "mobilenet_v3_large"
    assert registry.resolve_pretrained("auto", "minidomainnet") == "imagenet"
    assert registry.resolve_pretrained("none", "minidomainnet") == "none"
    assert registry.resolve_image_size(96, "pacs") == 96
    assert registry.resolve_backbone("auto", "synthetic") == "small_cnn"


# ------------------------------------------------------------------ load_rgb
def _save(img: Image.Image, path, **kw):
    img.save(path, **kw)
    return path


def test_modes_become_rgb(tmp_path):
    g = np.tile(np.arange(0, 256, 16, dtype=np.uint8), (16, 1))
    cases = {
        "l.png": Image.fromarray(g, "L"),
        "cmyk.jpg": Image.new("CMYK", (16, 16), (0, 255, 255, 0)),  # pure red in CMYK
        "p.png": Image.fromarray(g, "L").convert("P"),
        "rgb.png": Image.fromarray(np.dstack([g, g, g])),
    }
    for name, img in cases.items():
        out = load_rgb(_save(img, tmp_path / name))
        assert out.mode == "RGB" and out.size == (16, 16), name
    red = np.asarray(load_rgb(tmp_path / "cmyk.jpg")).reshape(-1, 3).mean(0)
    assert red[0] > 200 and red[1] < 60 and red[2] < 60
    np.testing.assert_array_equal(np.asarray(load_rgb(tmp_path / "l.png"))[..., 1], g)


def test_16bit_grey_is_scaled_not_clipped(tmp_path):
    a = np.array([[0, 257 * 128, 65535]], dtype=np.uint16)
    img = Image.fromarray(a)
    assert img.mode.startswith("I;16")
    out = np.asarray(load_rgb(_save(img, tmp_path / "g16.png")))
    assert out[0, :, 0].tolist() == [0, 128, 255]


def test_alpha_is_composited_on_white(tmp_path):
    rgba = np.zeros((4, 4, 4), dtype=np.uint8)
    rgba[..., 0] = 255  # red ...
    rgba[:2, :, 3] = 0  # ... transparent on the top half
    rgba[2:, :, 3] = 255
    out = np.asarray(load_rgb(_save(Image.fromarray(rgba, "RGBA"), tmp_path / "a.png")))
    assert out[0, 0].tolist() == [255, 255, 255] and out[3, 0].tolist() == [255, 0, 0]
    la = Image.fromarray(np.dstack([np.zeros((4, 4), np.uint8), np.zeros((4, 4), np.uint8)]), "LA")
    assert np.asarray(load_rgb(_save(la, tmp_path / "la.png")))[0, 0].tolist() == [255, 255, 255]


def test_palette_transparency_is_composited(tmp_path):
    p = Image.new("P", (4, 4), 0)
    p.putpalette([0, 0, 0, 0, 0, 255] + [0] * 762)
    p.putpixel((0, 0), 1)
    p.info["transparency"] = 0  # index 0 (black) is transparent
    out = np.asarray(load_rgb(_save(p, tmp_path / "p.png", transparency=0)))
    assert out[0, 0].tolist() == [0, 0, 255] and out[1, 1].tolist() == [255, 255, 255]


def test_exif_orientation_is_applied(tmp_path):
    img = Image.new("RGB", (20, 10), (0, 0, 0))
    img.paste((255, 255, 255), (0, 0, 10, 10))  # white left half
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW on display
    img.save(tmp_path / "o.jpg", exif=exif.tobytes(), quality=95)
    out = load_rgb(tmp_path / "o.jpg")
    assert out.size == (10, 20)
    a = np.asarray(out).astype(int)
    assert a[:10].mean() > 200 and a[10:].mean() < 50  # white half is now on top


def test_bad_files_raise_dataerror_naming_the_file(tmp_path):
    good = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 200, 30)).save(good, format="JPEG")
    (tmp_path / "trunc.jpg").write_bytes(good.getvalue()[: len(good.getvalue()) // 2])
    (tmp_path / "zero.jpg").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "garbage.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    expect = {"trunc.jpg": "truncated", "zero.jpg": "zero-byte", "notes.txt": "not an image", "garbage.png": ""}
    for name, why in expect.items():
        with pytest.raises(DataError, match=rf"{name}: .*{why}"):
            load_rgb(tmp_path / name)


def test_decompression_bomb_is_refused(tmp_path, monkeypatch):
    _save(Image.new("RGB", (100, 100)), tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5000)  # 10,000 px > limit: PIL only warns
    with pytest.raises(DataError, match=r"big.png: decompression bomb"):
        load_rgb(tmp_path / "big.png")


# ------------------------------------------------------------------ resize_u8
def test_resize_u8_is_direct_bilinear_no_crop():
    rng = np.random.default_rng(0)
    src = Image.fromarray(rng.integers(0, 256, size=(30, 50, 3), dtype=np.uint8))
    out = resize_u8(src, 16)
    assert out.dtype == np.uint8 and out.shape == (16, 16, 3) and out.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(out, np.asarray(src.resize((16, 16), Image.BILINEAR)))
    # no crop: a 2-wide image's left column colour survives on the left after a non-square resize
    two = Image.fromarray(np.array([[[255, 0, 0], [0, 0, 255]]] * 4, dtype=np.uint8))
    o = resize_u8(two, 8)
    assert o[:, 0, 0].min() > 150 and o[:, -1, 2].min() > 150
    assert "bilinear" in RESIZE_POLICY and "no crop" in RESIZE_POLICY


def test_parallel_check_and_decode_match_serial(tmp_path, monkeypatch):
    from fedccrl_core.data import images

    monkeypatch.setattr(images, "_INLINE_BELOW", 10)  # force a real process pool for 71 files
    paths = []
    for i in range(70):
        p = tmp_path / f"{i}.png"
        Image.new("RGB", (9 + i % 5, 7), (i, 2 * i, 3 * i)).save(p)
        paths.append(p)
    (tmp_path / "bad.jpg").write_bytes(b"nope")
    paths.append(tmp_path / "bad.jpg")
    res = check_images(paths, workers=2, progress=False)
    assert [r[0] is None for r in res] == [True] * 70 + [False]
    assert "not an image" in res[-1][0] and all(len(r[1]) == 64 for r in res)
    dec = list(decode_images(paths, 4, workers=2, progress=False))
    assert dec[-1][0] is None and dec[5][0].shape == (4, 4, 3)
    np.testing.assert_array_equal(dec[5][0], resize_u8(load_rgb(paths[5]), 4))
