"""A preallocated KV cache written at explicit slots, for the target and the drafter.

:class:`SlotCache` holds one ``[1, kv_heads, max_len, head_dim]`` key and value buffer
per layer, allocated once and reused by every prompt. A forward writes its new keys
and values at the slots given by :meth:`SlotCache.set_slots` (a device tensor, so the
write is one ``index_copy_`` per layer and the same kernel for any position), and
attention reads the first :attr:`SlotCache.span` slots of the buffer under an explicit 4D
mask that hides every slot not (yet) part of the sequence. The span is a bucket
(:meth:`SlotCache.span_for`: ``min_span`` doubled until it covers the call, at most
``max_len``), so a short sequence in a cache sized for 2,048-token prompts does not
attend over 2,000 empty slots in every layer of every call; each bucket is one more
fixed shape for :mod:`eagle3.runtime.graphs`. Buffers are allocated for ``max_len`` rounded up
to a multiple of :data:`SLOT_ALIGN` (64), so no span is an odd width: on one H200 a 4-token
verify pass of a 30-layer target over 2,183 slots took 5.41 ms, over 2,184 slots 4.48 ms,
over 2,048 4.28 ms and over 512 3.54 ms (``benchmarks/round_breakdown.py``). Hence:

* roll back = nothing: slots after the verified prefix are masked until written again;
* tree compaction = one index copy per layer (the accepted path's slots moved to the
  first slots after the prefix);
* every forward of ``n`` tokens within one span bucket has the same shapes and buffer
  addresses whatever the position, which is what CUDA graph replay needs
  (:mod:`eagle3.runtime.graphs`; callers key their graphs by ``(n, span)``).

It implements the two calls transformers' decoder layers make on a cache
(``update(keys, values, layer_idx)`` and ``get_seq_length``; transformers >= 5 builds
no mask when it is given a 4D one, ``masking_utils._preprocess_mask_arguments``) and the
two the drafter's attention makes (:mod:`eagle3.model.drafter`), so neither model is
changed. The idea is the one of transformers' ``StaticCache`` and of the serving
engines' paged KV pools; the 5.x ``StaticCache`` writes at a running counter rather
than at given slots, which cannot express a rollback or a tree.
"""

from __future__ import annotations

from typing import Optional

import torch

from eagle3.errors import Eagle3Error

SLOT_ALIGN = 64  # buffers hold a multiple of this many slots (module docstring)


