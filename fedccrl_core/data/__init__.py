"""Data: dataset registry, image decoding, sources (download, safe extraction), validation,
the embedded synthetic dataset, partition into client shards, and per-sample statistic pools.

Modules are imported lazily by their users; the names below are the public API.
"""
from fedccrl_core.data.archives import safe_extract
from fedccrl_core.data.images import RESIZE_POLICY, decode_resized, load_rgb, resize_u8
from fedccrl_core.data.pools import build_pools, load_pool, sample_statistics, upload_size
from fedccrl_core.data.registry import (DatasetSpec, get_dataset, resolve_auto, resolve_backbone,
                                        resolve_image_size, resolve_pretrained)
from fedccrl_core.data.shards import (ClientShard, client_ids, domain_name, load_client, load_domain_test,
                                      load_manifest, partition)
from fedccrl_core.data.sources import prepare_raw

__all__ = [
    "RESIZE_POLICY", "decode_resized", "load_rgb", "resize_u8",
    "build_pools", "load_pool", "sample_statistics", "upload_size",
    "DatasetSpec", "get_dataset", "resolve_auto", "resolve_backbone", "resolve_image_size", "resolve_pretrained",
    "ClientShard", "client_ids", "domain_name", "load_client", "load_domain_test", "load_manifest", "partition",
    "prepare_raw", "safe_extract",
]
