"""Attention masks of the training-time test's unroll (:mod:`eagle3.train.ttt`).

Step ``j`` of the unroll attends over the keys of steps ``0..j`` concatenated: the
step-0 keys of the whole prefix (causal) and, for steps ``j >= 1``, each row's own
chain keys. :func:`ttt_attention_mask` is that pattern as one dense bool mask (the
formulation of SpecForge / speculators); :class:`ChainMask` computes the same attention
chunk by chunk of chain rows, so that the keys a dense mask hides are never computed, and
:class:`FlexChainMask` as one block-sparse FlexAttention kernel (CUDA training only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle3.errors import Eagle3Error
from eagle3.model.drafter import repeat_kv


def ttt_attention_mask(T: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Attention of step ``step`` over the keys of steps ``0..step`` concatenated.

    Returns ``None`` for step 0 (plain causal), else ``[1, 1, T, (step+1)*T]`` bool
    (True = attend): causal over block 0, the diagonal of blocks ``1..step``.
    """
    if step == 0:
        return None
    blocks = [torch.ones(T, T, dtype=torch.bool, device=device).tril()]
    eye = torch.eye(T, dtype=torch.bool, device=device)
    blocks += [eye] * step
    return torch.cat(blocks, dim=1)[None, None]


@dataclass
class ChainMask:
    """Attention of TTT step ``step >= 1`` over the keys ``[step-0 keys (T) | chain keys of
    steps 1..step (T' each)]``, computed per chunk of ``chunk`` chain rows.

    Query row ``i`` (chain row ``chain_rows[b, i]``) sees step-0 keys ``0 ..
    prefix_end[b, i] - 1`` and key ``T + (s - 1) * T' + i`` of each step ``s <= step``:
    what :func:`ttt_forward`'s dense mask ``[prefix | eye | ... | eye]`` selects. A chunk
    of rows ``a .. a + c - 1`` runs one SDPA call over the step-0 keys up to the chunk's
    largest ``prefix_end`` and its ``step * c`` own chain keys, so the work per query is
    ``prefix + step * c`` keys instead of ``T + step * T'``.

    Attributes:
        prefix_end: ``[B, T']`` int64, ``chain_rows + 1``.
        ends: per chunk, the largest ``prefix_end`` in it (host ints).
        T: step-0 keys; chunk: rows per chunk; step: the TTT step.
    """

    prefix_end: torch.Tensor
    ends: list[int]
    T: int
    chunk: int
    step: int = 1

    @classmethod
    def create(cls, chain_rows: torch.Tensor, T: int, chunk: int) -> "ChainMask":
        """From the batch's ``chain_rows [B, T']`` (one host read of the chunk maxima)."""
        prefix_end = chain_rows + 1
        Tp = chain_rows.shape[1]
        pad = -(-Tp // chunk) * chunk - Tp
        padded = F.pad(prefix_end, (0, pad), value=1)
        ends = padded.view(padded.shape[0], -1, chunk).amax(dim=(0, 2)).tolist() if Tp else []
        return cls(prefix_end, [int(e) for e in ends], int(T), int(chunk))

    def at(self, step: int) -> "ChainMask":
        """The same mask for TTT step ``step``."""
        return ChainMask(self.prefix_end, self.ends, self.T, self.chunk, int(step))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rep: int) -> torch.Tensor:
        """``q [B, h, T', d]``, ``k, v [B, kv, T + step * T', d]`` (``h = kv * rep``) ->
        ``[B, h, T', d]``, chunk by chunk (class docstring)."""
        B, _, Tp, _ = q.shape
        T, c, j = self.T, self.chunk, self.step
        outs = []
        for n, a in enumerate(range(0, Tp, c)):
            w = min(c, Tp - a)
            e = self.ends[n]
            own = [(T + (s - 1) * Tp + a, T + (s - 1) * Tp + a + w) for s in range(1, j + 1)]
            kk = torch.cat([k[:, :, :e]] + [k[:, :, lo:hi] for lo, hi in own], dim=2)  # [B, kv, e + j*w, d]
            vv = torch.cat([v[:, :, :e]] + [v[:, :, lo:hi] for lo, hi in own], dim=2)
            prefix = torch.arange(e, device=q.device)[None, None, :] < self.prefix_end[:, a : a + w, None]  # [B, w, e]
            eye = torch.eye(w, dtype=torch.bool, device=q.device).repeat(1, j).expand(B, w, j * w)
            mask = torch.cat([prefix, eye], dim=-1)[:, None]  # [B, 1, w, e + j*w]
            outs.append(F.scaled_dot_product_attention(q[:, :, a : a + w], repeat_kv(kk, rep), repeat_kv(vv, rep),
                                                       attn_mask=mask))
        return torch.cat(outs, dim=2)


_FLEX = None  # flex_attention, compiled on first use (FlexChainMask)


