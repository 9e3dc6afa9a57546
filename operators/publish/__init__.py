"""Publishing a release: folder layout, Parquet shards, dataset card, Croissant, STAC, checksums, versions."""
