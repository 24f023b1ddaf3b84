"""The features contract: what one captured sample holds, the sharded safetensors writer with its manifest, the reader."""

from __future__ import annotations

from eagle3.features.store import (  # noqa: F401
    FORMAT,
    VERSION,
    MANIFEST,
    TENSOR_KEYS,
    DTYPES,
    COMPATIBILITY_KEYS,
    Capture,
    Record,
    bytes_per_token,
    estimate_bytes,
    samples_per_shard,
    shard_name,
    FeatureWriter,
    part_manifest_name,
    load_manifest,
    check_compatible,
    FeatureDataset,
)