def _flex_attention():
    """``torch.nn.attention.flex_attention.flex_attention`` under ``torch.compile(dynamic=True)``
    (compiled on first use; sizes symbolic, so the length-bucketed batches share it; uncompiled
    it runs a reference path that materialises every score)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=True)
    return _FLEX


@dataclass
class FlexChainMask:
    """The attention of TTT step ``step >= 1`` as one block-sparse kernel: PyTorch's
    ``flex_attention`` with a ``BlockMask`` of the same pattern as :class:`ChainMask` and the
    dense ``[prefix | eye | ... | eye]`` mask.

    Query row ``i`` (chain row ``chain_rows[b, i]``) sees step-0 keys ``0 .. chain_rows[b, i]``
    and key ``T + (s - 1) * T' + i`` of each step ``s <= step``. The block mask lists, per block
    of 128 queries, only the key blocks holding such keys, so the kernel skips the rest: for a
    TTT-7 unroll over a 2,048-token sequence whose last 60% are chain rows, 0.40x the query-key
    pairs the dense mask's kernel is handed (counted from the block mask; ``docs/performance.md``,
    "Training: where a step's time goes"). Grouped-query attention is the kernel's (``enable_gqa``): no
    ``repeat_kv`` copies. One compiled kernel per process, one block mask per step.

    CUDA only for training: FlexAttention has no CPU backward pass (PyTorch 2.13); on CPU,
    without gradients, it runs uncompiled (the reference path), which is what the CPU tests
    compare with the dense mask.

    Attributes:
        chain_rows: ``[B, T']`` int64, the batch's chain rows (:class:`TTTCollator`).
        T: step-0 keys; step: the TTT step.
    """

    chain_rows: torch.Tensor
    T: int
    step: int = 1

    def at(self, step: int) -> "FlexChainMask":
        """The same mask for TTT step ``step``."""
        return FlexChainMask(self.chain_rows, self.T, int(step))

    def block_mask(self):
        """The step's ``BlockMask`` over ``[B, T']`` queries and ``T + step * T'`` keys."""
        from torch.nn.attention.flex_attention import create_block_mask

        rows = self.chain_rows
        B, Tp = rows.shape
        t0 = torch.tensor(self.T, device=rows.device)  # tensors, not ints: the compiled kernel is not specialised
        tp = torch.tensor(Tp, device=rows.device)      # on the lengths (one compilation for every batch shape)

        def mask_mod(b, h, q, kv):
            return torch.where(kv < t0, kv <= rows[b, q], (kv - t0) % tp == q)

        return create_block_mask(mask_mod, B, None, Tp, self.T + self.step * Tp, device=rows.device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rep: int) -> torch.Tensor:
        """``q [B, h, T', d]``, ``k, v [B, kv, T + step * T', d]`` (``h = kv * rep``) -> ``[B, h, T', d]``.

        Raises:
            Eagle3Error: on CPU with gradients (no FlexAttention backward there); on CUDA with a
                head dim below 16 (the compiled kernel's ``tl.dot`` takes no less; measured on one
                H200, torch 2.11).
        """
        if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
            raise Eagle3Error("drafter.ttt_attention=flex trains on CUDA only (PyTorch's FlexAttention has no "
                              "backward pass on CPU); use drafter.ttt_attention=dense on this device")
        if k.shape[2] != self.T + self.step * q.shape[2]:
            raise Eagle3Error(f"FlexChainMask step {self.step}: {k.shape[2]} keys for T={self.T} and "
                              f"T'={q.shape[2]} (expected T + step * T')")
        if q.device.type != "cpu" and q.shape[-1] < 16:
            raise Eagle3Error(f"drafter.ttt_attention=flex: the drafter's head dim is {q.shape[-1]}, and FlexAttention's "
                              "CUDA kernel needs at least 16; use drafter.ttt_attention=dense")
        if q.device.type == "cpu":
            from torch.nn.attention.flex_attention import flex_attention as flex
        else:
            flex = _flex_attention()
        return flex(q, k, v, block_mask=self.block_mask(), enable_gqa=rep > 1)


@dataclass
class DenseChainMask:
    """The dense ``[prefix | eye | ... | eye]`` bool mask of TTT step ``j >= 1`` over chain rows."""

    prefix: torch.Tensor  # [B, T', T] bool: step-0 keys 0..chain_rows[b, i]
    eye: torch.Tensor  # [B, T', T'] bool

    def at(self, j: int) -> torch.Tensor:
        """``[B, 1, T', T + j*T']`` bool, True = attend."""
        return torch.cat([self.prefix] + [self.eye] * j, dim=-1)[:, None]


def chain_attention(chain_rows: torch.Tensor, T: int, attention: str, chain_chunk: int | None):
    """The attention of the chain steps (``j >= 1``) over ``chain_rows [B, T']``: an object whose
    ``at(j)`` is step ``j``'s mask (dense bool, :class:`ChainMask` or :class:`FlexChainMask`).

    Raises:
        ValueError: an ``attention`` other than ``"dense"`` or ``"flex"``.
    """
    if attention == "flex":
        return FlexChainMask(chain_rows, T)
    if attention != "dense":
        raise ValueError(f"attention={attention!r}: use 'dense' or 'flex'")
    if chain_chunk:
        return ChainMask.create(chain_rows, T, int(chain_chunk))
    B, Tp = chain_rows.shape
    prefix = torch.arange(T, device=chain_rows.device)[None, None, :] <= chain_rows[:, :, None]
    return DenseChainMask(prefix, torch.eye(Tp, dtype=torch.bool, device=chain_rows.device).expand(B, Tp, Tp))
