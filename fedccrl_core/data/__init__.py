"""Data: dataset registry, image decoding, sources (download, safe extraction), validation,
the embedded synthetic dataset, partition into client shards, and per-sample statistic pools.

The names below are the public API, imported lazily (PEP 562) so that importing one light module
(fedccrl_core.data.images, as `fedccrl-serve` does) does not pull torch in through pools or shards.
"""
import importlib

_PUBLIC = {
    "safe_extract": "archives",
    "RESIZE_POLICY": "images", "decode_resized": "images", "load_rgb": "images", "resize_u8": "images",
    "build_pools": "pools", "load_pool": "pools", "sample_statistics": "pools", "upload_size": "pools",
    "DatasetSpec": "registry", "get_dataset": "registry", "resolve_auto": "registry",
    "resolve_backbone": "registry", "resolve_image_size": "registry", "resolve_pretrained": "registry",
    "ClientShard": "shards", "client_ids": "shards", "domain_name": "shards", "load_client": "shards",
    "load_domain_test": "shards", "load_manifest": "shards", "partition": "shards",
    "prepare_raw": "sources",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
