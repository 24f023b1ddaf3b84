"""What an extraction records about itself in its manifest: target, template, engine, settings, versions.

Everything in it must be equal for a resumed extraction to be valid
(:meth:`eagle3.features.FeatureWriter.open` compares it and names the first difference).
"""

from __future__ import annotations

import dataclasses

from eagle3.extract.order import bucket_by_turns
from eagle3.extract.preflight import feature_mode
from eagle3.features import FEATURES_NONE, LAYOUT_TARGET_IDS, LAYOUT_TEMPLATE_TEXT
from eagle3.target import chat_template_hash


def _versions() -> dict:
    import compressed_tensors
    import datasets
    import safetensors
    import torch
    import transformers

    import eagle3

    return {
        "eagle3": eagle3.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "compressed_tensors": compressed_tensors.__version__,
        "datasets": datasets.__version__,
        "safetensors": safetensors.__version__,
    }


def _metadata(cfg, target, engine, tokenizer) -> dict:
    """The manifest's ``metadata`` of an extraction of ``cfg`` by ``engine`` serving ``target``."""
    d = cfg.data
    return {
        "target": {
            "name": target.name,
            "source": target.source,
            "content_hash": target.content_hash,
            "architecture": target.architecture,
            "num_layers": target.num_layers,
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "quantization": target.quantization,
            "dtype": target.dtype,
            "build": getattr(target, "build", None),  # where its folder was built (eagle3.target.build_record)
        },
        "aux_layer_ids": list(target.aux_layer_ids),
        # what the shards hold (absent = offline: features); none = the kept replies alone (eagle3.features.format)
        **({"features": FEATURES_NONE} if feature_mode(cfg) == FEATURES_NONE else {}),
        "aux_layer_convention": "hf_output_hidden_states",
        "chat_template_hash": chat_template_hash(tokenizer),
        "engine": engine.info(),
        "sampling": dataclasses.asdict(cfg.sampling) if dataclasses.is_dataclass(cfg.sampling) else dict(cfg.sampling),
        "regenerate": bool(cfg.capture.regenerate),
        # regenerated samples are the target's own ids; kept replies are rendered text (eagle3.features.format)
        "sample_layout": LAYOUT_TARGET_IDS if cfg.capture.regenerate else LAYOUT_TEMPLATE_TEXT,
        "capture": {"top_k": int(cfg.capture.top_k), "max_length": int(cfg.capture.max_length),
                    "max_turns": cfg.capture.max_turns,
                    # multi-turn regeneration plans by turn count (eagle3.extract.order); absent = source order
                    **({"plan_order": "turns"} if bucket_by_turns(cfg.capture) else {}),
                    # absent = bfloat16 (folders written before the setting existed)
                    **({"aux_dtype": cfg.capture.aux_dtype} if cfg.capture.aux_dtype != "bfloat16" else {})},
        "data": {
            "name": d.name,
            "source": d.source,
            "path": d.path,
            "seed": int(d.seed),
            "fractions": {"validation": float(d.validation_fraction), "test": float(d.test_fraction)},
            "splits": list(d.splits),
            "limit": d.limit,
            **({"offset": int(d.offset)} if int(getattr(d, "offset", 0)) else {}),  # absent = 0 (older folders)
        },
        "versions": _versions(),
    }
