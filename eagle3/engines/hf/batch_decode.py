"""Batched regeneration on a preallocated KV cache, the decode step replayed from one CUDA graph per batch shape.

transformers' ``generate`` is either eager (a 135M target at batch 256 is launch-bound:
8,974 tok/s on one H200) or compiled with a static cache (27,732 tok/s), and the
compiled path compiles again for every new prompt width, which made it slower than the
eager path on real extraction (``docs/performance.md``). :class:`BatchDecoder` takes
the compiled path's speed without compiling: the decode step of a ``[B, S]`` batch
(``B`` rows, ``S`` slots) is captured once as a CUDA graph
(:class:`eagle3.runtime.graphs.GraphedCall`) and replayed for every step; a new batch
shape costs one capture (three eager steps), not a compilation. With the folded GQA attention
(``engine.gqa_fold``, :mod:`eagle3.gqa`; on by default on CUDA) the step reads the cache once
instead of a ``repeat_kv`` copy of it: 1.56-1.60x transformers' compiled path at batch 256 on
one H100 (0.62-0.64x without; ``docs/performance.md``).

* Cache (:class:`FlatSlotCache`): one flat ``[capacity, kv, d]`` key and value buffer
  per layer, allocated once; a batch of shape ``(B, S)`` uses its first ``B * S * kv * d``
  elements as a contiguous ``[B, kv, S, d]``, so every shape's graph reads and writes the
  same memory.
* Prompts are left-padded to the batch's widest ``W``: every row writes its ``t``-th
  new token at slot ``W + t``, one slot index for the whole batch, and row ``r`` attends
  slots ``W - len_r .. W + t`` (its own tokens) under an explicit 4D mask. Position ids
  are per row (``len_r + t``), as transformers derives them from the attention mask.
* The prefill is eager (its width varies); greedy choice is ``argmax`` (the lowest id
  on a tie, as the verifier takes it); sampling (temperature, top-p) runs eagerly on the
  graph's logits with a seeded generator (not the random stream ``generate`` draws, so
  sampled replies differ from ``generate``'s; greedy replies are the same up to kernel
  rounding: equal in float32, ``tests/test_batch_decode.py``).
* A row stops after any stop id (later tokens are the pad id and dropped); the loop ends
  when every row has stopped, checked every :data:`DONE_CHECK_EVERY` steps (one host
  read), or after ``max_new_tokens``.

On CPU the same code runs eagerly (no graphs).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from eagle3.errors import Eagle3Error
from eagle3.runtime.graphs import GraphedCall
from eagle3.runtime.slots import kv_layout
from eagle3.runtime.mask import explicit_mask

SLOT_MULTIPLE = 64  # batch widths (prompt + new tokens) are rounded up to this: fewer graph shapes, aligned keys
DONE_CHECK_EVERY = 16  # decode steps between host reads of "has every row stopped"
MAX_GRAPHS = 4  # decode-step graphs kept (each holds a memory pool of one step's activations and logits)


class FlatSlotCache:
    """Per-layer flat K/V buffers viewed as ``[B, kv, S, d]`` for the current batch shape.

    Implements what transformers' decoder layers call on a cache (``update`` and
    ``get_seq_length``), like :class:`eagle3.runtime.slots.SlotCache`, for a batch.

    Args:
        num_layers, num_kv_heads, head_dim: the target's attention shape.
        capacity: token slots per layer (``B * S`` of the largest batch shape).
        dtype, device: the buffers'.

    Raises:
        Eagle3Error: a non-positive size.
    """

    is_compileable = True

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str):
        if min(num_layers, num_kv_heads, head_dim, capacity) <= 0:
            raise Eagle3Error(f"FlatSlotCache sizes must be positive, got layers={num_layers} kv_heads={num_kv_heads} "
                              f"head_dim={head_dim} capacity={capacity}")
        shape = (capacity, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = int(capacity)
        self.rows, self.width = 1, 1
        self.slots = torch.zeros(1, dtype=torch.long, device=device)
        self.length = 0

    @classmethod
    def for_model(cls, config, capacity: int, dtype: torch.dtype, device) -> "FlatSlotCache":
        """A cache shaped for a transformers decoder config."""
        return cls(*kv_layout(config), capacity, dtype, device)

    def use(self, rows: int, width: int) -> None:
        """View the buffers as ``[rows, kv, width, d]`` from now on.

        Raises:
            Eagle3Error: ``rows * width`` is beyond the capacity.
        """
        if rows * width > self.capacity:
            raise Eagle3Error(f"a batch of {rows} rows x {width} slots needs {rows * width} KV slots per layer but "
                              f"the cache holds {self.capacity}; lower engine.generate_batch_size or "
                              "engine.max_batch_tokens")
        self.rows, self.width = int(rows), int(width)

    def _view(self, buf: torch.Tensor) -> torch.Tensor:
        """The first ``B * kv * S * d`` elements of ``buf`` as a contiguous ``[B, kv, S, d]``
        (the layout attention reads: the folded GQA attention of :mod:`eagle3.gqa` as it is,
        transformers' ``sdpa`` after repeating K/V per query head, since an explicit mask rules
        out SDPA's own GQA). A permuted ``[B, S, kv, d]`` view did the same at the same speed on
        one H200 (0.59x compiled ``generate`` either way, before the fold)."""
        B, S, kv, d = self.rows, self.width, buf.shape[1], buf.shape[2]
        return buf.view(-1)[: B * kv * S * d].view(B, kv, S, d)

    def set_slots(self, slots: torch.Tensor) -> None:
        """Make the next forward write its ``n`` new positions (every row alike) at ``slots [n]``."""
        self.slots = slots

    @torch.compiler.disable  # stays eager inside compiled layers (eagle3.spec.compiled)
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, kv, n, d]`` keys and values at the current slots; return the whole
        ``[B, kv, S, d]`` views (attention masks what is unused)."""
        k, v = self._view(self.keys[layer_idx]), self._view(self.values[layer_idx])
        k.index_copy_(2, self.slots, key_states.to(k.dtype))
        v.index_copy_(2, self.slots, value_states.to(v.dtype))
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Host bookkeeping only (callers always pass a 4D mask and position ids)."""
        return self.length

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        """``(kv_length, kv_offset) = (S, 0)``."""
        return self.width, 0


class BatchDecoder:
    """Batched generation with the decode step replayed from CUDA graphs (module docstring).

    Args:
        model: a transformers causal LM in eval mode with ``sdpa`` or ``eager`` attention
            (both read an explicit 4D mask).
        capacity: KV token slots per layer, at least ``B * round_up(W + max_new_tokens, 64)``
            of every batch it will be given.
        cuda_graphs: replay the decode step from CUDA graphs; None = when the model is on
            CUDA. Ignored (eager) on CPU.

    Raises:
        Eagle3Error: another attention implementation.
    """

    def __init__(self, model, capacity: int, cuda_graphs: Optional[bool] = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.attn = getattr(model.config, "_attn_implementation", None) or "sdpa"
        explicit_mask(torch.ones(1, 1, 1, 1, dtype=torch.bool), self.attn, self.dtype, "batched graph decoding")
        self.cache = FlatSlotCache.for_model(model.config, capacity, self.dtype, self.device)
        self.cuda_graphs = self.device.type == "cuda" and (cuda_graphs is None or bool(cuda_graphs))
        # extraction's batches come longest first, nearly every one a new shape: keep few graphs
        self._decode = GraphedCall(self._step, enabled=self.cuda_graphs, max_graphs=MAX_GRAPHS)
        self._slot = torch.zeros(1, dtype=torch.long, device=self.device)

    def _mask(self, visible: torch.Tensor) -> torch.Tensor:
        """``[B, n, S]`` bool -> the ``[B, 1, n, S]`` mask the attention reads (bool for sdpa,
        additive for eager)."""
        return explicit_mask(visible[:, None], self.attn, self.dtype, "batched graph decoding")

    def _step(self, tok: torch.Tensor, pos: torch.Tensor, start: torch.Tensor, slot: torch.Tensor
              ) -> tuple[torch.Tensor]:
        """The graphed decode step: ``tok, pos, start [B]`` int64, ``slot [1]`` -> ``(logits [B, V] float32,)``."""
        cols = torch.arange(self.cache.width, device=tok.device)
        visible = (cols[None, :] >= start[:, None]) & (cols[None, :] <= slot)  # [B, S]
        self.cache.set_slots(slot)
        out = self.model(input_ids=tok[:, None], position_ids=pos[:, None], attention_mask=self._mask(visible[:, None]),
                         past_key_values=self.cache, use_cache=True)
        return (out.logits[:, -1].float(),)

    @staticmethod
    def _choose(logits: torch.Tensor, temperature: float, top_p: float,
                generator: Optional[torch.Generator]) -> torch.Tensor:
        """``[B, V]`` float32 -> ``[B]`` next ids: argmax, or a top-p sample at ``temperature``."""
        if temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1.0:
            sorted_p, idx = probs.sort(dim=-1, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < top_p  # the smallest prefix reaching top_p (first always kept)
            sorted_p = sorted_p * keep
            probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int], pad_id: int,
                 temperature: float = 0.0, top_p: float = 1.0, seed: Optional[int] = None) -> list[list[int]]:
        """Generate up to ``max_new_tokens`` ids after each prompt.

        Args:
            prompts: ``B`` lists of target ids (any lengths >= 1).
            stop_ids: a row ends after the first of these (it is kept).
            pad_id: the id written after a row has stopped (never returned).
            temperature, top_p: sampling (``temperature <= 0``: greedy).
            seed: seeds the sampling generator (None: torch's global generator).

        Returns:
            per prompt, its new ids, cut after the first stop id.

        Raises:
            Eagle3Error: an empty prompt, or a batch beyond the cache's capacity.
        """
        if not prompts:
            return []
        if min(len(p) for p in prompts) < 1:
            raise Eagle3Error("batched decoding got an empty prompt")
        B, W, N = len(prompts), max(len(p) for p in prompts), int(max_new_tokens)
        if N < 1:
            return [[] for _ in prompts]
        S = -(-(W + N) // SLOT_MULTIPLE) * SLOT_MULTIPLE
        self.cache.use(B, S)
        dev = self.device
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        start = W - lens  # first real slot of each row
        ids = torch.full((B, W), int(pad_id), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, W - len(p):] = torch.tensor(list(p), dtype=torch.long)
        ids = ids.to(dev)
        gen = None
        if temperature > 0 and seed is not None:
            gen = torch.Generator(device=dev).manual_seed(int(seed))

        # prefill (eager): row r's query at slot q sees its own slots start_r .. q; a pad query sees itself only
        q = torch.arange(W, device=dev)
        cols = torch.arange(S, device=dev)
        visible = (cols[None, None, :] <= q[None, :, None]) & (cols[None, None, :] >= start[:, None, None])
        visible |= (cols[None, :] == q[:, None])[None]
        pos = (q[None, :] - start[:, None]).clamp(min=0)
        self.cache.set_slots(q)
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=self._mask(visible), past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].float()
        del out, visible
        stop = torch.tensor(sorted(set(int(s) for s in stop_ids)) or [-1], device=dev)
        tok = self._choose(logits, temperature, top_p, gen)
        done = torch.isin(tok, stop)
        steps = [tok]
        pos = lens.clone()  # position of the token fed next
        for t in range(1, N):
            self._slot.fill_(W + t - 1)
            logits = self._decode(("decode", B, S), tok, pos, start, self._slot)[0]
            tok = torch.where(done, torch.full_like(tok, int(pad_id)), self._choose(logits, temperature, top_p, gen))
            steps.append(tok)
            done = done | torch.isin(tok, stop)
            pos = pos + 1
            if t % DONE_CHECK_EVERY == 0 and bool(done.all()):
                break
        return [cut_after_stop(row, stop_ids) for row in torch.stack(steps, dim=1).tolist()]


def cut_after_stop(row: list[int], stop_ids: Sequence[int]) -> list[int]:
    """``row`` up to and including its first stop id (all of it when there is none)."""
    stops = set(int(s) for s in stop_ids)
    cut = next((j for j, t in enumerate(row) if t in stops), None)
    return row[: cut + 1] if cut is not None else row
