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

:data:`GQA_SDPA` (any device) is SDPA itself over the un-repeated cache, the query heads of each
kv group folded into the query axis (:func:`eagle3.gqa.folded_gqa_sdpa`), for calls of up to
:data:`eagle3.gqa.FOLD_MAX_QUERIES` queries (decode steps, verify passes, tree verification);
other calls go to ``sdpa_attention_forward`` as above. :data:`GQA_SDPA_OUTSIDE_COMPILE` is the
same function under ``torch.compiler.disable``, what :func:`eagle3.spec.compiled.compile_decoder_layers`
switches it to when the attention must stay out of the compiled layers.
"""

from __future__ import annotations

import torch

GQA_DECODE = "eagle3_gqa_decode"
GQA_SDPA = "eagle3_gqa_sdpa"
GQA_SDPA_OUTSIDE_COMPILE = "eagle3_gqa_sdpa_outside_compile"

_PASS_THROUGH = ("softcap", "s_aux", "sinks", "position_bias")


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
    if Q != 1 or dropout or Hq % Hk or per_head_mask or any(kwargs.get(k) is not None for k in _PASS_THROUGH):
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


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                       scaling: float | None = None, **kwargs):
    """Attention with the signature of transformers' attention functions: folded GQA SDPA
    (:func:`eagle3.gqa.folded_gqa_sdpa`) for few queries, else ``sdpa_attention_forward``.

    Args:
        module, query, key, value, dropout, scaling: as in :func:`gqa_decode_attention`
            (``query [B, Hq, Q, D]``, ``key``/``value`` ``[B, Hk, T, D]``).
        attention_mask: ``sdpa``'s ``[B, 1, Q, T]`` mask (bool, True = attend, or additive
            float), or None.

    Returns:
        ``(attn_output [B, Q, Hq, Dv], None)``, as ``sdpa_attention_forward`` returns it.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from eagle3.gqa import can_fold, grouped_attention

    if dropout or any(kwargs.get(k) is not None for k in _PASS_THROUGH) or not can_fold(query, key, attention_mask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = grouped_attention(query, key, value, attention_mask, scale=scaling)  # [B, Hk, g, Q, Dv]
    B, Q = query.shape[0], query.shape[2]
    return out.permute(0, 3, 1, 2, 4).reshape(B, Q, query.shape[1], value.shape[-1]), None  # one copy at most


def register_gqa_sdpa() -> str:
    """Register :data:`GQA_SDPA` and :data:`GQA_SDPA_OUTSIDE_COMPILE` with transformers
    (idempotent; masks built as for ``sdpa``); returns :data:`GQA_SDPA`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if GQA_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention)
        AttentionInterface.register(GQA_SDPA_OUTSIDE_COMPILE, torch.compiler.disable(gqa_sdpa_attention))
        for key in (GQA_SDPA, GQA_SDPA_OUTSIDE_COMPILE):
            AttentionMaskInterface.register(key, sdpa_mask)
    return GQA_SDPA


def use_gqa_sdpa(model) -> None:
    """Switch a transformers model attending with ``sdpa`` to :data:`GQA_SDPA` (idempotent).

    Raises:
        Eagle3Error: a model without ``set_attn_implementation``, or attending with anything
            but ``sdpa`` (or already :data:`GQA_SDPA` / its compile-disabled twin).
    """
    from eagle3.errors import Eagle3Error

    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl in (GQA_SDPA, GQA_SDPA_OUTSIDE_COMPILE):
        return
    if not hasattr(model, "set_attn_implementation") or impl != "sdpa":
        raise Eagle3Error(f"{type(model).__name__} (attention {impl!r}) cannot take the folded GQA attention: that "
                          "needs a transformers model with attn_implementation='sdpa'")
    model.set_attn_implementation(register_gqa_sdpa())


def register() -> str:
    """Register :data:`GQA_DECODE` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_DECODE, gqa_decode_attention)
    AttentionMaskInterface.register(GQA_DECODE, sdpa_mask)
    return GQA_DECODE
