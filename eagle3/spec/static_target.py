"""The target on a preallocated KV cache, with its verify pass and decode step replayed from CUDA graphs.

:class:`StaticTargetRunner` is a :class:`eagle3.spec.target.TargetRunner` whose cache is
one :class:`eagle3.runtime.slots.SlotCache` allocated for ``max_len`` positions and reused by
every prompt. Every call writes at explicit slots under an explicit mask:

* prefill (``P`` tokens, eager: its length varies): slots ``0 .. P-1``, causal;
* decode step (1 token at position ``n``) and chain verify pass (``N`` tokens after
  ``length``): slots ``length .. length+N-1``, causal over the slots, the mask built
  inside the call from the first slot;
* tree verify pass: the same slots, positions ``length + depth``, the tree mask of
  :func:`eagle3.runtime.slots.tree_mask_over_slots` as an input;
* roll back: nothing for a chain or a prefix path (the mask hides what follows the
  verified prefix); a tree path is moved behind the prefix with one index copy per layer.

Attention reads the cache's span bucket (:meth:`eagle3.runtime.slots.SlotCache.span_for`), not
all ``max_len`` slots. Decode steps and verify passes have fixed shapes per span, so on
CUDA they are replayed from graphs (:class:`eagle3.runtime.graphs.GraphedCall`, one per
shape and span); the aux hidden states
are read inside the call by the same forward hooks as the dynamic runner, so they are
part of the graph's outputs. On CPU the same calls run eagerly.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from eagle3.runtime.graphs import GraphedCall
from eagle3.runtime.slots import SlotCache, prefix_mask, tree_mask_over_slots
from eagle3.spec.target import TargetRunner


class StaticTargetRunner(TargetRunner):
    """A :class:`TargetRunner` on one preallocated :class:`SlotCache` (module docstring).

    Args:
        model: a transformers causal LM (eval mode); its attention must take a 4D mask
            (``sdpa`` or ``eager``, see :meth:`TargetRunner.tree_mask`).
        aux_layer_ids: as for :class:`TargetRunner`.
        max_len: KV slots: the longest prompt + generated tokens + one round's draft.
        cuda_graphs: replay decode steps and verify passes from CUDA graphs; None = when
            the model is on CUDA. Ignored (eager) on CPU.
        min_span: smallest attention span in slots (:class:`SlotCache`); None = attend
            over all ``max_len`` slots in every call.

    Raises:
        Eagle3Error: as :class:`TargetRunner`, or an attention implementation without
            4D masks.
    """

    def __init__(self, model, aux_layer_ids: Optional[Sequence[int]] = None, max_len: int = 4096,
                 cuda_graphs: Optional[bool] = None, min_span: Optional[int] = 256):
        super().__init__(model, aux_layer_ids)
        self.tree_mask(torch.ones(1, 1, dtype=torch.bool, device=self.device))  # raises for other attention kinds
        dtype = next(model.parameters()).dtype
        self.cache = SlotCache.for_model(model.config, max_len, dtype, self.device, min_span)
        on_cuda = self.device.type == "cuda"
        self.cuda_graphs = on_cuda and (cuda_graphs is None or bool(cuda_graphs))
        self._calls = GraphedCall(self._step, enabled=self.cuda_graphs)
        self._decode_calls = GraphedCall(self._decode_step, enabled=self.cuda_graphs)
        self._first = torch.zeros(1, dtype=torch.long, device=self.device)  # first slot of a call

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def new_cache(self) -> SlotCache:
        """The runner's one cache, emptied (its buffers keep their addresses)."""
        self.cache.length = 0
        return self.cache

    def reserve(self, cache: SlotCache, length: int) -> None:
        """Raise :class:`Eagle3Error` when ``length`` positions do not fit the cache."""
        cache.check_room(length)

    # -------------------------------------------------------------------- forwards
    def _run(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
             last_only: bool, capture: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``ids, pos [1, n]``, ``slots [n]``, ``mask [n, span]`` bool -> logits, aux."""
        self.cache.set_slots(slots)
        return self.forward(ids, pos, self.cache, attention_mask=self.tree_mask(mask), last_only=last_only,
                            capture=capture)

    def _step(self, ids: torch.Tensor, pos: torch.Tensor, first: torch.Tensor,
              mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
        """The graphed call: ``n`` tokens at slots ``first .. first+n-1`` (``first [1]``),
        causal over the span's slots unless ``mask [n, span]`` is given. Returns
        ``(logits [n, V],)`` or ``(logits, aux [n, 3H])``."""
        slots = first + torch.arange(ids.shape[1], device=ids.device)
        if mask is None:
            mask = prefix_mask(self.cache.span, slots)
        logits, aux = self._run(ids, pos, slots, mask, last_only=False, capture=self.aux_layer_ids is not None)
        return (logits,) if aux is None else (logits, aux)

    def _decode_step(self, ids: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor]:
        """The graphed decode step: one token at slot and position ``first [1]`` -> ``(logits [1, V],)``."""
        logits, _ = self._run(ids, first[None], first, prefix_mask(self.cache.span, first), last_only=False,
                              capture=False)
        return (logits,)

    def prefill(self, input_ids, cache, capture=True):
        """See :meth:`TargetRunner.prefill` (eager: the prompt length varies)."""
        P = input_ids.shape[1]
        span = cache.set_span(cache.span_for(P))
        slots = torch.arange(P, device=self.device)
        out = self._run(input_ids, slots[None], slots, prefix_mask(span, slots), last_only=True,
                        capture=capture)
        cache.length = P
        return out

    def decode(self, token, position, cache):
        """See :meth:`TargetRunner.decode` (a graph replay on CUDA)."""
        span = cache.set_span(cache.span_for(position + 1))
        self._first.fill_(position)
        logits = self._decode_calls(("decode", span), token[None], self._first)[0]
        cache.length = position + 1
        return logits

    def verify(self, tokens, depth, ancestors, cache, length):
        """See :meth:`TargetRunner.verify` (a graph replay on CUDA, one graph per shape)."""
        n = tokens.numel()
        span = cache.set_span(cache.span_for(length + n))
        self._first.fill_(length)
        pos = (length + depth)[None]
        if ancestors is None:
            out = self._calls(("chain", n, span), tokens[None], pos, self._first)
        else:
            mask = tree_mask_over_slots(span, length, ancestors)
            out = self._calls(("tree", n, span), tokens[None], pos, self._first, mask)
        return out[0], (out[1] if len(out) > 1 else None)

    def rollback(self, cache, length, path):
        """See :meth:`TargetRunner.rollback`: nothing to drop (masked); a tree path is moved."""
        cache.length = length + len(path)
        if list(path) == list(range(len(path))):
            return None
        path_t = torch.tensor(list(path), device=self.device)
        cache.move(length + path_t, length)
        return path_t
