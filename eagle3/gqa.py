"""Grouped-query attention for a few queries, without repeating the keys and values.

With grouped-query attention (GQA) each key/value head serves ``g = Hq / Hk`` query heads.
transformers' ``sdpa`` path (``sdpa_attention_forward``) copies every key and value head ``g``
times (``repeat_kv``) before SDPA whenever a mask is given, because SDPA's own ``enable_gqa``
then falls back to its math kernel (transformers' ``use_gqa_in_sdpa``); the drafter's draft
steps copy them always. For one or a few new
queries over a long cache that copy is the attention's largest cost: at batch 256 over 384
slots a SmolLM2-shaped layer (9 query / 3 kv heads, head dim 64) writes 226 MB of repeated
keys and values per layer and step to read them back once, against 75 MB of cache.

The query heads of a group can instead be folded into the query axis (the decode-time GQA
layout of FlashDecoding and of the serving engines' paged kernels): ``q [B, Hq, Q, d]`` is
viewed as ``[B, Hk, g * Q, d]``, where row ``i * Q + t`` of kv head ``j`` holds query head
``j * g + i``'s token ``t`` (transformers' ``repeat_kv`` order: query head ``h`` reads kv head ``h // g``),
and attends to the un-repeated ``[B, Hk, S, d]`` cache. The mask ``[B, 1, Q, S]`` is shared by
the heads, so row ``i * Q + t`` takes mask row ``t``: the mask is repeated ``g`` times along
the query axis when ``Q > 1`` and broadcast when ``Q == 1``. Every score is the one ``repeat_kv``
would give, so the result is the same attention (equal in float32 up to summation order,
``tests/test_gqa.py``).

Worth it only for few queries: the folded query axis is ``g`` times longer, and the repeated
mask costs ``B * g * Q * S`` elements, so prefill (``Q`` in the hundreds) keeps ``repeat_kv``;
:data:`FOLD_MAX_QUERIES` is the cut.

For transformers models, :func:`gqa_sdpa_attention` is the same behind transformers' attention
signature, registered as :data:`GQA_SDPA` (and :data:`GQA_SDPA_OUTSIDE_COMPILE`, the twin that
:func:`eagle3.spec.compiled.compile_decoder_layers` keeps out of compiled layers); calls it cannot
fold go to transformers' ``sdpa_attention_forward``. :func:`use_gqa_sdpa` switches a model to it
(``engine.gqa_fold``; :func:`wants_fold` resolves the setting), :func:`fold_drafter_attention`
the drafter. On one H100 it took batched regeneration from 0.62x to 1.56-1.60x transformers'
compiled static-cache ``generate`` at batch 256 (``docs/performance.md``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from eagle3.errors import Eagle3Error

FOLD_MAX_QUERIES = 64  # calls with more queries than this (prefill) keep repeat_kv: the module docstring

# transformers attention-implementation keys (AttentionInterface): the folded SDPA, its twin kept out of
# compiled code (torch.compiler.disable), and the CPU decode attention of eagle3.engines.hf.attention
GQA_SDPA = "eagle3_gqa_sdpa"
GQA_SDPA_OUTSIDE_COMPILE = "eagle3_gqa_sdpa_outside_compile"
GQA_DECODE = "eagle3_gqa_decode"
# attention options the GQA paths do not implement: calls carrying them go to transformers' sdpa unchanged
PASS_THROUGH = ("softcap", "s_aux", "sinks", "position_bias")


def can_fold(query: torch.Tensor, key: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> bool:
    """Whether :func:`folded_gqa_sdpa` applies: grouped heads (``Hq`` a multiple ``> 1`` of
    ``Hk``), at most :data:`FOLD_MAX_QUERIES` queries, and a mask shared by all heads with one
    row per query (``[B or 1, 1, Q, S]``), or no mask for a single query. ``Q > 1`` without a
    mask means SDPA's ``is_causal``, whose upper-left alignment does not survive the folding
    (an explicit causal mask folds)."""
    hq, hk, q_len = query.shape[1], key.shape[1], query.shape[2]
    if hq == hk or hq % hk or q_len > FOLD_MAX_QUERIES:
        return False
    if attn_mask is None:
        return q_len == 1
    return attn_mask.dim() == 4 and attn_mask.shape[1] == 1 and attn_mask.shape[2] == q_len


def folded_gqa_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: Optional[torch.Tensor], scale: Optional[float] = None) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` per query head, with the query heads folded into
    the query axis (module docstring).

    Args:
        query: ``[B, Hq, Q, d]``, any strides.
        key: ``[B, Hk, S, d]`` with ``Hq = g * Hk``.
        value: ``[B, Hk, S, dv]``.
        attn_mask: ``[B or 1, 1, Q, S]`` bool (True = attend) or additive float (SDPA's
            conventions), or None when ``Q == 1``.
        scale: score scale; None = ``d ** -0.5`` (SDPA's default).

    Returns:
        ``[B, Hq, Q, dv]`` in ``query``'s dtype, as ``F.scaled_dot_product_attention`` over
        ``repeat_kv``-ed keys and values returns it.

    Raises:
        ValueError: a call :func:`can_fold` refuses.
    """
    if not can_fold(query, key, attn_mask):
        raise ValueError(f"folded GQA attention needs grouped heads, at most {FOLD_MAX_QUERIES} queries and a mask "
                         f"shared by all heads; got query {tuple(query.shape)}, key {tuple(key.shape)}, mask "
                         f"{None if attn_mask is None else tuple(attn_mask.shape)}")
    return grouped_attention(query, key, value, attn_mask, scale).flatten(1, 2)


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: Optional[torch.Tensor], scale: Optional[float] = None) -> torch.Tensor:
    """:func:`folded_gqa_sdpa` before its heads are merged: ``[B, Hk, g, Q, dv]``, a view of
    SDPA's output in whatever memory layout the kernel chose (callers reshape it once into
    the layout they need). Same arguments; no checks (call :func:`can_fold` first)."""
    B, hq, q_len, d = query.shape
    hk = key.shape[1]
    g = hq // hk
    q = query.reshape(B, hk, g * q_len, d)  # row i*Q + t = query head (j*g + i), token t
    mask = attn_mask
    if mask is not None and q_len > 1:
        mask = mask.repeat(1, 1, g, 1)  # [B, 1, g*Q, S]: row i*Q + t reads mask row t
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)  # [B, Hk, g*Q, dv]
    return out.unflatten(2, (g, q_len))  # splitting one dimension is a view for any strides


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                       scaling: float | None = None, **kwargs):
    """Attention with the signature of transformers' attention functions: folded GQA SDPA
    (:func:`folded_gqa_sdpa`) for few queries, else ``sdpa_attention_forward``.

    Args:
        module: the attention module (what ``sdpa_attention_forward`` reads).
        query, key, value: ``[B, Hq, Q, D]``, ``[B, Hk, T, D]``, ``[B, Hk, T, Dv]``.
        dropout: only 0 takes the folded path.
        scaling: score scale; None = ``D ** -0.5``.
        attention_mask: ``sdpa``'s ``[B, 1, Q, T]`` mask (bool, True = attend, or additive
            float), or None.

    Returns:
        ``(attn_output [B, Q, Hq, Dv], None)``, as ``sdpa_attention_forward`` returns it.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if dropout or any(kwargs.get(k) is not None for k in PASS_THROUGH) or not can_fold(query, key, attention_mask):
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
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl in (GQA_SDPA, GQA_SDPA_OUTSIDE_COMPILE):
        return
    if not hasattr(model, "set_attn_implementation") or impl != "sdpa":
        raise Eagle3Error(f"{type(model).__name__} (attention {impl!r}) cannot take the folded GQA attention: that "
                          "needs a transformers model with attn_implementation='sdpa'")
    model.set_attn_implementation(register_gqa_sdpa())


def fold_drafter_attention(drafter: torch.nn.Module, on: bool = True) -> int:
    """Make every attention module of ``drafter`` that has a ``fold_gqa`` switch
    (:class:`eagle3.model.drafter.DrafterAttention`) use (``on``) or not use the folded
    layout in its draft steps; returns how many were set."""
    mods = [m for m in drafter.modules() if hasattr(type(m), "fold_gqa")]
    for m in mods:
        m.fold_gqa = bool(on)
    return len(mods)


def wants_fold(setting: Optional[bool], device_type: str, attn_implementation: str) -> bool:
    """``engine.gqa_fold`` resolved: ``None`` (auto) = on CUDA with ``sdpa`` attention (measured
    there; the CPU paths keep what they were timed with), ``True``/``False`` as given.

    Raises:
        Eagle3Error: ``True`` with an attention implementation other than ``sdpa``.
    """
    if setting is None:
        return device_type == "cuda" and attn_implementation == "sdpa"
    if setting and attn_implementation != "sdpa":
        raise Eagle3Error(f"engine.gqa_fold=true needs engine.attn_implementation=sdpa (got {attn_implementation!r}); "
                          "set engine.gqa_fold=false or attn_implementation=sdpa")
    return bool(setting)
