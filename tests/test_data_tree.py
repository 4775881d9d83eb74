"""One walker of image folders (fedccrl_core/data/tree.py) with one rule for what is not a sample
(data/images.py `is_ignored_name`: hidden names, OS thumbnails, __MACOSX), the same at every level for the download
stage's checks, the partition stage, a source's domain folders and `fedccrl-serve`."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from fedccrl_core.data.layout import find_imagefolder_root, materialize
from fedccrl_core.data.tree import LeftOut, scan_classes, scan_tree, subfolders, walk_files


def _png(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), (10, 20, 30)).save(path)
    return path


def _tree(root: Path) -> Path:
    """Two domains of one class, and everything a macOS zip or a Windows copy adds around them."""
    for d in ("art", "photo"):
        _png(root / d / "dog" / "0.png")
        (root / d / "dog" / ".DS_Store").write_bytes(b"x")
        (root / d / "dog" / "Thumbs.db").write_bytes(b"x")
        _png(root / d / "__MACOSX" / "dog" / "._0.png")  # not a class
        _png(root / d / ".cache" / "0.png")  # not a class
    _png(root / "photo" / "dog" / "nested" / "1.png")  # below a class folder
    (root / "photo" / "notes.txt").write_text("x")  # outside any class folder
    _png(root / "__MACOSX" / "photo" / "dog" / "._0.png")  # not a domain
    (root / "README").write_text("x")  # outside any domain folder
    return root


def test_the_raw_tree_and_a_sources_domain_folders_are_read_alike(tmp_path):
    root = _tree(tmp_path / "raw")
    tree = scan_tree(root)
    assert tree.files == {"art": {"dog": ["0.png"]}, "photo": {"dog": ["0.png"]}}
    assert tree.ignored == [
        LeftOut("README", "file outside any domain folder"),
        LeftOut("art/dog/.DS_Store", "hidden or system file"),
        LeftOut("art/dog/Thumbs.db", "hidden or system file"),
        LeftOut("photo/dog/.DS_Store", "hidden or system file"),
        LeftOut("photo/dog/Thumbs.db", "hidden or system file"),
        LeftOut("photo/dog/nested", "folder nested below a class folder"),
        LeftOut("photo/notes.txt", "file outside any class folder"),
    ]
    out = tmp_path / "out"
    ignored = materialize({d: root / d for d in ("art", "photo")}, out, move=False)
    assert ignored == [i for i in tree.ignored if "/" in i.path]  # the same rule, the same entries
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "art/dog/0.png",
        "photo/dog/0.png",
    ]
    assert scan_classes(root / "art", "art") == ({"dog": ["0.png"]}, tree.ignored[1:3])


def test_serving_walks_folders_with_the_same_rule(tmp_path):
    root = _tree(tmp_path / "raw")
    assert [p.name for p in subfolders(root / "photo")] == ["dog"]
    assert [p.relative_to(root).as_posix() for p in walk_files(root / "photo")] == [
        "photo/notes.txt",
        "photo/dog/0.png",
        "photo/dog/nested/1.png",
    ]


def test_ignored_files_do_not_make_a_wrapper_folder_a_domain(tmp_path):
    """export/mydata/<domain>/<class>/<image> with a .DS_Store in each wrapper: the wrappers are stripped (a
    hidden file is not an image at the class level), not taken for a one-domain dataset named `export`."""
    top = tmp_path / "src"
    for d in ("art", "photo"):
        _png(top / "export" / "mydata" / d / "dog" / "0.png")
    (top / "export" / ".DS_Store").write_bytes(b"x")
    (top / "export" / "mydata" / ".DS_Store").write_bytes(b"x")
    root, domains = find_imagefolder_root(top)
    assert root == top / "export" / "mydata" and sorted(domains) == ["art", "photo"]
