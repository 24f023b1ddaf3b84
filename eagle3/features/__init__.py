"""The features contract: what one captured sample holds, the sharded safetensors writer with its manifest, the reader."""

from __future__ import annotations

from eagle3.features.format import (  # noqa: F401
    FORMAT,
    VERSION,
    MANIFEST,
    TENSOR_KEYS,
    REPLY_KEYS,
    FEATURES_OFFLINE,
    FEATURES_NONE,
    stored_features,
    DTYPES,
    AUX_BF16,
    AUX_FP8,
    AUX_DTYPES,
    COMPATIBILITY_KEYS,
    Capture,
    Record,
    bytes_per_token,
    estimate_bytes,
    samples_per_shard,
    shard_name,
    part_manifest_name,
    LAYOUT_TARGET_IDS,
    LAYOUT_TEMPLATE_TEXT,
    LAYOUT_RETOKENIZED,
    sample_layout,
    rank_top_k,
    quantize_aux,
    dequantize_aux,
)
from eagle3.features.writer import FeatureWriter  # noqa: F401
from eagle3.features.reader import (  # noqa: F401
    load_manifest,
    check_compatible,
    FeatureDataset,
)