def kv_layout(config) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers decoder config
    (``num_hidden_layers``, ``num_key_value_heads`` or the head count, ``head_dim`` or
    ``hidden_size / num_attention_heads``)."""
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return int(config.num_hidden_layers), kv, head_dim


class SlotCache:
    """Preallocated per-layer K/V buffers written at explicit slots (module docstring).

    Args:
        num_layers: layers that call :meth:`update` (``layer_idx`` in ``0..num_layers-1``).
        num_kv_heads: key/value heads per layer.
        head_dim: per-head size of keys and values.
        max_len: slots per layer: the longest sequence (prompt + generated + one
            round's draft) this cache must hold; rounded up to a multiple of
            :data:`SLOT_ALIGN`, which :attr:`max_len` then reports.
        dtype: buffer dtype (the model's).
        device: buffer device.
        min_span: smallest attention span (slots); spans double from it (:meth:`span_for`).
            None: attention always spans all ``max_len`` slots.

    Attributes:
        length: host-side count of verified positions (bookkeeping of the caller;
            attention never reads it, the mask does the hiding).
        span: slots the next forward's attention reads (``[:, :, :span]`` of each buffer);
            masks passed with it are ``[n, span]``. Set with :meth:`set_span`.

    Raises:
        Eagle3Error: a non-positive size.
    """

    is_compileable = True

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str, min_span: Optional[int] = 256):
        if min(num_layers, num_kv_heads, head_dim, max_len, 1 if min_span is None else min_span) <= 0:
            raise Eagle3Error(f"SlotCache sizes must be positive, got layers={num_layers} kv_heads={num_kv_heads} "
                              f"head_dim={head_dim} max_len={max_len} min_span={min_span}")
        max_len = -(-int(max_len) // SLOT_ALIGN) * SLOT_ALIGN
        shape = (1, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = int(max_len)
        self.min_span = None if min_span is None else int(min_span)
        self.span = self.max_len
        self.slots = torch.zeros(1, dtype=torch.long, device=device)  # where the next forward writes
        self.length = 0

    @classmethod
    def for_model(cls, config, max_len: int, dtype: torch.dtype, device,
                  min_span: Optional[int] = 256) -> "SlotCache":
        """A cache shaped for a transformers decoder config (:func:`kv_layout`)."""
        return cls(*kv_layout(config), max_len, dtype, device, min_span)

    def span_for(self, end: int) -> int:
        """The attention span of a call that writes up to slot ``end - 1``: ``min_span``
        doubled until it reaches ``end``, capped at ``max_len`` (``max_len`` when spans are
        off). A sequence of length L therefore attends over fewer than 2L slots (or
        ``min_span``), and a cache of ``max_len`` slots has about ``log2(max_len / min_span)``
        spans, each a separate graph shape.

        Raises:
            Eagle3Error: ``end`` beyond ``max_len``.
        """
        self.check_room(end)
        if self.min_span is None:
            return self.max_len
        span = self.min_span
        while span < end:
            span *= 2
        return min(span, self.max_len)

    def set_span(self, span: int) -> int:
        """Make the next forwards attend over slots ``0 .. span - 1``; returns ``span``."""
        self.span = int(span)
        return self.span

    def set_slots(self, slots: torch.Tensor) -> None:
        """Make the next forward write its ``n`` new positions at ``slots`` (``[n]`` int64, on
        the cache's device). The tensor itself is kept, not copied: inside a captured CUDA
        graph it is the graph's static input, whose address every replay reads."""
        self.slots = slots

    def check_room(self, end: int) -> None:
        """Raise :class:`Eagle3Error` when slot ``end - 1`` is beyond the buffers."""
        if end > self.max_len:
            raise Eagle3Error(
                f"the sequence needs {end} KV slots but the static cache holds {self.max_len}; "
                "raise spec.max_len (or lower max_new_tokens / max_prompt_tokens)"
            )

    # --- what transformers' decoder layers and the drafter's attention call -------------
    @torch.compiler.disable  # stays eager inside compiled layers (eagle3.spec.compiled)
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[1, kv, n, d]`` keys and values at the current slots; return views of the
        first :attr:`span` slots, ``[1, kv, span, d]``, of layer ``layer_idx``'s buffers
        (attention masks what is unused)."""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.slots, key_states.to(k.dtype))
        v.index_copy_(2, self.slots, value_states.to(v.dtype))
        return k[:, :, : self.span], v[:, :, : self.span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The caller's verified length (host int; only read when no mask is given, which
        callers of this cache never do)."""
        return self.length

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        """``(kv_length, kv_offset) = (span, 0)``: attention spans the first :attr:`span` slots."""
        return self.span, 0

    # --- rollback ----------------------------------------------------------------------------
    def move(self, src: torch.Tensor, dst_start: int) -> None:
        """Copy slots ``src`` (``[m]`` int64, device) to ``dst_start .. dst_start + m - 1`` in
        every layer (tree compaction: the accepted path moved behind the prefix)."""
        dst = torch.arange(dst_start, dst_start + src.numel(), device=src.device)
        for buf in (*self.keys, *self.values):
            buf.index_copy_(2, dst, buf.index_select(2, src))


def prefix_mask(max_len: int, query_slots: torch.Tensor) -> torch.Tensor:
    """Causal visibility over the first ``max_len`` slots of a :class:`SlotCache` (its
    :attr:`SlotCache.span`): ``[n, max_len]`` bool, row ``i`` sees
    slots ``0 .. query_slots[i]`` (a chain's verify pass, a decode step, a prefill)."""
    return torch.arange(max_len, device=query_slots.device)[None, :] <= query_slots[:, None]


def tree_mask_over_slots(max_len: int, length: int, ancestors: torch.Tensor) -> torch.Tensor:
    """Tree visibility over the first ``max_len`` slots (the span) of a :class:`SlotCache`:
    ``[n, max_len]`` bool; node ``i`` (written at
    slot ``length + i``) sees the prefix ``0 .. length - 1`` and its ancestors
    (``ancestors [n, n]`` bool, :func:`eagle3.spec.tree.tree_ancestors`)."""
    n = ancestors.shape[0]
    mask = torch.zeros(n, max_len, dtype=torch.bool, device=ancestors.device)
    mask[:, :length] = True
    mask[:, length : length + n] = ancestors
    return mask
