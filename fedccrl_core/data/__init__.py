"""Data: dataset registry, image decoding, sources (download, safe extraction), validation, the embedded synthetic
dataset, partition into client shards, and per-sample statistic pools (floor 1, docs/architecture.md "Layers").
Import each name from its module: importing one light module (data.images, as `fedccrl-serve` does) pulls no
torch in through pools or shards."""
