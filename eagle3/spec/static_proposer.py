"""The EAGLE-3 drafter on a preallocated KV cache, its draft steps replayed from CUDA graphs.

:class:`StaticEagle3Proposer` drafts exactly what :class:`eagle3.spec.proposer.Eagle3Proposer`
drafts (same inputs, same masks, same positions), with the drafter's keys and values in
one :class:`eagle3.runtime.slots.SlotCache`:

* ``begin`` over the ``m`` newly verified positions writes slots ``start .. start+m-1``
  (causal); a round's ``m`` is ``1 .. num_steps + 1``, so each ``m`` gets its own graph;
  the first ``begin`` after the prompt (``m = P``) runs eagerly;
* draft step ``i`` over ``w`` nodes writes the ``w`` slots after the previous steps' nodes;
  a chain's node sees everything before its slot, a tree node the verified prefix and
  its ancestors (the same relation as the dynamic proposer's);
* ``end_round`` drops nothing: the next ``begin`` overwrites the draft slots and the
  mask hides them until then.

Attention reads the cache's span bucket (:meth:`eagle3.runtime.slots.SlotCache.span_for`);
graphs are keyed by shape and span.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from eagle3.runtime.graphs import GraphedCall
from eagle3.spec.proposer import Eagle3Proposer
from eagle3.runtime.slots import SlotCache, prefix_mask


class StaticEagle3Proposer(Eagle3Proposer):
    """:class:`Eagle3Proposer` on a :class:`SlotCache` (module docstring).

    Args:
        drafter: an ``eagle3.model.drafter.Eagle3Drafter``.
        aux_layer_ids: HF-convention ids the drafter was trained on.
        max_len: KV slots: longest prompt + generated tokens + one round's draft nodes.
        cuda_graphs: replay begin/draft steps from CUDA graphs; None = when the drafter
            is on CUDA. Ignored (eager) on CPU.
        max_graphed_begin: ``begin`` calls over at most this many positions are graphed
            (one graph per count); longer ones (the prompt) run eagerly.
        min_span: smallest attention span in slots (:class:`SlotCache`); None = attend
            over all ``max_len`` slots in every call.

    Raises:
        Eagle3Error: a non-positive ``max_len``.
    """

    def __init__(self, drafter, aux_layer_ids: Sequence[int], max_len: int = 4096,
                 cuda_graphs: Optional[bool] = None, max_graphed_begin: int = 16,
                 min_span: Optional[int] = 256):
        arch = drafter.arch
        device = drafter.fc.weight.device
        self.slot_cache = SlotCache(arch.num_layers, arch.num_key_value_heads, arch.head_dim, max_len,
                                    drafter.fc.weight.dtype, device, min_span)
        self.cuda_graphs = device.type == "cuda" and (cuda_graphs is None or bool(cuda_graphs))
        self.max_graphed_begin = int(max_graphed_begin)
        self._begin_calls = GraphedCall(self._begin, enabled=self.cuda_graphs)
        self._step_calls = GraphedCall(self._step, enabled=self.cuda_graphs)
        self._first = torch.zeros(1, dtype=torch.long, device=device)
        self._pos = torch.zeros(1, dtype=torch.long, device=device)
        super().__init__(drafter, aux_layer_ids)

    def reset(self) -> None:
        """Start a new sequence (the cache's buffers are kept)."""
        self.cache = self.slot_cache
        self.cache.length = 0
        self.committed = 0
        self._used = 0  # draft slots written this round
        self._hidden: Optional[torch.Tensor] = None
        self._ancestors: Optional[torch.Tensor] = None

    # ----------------------------------------------------------------- graphed calls
    def _begin(self, ids: torch.Tensor, aux: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids [m]``, ``aux [m, 3*Ht]`` at slots/positions ``first .. first+m-1`` ->
        ``(hidden [1, H] of the last row, logits [Vd])``."""
        slots = first + torch.arange(ids.numel(), device=ids.device)
        self.cache.set_slots(slots)
        hidden = self.drafter.fuse(aux.to(self.dtype)[None])  # [1, m, H]
        mask = prefix_mask(self.cache.span, slots)[None, None]
        out = self.drafter(ids[None], hidden, slots[None], attention_mask=mask, past_key_values=self.cache,
                           use_cache=True, return_logits=False)
        last = out.hidden_states[0, -1:]  # [1, H]
        return last, self.drafter.compute_logits(last)[0]

    def _step(self, ids: torch.Tensor, hidden: torch.Tensor, first: torch.Tensor, pos: torch.Tensor,
              mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``w`` nodes (``ids [w]``, parent outputs ``hidden [w, H]``) at slots ``first ..``
        and drafter position ``pos [1]``; causal over the span's slots unless ``mask [w, span]``
        -> ``(hidden [w, H], logits [w, Vd])``."""
        w = ids.numel()
        slots = first + torch.arange(w, device=ids.device)
        self.cache.set_slots(slots)
        if mask is None:
            mask = prefix_mask(self.cache.span, slots)
        out = self.drafter(ids[None], hidden[None].to(self.dtype), pos[None].expand(1, w),
                           attention_mask=mask[None, None], past_key_values=self.cache, use_cache=True)
        return out.hidden_states[0], out.logits[0]

    # ------------------------------------------------------------- proposer interface
    def begin(self, input_ids, aux, start):
        """See :meth:`Eagle3Proposer.begin`.

        Raises:
            RuntimeError: ``start`` is not the number of positions read so far.
            Eagle3Error: the positions do not fit ``max_len``.
        """
        if start != self.committed:
            raise RuntimeError(f"drafter state holds {self.committed} positions, round starts at {start}")
        m = input_ids.numel()
        span = self.cache.set_span(self.cache.span_for(start + m))
        self._first.fill_(start)
        if m <= self.max_graphed_begin:
            self._hidden, logits = self._begin_calls(("begin", m, span), input_ids, aux, self._first)
        else:
            self._hidden, logits = self._begin(input_ids, aux, self._first)
        self.committed = self.cache.length = start + m
        self._used, self._ancestors = 0, None
        return logits

    def step(self, input_ids, parents, position):
        """See :meth:`Eagle3Proposer.step`."""
        w = input_ids.numel()
        first = self.committed + self._used
        span = self.cache.set_span(self.cache.span_for(first + w))
        hidden = self._hidden[parents]  # [w, H]
        self._first.fill_(first)
        self._pos.fill_(position)
        if w > 1 or (self._ancestors is not None and self._ancestors.shape[0] > 1):  # a tree level
            dev = input_ids.device
            prev = (self._ancestors[parents] if self._ancestors is not None
                    else torch.zeros(w, 0, dtype=torch.bool, device=dev))
            anc = torch.cat([prev, torch.eye(w, dtype=torch.bool, device=dev)], dim=1)  # [w, used + w]
            self._ancestors = anc
            mask = torch.zeros(w, span, dtype=torch.bool, device=dev)
            mask[:, : self.committed] = True
            mask[:, self.committed : first + w] = anc
            self._hidden, logits = self._step_calls(("tree", w, span), input_ids, hidden,
                                                    self._first, self._pos, mask)
        else:  # a chain node sees every slot before its own
            self._hidden, logits = self._step_calls(("chain", w, span), input_ids, hidden, self._first, self._pos)
        self._used += w
        return logits

    def end_round(self) -> None:
        """Forget this round's draft nodes (their slots are masked until overwritten)."""
        self._used, self._ancestors = 0, None
