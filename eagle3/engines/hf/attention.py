"""Decode attention with grouped-query attention (GQA): a CPU matmul path and a folded SDPA path.

During batched generation every decode step attends one new query per row to the
cache. With a padding mask, transformers' ``sdpa`` path repeats the key/value heads
``num_key_value_groups`` times and calls PyTorch's CPU flash-attention kernel, which is
slow for a single query: on a 2-core avx512_bf16 CPU, bf16, ``[16 rows, 9 query / 3 kv
heads, 500 keys, 64]`` takes 8.1 ms a call (30 calls a step for SmolLM2). Folding the
query heads of each kv group into the query axis turns the same attention into two
small matmuls over the un-repeated cache (0.64 ms). Whole generations, prefill
included, at batch 64 x 256 prompt tokens and 64 new tokens: 70.5 -> 131.4 tokens/s
(``benchmarks/generate_throughput.py``).

:data:`GQA_DECODE` is registered with transformers' ``AttentionInterface`` (and
``sdpa``'s mask function with ``AttentionMaskInterface``, so masks are built exactly as
for ``sdpa``). Calls with more than one query (prefill, verify passes), with a per-head
mask, or carrying options this path does not implement (softcap, attention sinks,
dropout) are passed to transformers' own ``sdpa_attention_forward`` unchanged. The
math is eager attention's: ``softmax(q k^T * scaling + mask)`` in float32, cast back, times
``v`` (transformers ``eager_attention_forward``); in bf16 it rounds differently from
the flash kernel, so greedy replies may differ after a near-tie, as between any two
attention kernels.

The folded GQA SDPA of :mod:`eagle3.gqa` (``engine.gqa_fold``, on by default on CUDA) is the
same idea on SDPA itself, for any few queries and any device.
"""

from __future__ import annotations

import torch

from eagle3.gqa import GQA_DECODE, PASS_THROUGH


def gqa_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                         scaling: float | None = None, **kwargs):
    """Attention with the signature of transformers' attention functions.

    Args:
        module: the attention module (unused beyond what ``sdpa`` needs).
        query: ``[B, Hq, Q, D]``.
        key: ``[B, Hk, T, D]`` with ``Hq % Hk == 0``.
        value: ``[B, Hk, T, Dv]``.
        attention_mask: ``sdpa``'s mask, bool ``[B, 1, Q, T]`` (True = attend), an
            additive float mask of that shape, or None (attend to all ``T``).
        dropout: only 0 takes the decode path.
        scaling: score scale; None = ``D ** -0.5``.

    Returns:
        ``(attn_output [B, Q, Hq, Dv], None)`` in ``query``'s dtype, as transformers expects.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, Hq, Q, D = query.shape
    Hk = key.shape[1]
    per_head_mask = attention_mask is not None and attention_mask.shape[1] != 1
    if Q != 1 or dropout or Hq % Hk or per_head_mask or any(kwargs.get(k) is not None for k in PASS_THROUGH):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    g = Hq // Hk
    q = query.reshape(B, Hk, g, D)  # query head h = kv head h // g (transformers' repeat_kv order)
    scores = torch.matmul(q, key.transpose(-1, -2)).float()  # [B, Hk, g, T]
    scores = scores * (scaling if scaling is not None else D ** -0.5)
    if attention_mask is not None:
        # [B, 1, 1, T] broadcasts over (Hk, g)
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, Hk, g, Dv]
    return out.reshape(B, Hq, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register :data:`GQA_DECODE` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_DECODE, gqa_decode_attention)
    AttentionMaskInterface.register(GQA_DECODE, sdpa_mask)
    return GQA_DECODE
