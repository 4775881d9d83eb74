"""fedccrl-serve's torch-free preprocessing (serving/fedccrl_serving/preprocess.py, numpy + PIL) gives the tensors the model
was trained on, within 1e-6, on images of every domain: the partition stage's decode (decode_images: load_rgb
+ resize_u8 into the uint8 shards) followed by training's normalize_u8. The synthetic
domains are PNGs of four styles; PACS (from ../shared, mandatory in CI) adds JPEGs of its four domains."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fedccrl_core.data.images import RESIZE_POLICY, decode_images
from fedccrl_core.data.synthetic import DOMAINS
from fedccrl_core.learning.statistics import normalize_u8
from fedccrl_serving.metadata import ServingMetadata
from fedccrl_serving.preprocess import preprocess_files

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _training_tensors(paths: list[Path], size: int) -> torch.Tensor:
    """What train sees: the shard's uint8 pixels (partition's decode), normalized on the fly."""
    decoded = list(decode_images(paths, size, workers=1, progress=False))
    assert all(err is None for _, err in decoded), [err for _, err in decoded if err]
    u8 = torch.from_numpy(np.stack([img for img, _ in decoded]))
    return normalize_u8(u8, list(MEAN), list(STD))


def _assert_parity(root: Path, size: int) -> set[str]:
    meta = ServingMetadata(("a",), size, MEAN, STD, RESIZE_POLICY, {})
    domains = set()
    for domain_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        paths = sorted(p for p in domain_dir.rglob("*") if p.is_file())
        x, good, errors = preprocess_files(paths, meta)
        assert not errors and good == list(range(len(paths))), errors
        diff = (torch.from_numpy(x) - _training_tensors(paths, size)).abs().max().item()
        assert diff <= 1e-6, f"{domain_dir.name}: serving differs from training by {diff}"
        domains.add(domain_dir.name)
    return domains


@pytest.mark.parametrize("size", [32, 40])
def test_serving_preprocessing_equals_training_on_every_synthetic_domain(tiny, size):
    assert _assert_parity(tiny / "raw", size) == set(DOMAINS)  # the session's tiny dataset (conftest.py), read-only


def test_serving_preprocessing_equals_training_on_every_pacs_domain(shared_dir, tmp_path):
    """Two JPEGs of each PACS class and domain (pacs_224.zip), resized to 64 px."""
    taken: dict = {}
    with zipfile.ZipFile(shared_dir / "datasets" / "pacs" / "pacs_224.zip") as zf:
        for name in sorted(zf.namelist()):
            parts = name.split("/")
            if len(parts) != 4 or not parts[3] or taken.setdefault((parts[1], parts[2]), 0) >= 2:
                continue
            taken[(parts[1], parts[2])] += 1
            out = tmp_path / parts[1] / parts[2] / parts[3]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(zf.read(name))
    assert len(_assert_parity(tmp_path, 64)) == 4
