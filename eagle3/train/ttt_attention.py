"""Attention masks of the training-time test's unroll (:mod:`eagle3.train.ttt`).

Step ``j`` of the unroll attends over the keys of steps ``0..j`` concatenated: the
step-0 keys of the whole prefix (causal) and, for steps ``j >= 1``, each row's own
chain keys. :func:`ttt_attention_mask` is that pattern as one dense bool mask (the
formulation of SpecForge / speculators); :class:`ChainMask` computes the same attention
chunk by chunk of chain rows, so that the keys a dense mask hides are never computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle3.train.drafter import repeat_kv


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
