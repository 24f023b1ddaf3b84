"""The train stage's decisions from its configuration, made before any data is read.

:func:`check_settings` refuses settings no run can train with, :func:`resolve_mixed_precision`
picks Accelerate's ``mixed_precision`` for the device, :func:`default_max_tokens` the
micro-batch budget, and :func:`drafter_arch` the drafter's sizes from ``drafter.*`` and
the target.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from eagle3.errors import Eagle3Error
from eagle3.train.drafter import DrafterArch


def check_settings(cfg: Any) -> None:
    """Settings of a :class:`eagle3.config.TrainConfig` that cannot train or export.

    Raises:
        Eagle3Error: ``loop.grad_accum`` or ``drafter.ttt_steps`` below 1,
            ``loop.max_tokens_per_batch`` below 8, or an SGLang export of a drafter with
            more than one layer (SGLang serves one-layer EAGLE-3 drafters).
    """
    dcfg, lcfg = cfg.drafter, cfg.loop
    if lcfg.grad_accum < 1 or (lcfg.max_tokens_per_batch or 8) < 8 or dcfg.ttt_steps < 1:
        raise Eagle3Error("loop.grad_accum and drafter.ttt_steps must be >= 1, loop.max_tokens_per_batch >= 8")
    if cfg.export.sglang and dcfg.num_layers != 1:
        raise Eagle3Error(
            f"drafter.num_layers={dcfg.num_layers}: SGLang serves one-layer EAGLE-3 drafters; "
            "set drafter.num_layers=1 or export.sglang=false"
        )


def resolve_mixed_precision(setting: str, device: torch.device) -> str:
    """Accelerate's ``mixed_precision`` for this device.

    ``auto``: ``bf16`` on CUDA (autocast, fp32 master weights); ``no`` on CPU, where
    bf16 autocast was measured slower than float32 for this model on CPUs without AMX
    (the casts cost more than the bf16 matmuls save) and float32 is exact.
    ``bf16``/``no`` are taken as given.

    Raises:
        Eagle3Error: an unknown setting.
    """
    if setting not in ("auto", "bf16", "no", "fp16"):
        raise Eagle3Error(f"loop.mixed_precision={setting!r}; use auto, bf16 or no")
    if setting == "auto":
        return "bf16" if device.type == "cuda" else "no"
    return setting


def default_max_tokens(setting: Optional[int], device: torch.device) -> int:
    """Padded tokens per micro-batch: ``loop.max_tokens_per_batch``, else 8192 on CUDA and 2048 on CPU."""
    return int(setting or (8192 if device.type == "cuda" else 2048))


def drafter_arch(target: Any, dcfg, draft_vocab_size: Optional[int] = None) -> DrafterArch:
    """Drafter sizes: ``drafter.*`` where set, else the target's (``TargetInfo``).

    Raises:
        Eagle3Error: sizes that cannot form a drafter (heads not dividing, missing
            target fields for a hub-only target).
    """
    H = dcfg.hidden_size or target.hidden_size
    heads = dcfg.num_attention_heads or target.num_attention_heads
    kv = dcfg.num_key_value_heads or target.num_key_value_heads or heads
    inter = dcfg.intermediate_size or target.intermediate_size
    if not heads or not inter:
        raise Eagle3Error(
            "the target's config does not give attention heads / FFN width; set drafter.num_attention_heads "
            "and drafter.intermediate_size"
        )
    head_dim = dcfg.head_dim or (target.head_dim if H == target.hidden_size and target.head_dim else H // heads)
    if heads % kv:
        raise Eagle3Error(f"drafter.num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    return DrafterArch(
        hidden_size=int(H),
        num_attention_heads=int(heads),
        num_key_value_heads=int(kv),
        head_dim=int(head_dim),
        intermediate_size=int(inter),
        num_layers=int(dcfg.num_layers),
        target_hidden_size=int(target.hidden_size),
        vocab_size=int(target.vocab_size),
        draft_vocab_size=int(draft_vocab_size or dcfg.draft_vocab_size),
        rms_norm_eps=float(target.rms_norm_eps or 1e-6),
        rope_theta=float(target.rope_theta or 10000.0),
        max_position_embeddings=int(target.max_position_embeddings or 8192),
    )
