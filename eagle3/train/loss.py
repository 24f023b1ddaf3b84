"""The training-time test's loss: forward KL from the target's top-k to the drafter, eager or fused with ``lm_head``.

EAGLE-3 trains the drafter's distribution over the draft vocabulary toward the
target's, here the target's stored top-k restricted to the draft vocabulary and
renormalised (:func:`target_distribution`). Per loss row, in float32 whatever the
autocast dtype::

    KL = sum_k q_k (log q_k - log p_{id_k}),   log p = z - logsumexp(z),   z = lm_head(x)

:func:`kl_loss` computes it from materialised logits ``[N, Vd]``. :func:`fused_topk_kl`
computes the same numbers without keeping the logits: rows go through ``lm_head`` chunk
by chunk, only each row's ``logsumexp`` is kept, and the backward pass recomputes a
chunk's logits and forms their gradient ``dKL/dz = sum_k(q_k) softmax(z) - scatter(q)``
directly. The eager path keeps the bf16 logits and their float32 log-softmax for the
backward pass (6 bytes per row and draft-vocabulary entry, 2 GB for 10,000 rows of
32,000); the fused one keeps one float per row. It also returns each row's argmax (the
top-1 agreement metric), which otherwise needs the logits.
"""

from __future__ import annotations

import torch

#: float32 logits of one chunk of the fused loss: rows = LOGITS_CHUNK_BYTES // (4 * Vd)
LOGITS_CHUNK_BYTES = 1 << 28


def target_distribution(
    topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, t2d_index: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target top-k restricted to the draft vocabulary and renormalised, at a temperature.

    Args:
        topk_ids: ``[N, k]`` int target ids; topk_logprobs ``[N, k]`` float log-probs
            (full-vocabulary log-softmax; ``-inf`` allowed).
        t2d_index: ``[V]`` from :func:`eagle3.train.ttt.target_to_draft_index`.
        temperature: ``q_k ∝ p_k ** (1 / temperature)`` over the kept entries
            (``drafter.target_temperature``): 1 = the target's own distribution; below 1
            sharpens it toward its argmax (what greedy verification accepts), keeping the order.

    Returns:
        ``(draft_ids [N, k] int64, q [N, k] float32)``: entries outside the draft
        vocabulary get id 0 and ``q = 0``; rows with no entry inside sum to 0.
    """
    d = t2d_index[topk_ids.long()]
    inside = (d >= 0) & torch.isfinite(topk_logprobs)
    lp = topk_logprobs.float().masked_fill(~inside, float("-inf"))
    m = lp.max(dim=-1, keepdim=True).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp((lp - m) / temperature)  # / 1.0 is exact: the default changes no bit
    q = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
    return d.clamp_min(0), q


def _log_q(q: torch.Tensor) -> torch.Tensor:
    """``log q`` where ``q > 0``, else 0 (those terms carry weight 0), float32."""
    q = q.float()
    return torch.where(q > 0, q.clamp_min(1e-38).log(), torch.zeros_like(q))


def kl_loss(logits: torch.Tensor, draft_ids: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Forward KL ``sum_k q_k (log q_k - log p_k)`` per row, in float32.

    Args:
        logits: ``[N, Vd]`` drafter logits (any float dtype; upcast before log-softmax).
        draft_ids: ``[N, k]`` int64 draft ids of the target's top-k.
        q: ``[N, k]`` target probabilities over those ids (rows sum to 1, or to 0).

    Returns:
        ``[N]`` float32.
    """
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, draft_ids)  # [N, k]
    return (q.float() * (_log_q(q) - logp)).sum(-1)


class _FusedTopKKL(torch.autograd.Function):
    """:func:`fused_topk_kl`'s forward and backward (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, draft_ids, q, chunk):
        N = x.shape[0]
        acc = torch.float64 if x.dtype == weight.dtype == torch.float64 else torch.float32  # float64: gradcheck
        lse = torch.empty(N, dtype=acc, device=x.device)
        kl = torch.empty(N, dtype=acc, device=x.device)
        top = torch.empty(N, dtype=torch.int64, device=x.device)
        logq, qf = _log_q(q).to(acc), q.to(acc)
        mm_dtype = x.dtype
        for a in range(0, N, chunk):
            zc = x[a : a + chunk] @ weight.t()  # autocast, when on, picks the matmul dtype as nn.Linear would
            mm_dtype = zc.dtype
            z = zc.to(acc)
            lse[a : a + chunk] = torch.logsumexp(z, dim=-1)
            top[a : a + chunk] = z.argmax(-1)
            logp = z.gather(-1, draft_ids[a : a + chunk]) - lse[a : a + chunk, None]
            kl[a : a + chunk] = (qf[a : a + chunk] * (logq[a : a + chunk] - logp)).sum(-1)
        ctx.save_for_backward(x, weight, draft_ids, qf, lse)
        ctx.chunk, ctx.mm_dtype = chunk, mm_dtype
        ctx.mark_non_differentiable(top)
        return kl, top

    @staticmethod
    def backward(ctx, g_kl, _g_top):
        x, weight, draft_ids, q, lse = ctx.saved_tensors
        dt, chunk = ctx.mm_dtype, ctx.chunk
        xc, wc = x.to(dt), weight.to(dt)
        gx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        acc = lse.dtype
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        g_kl = g_kl.to(acc)
        scale = q.sum(-1) * g_kl  # [N]: dKL_i/dz_ij = sum_k(q_ik) p_ij - sum_k q_ik [j == id_ik]
        for a in range(0, x.shape[0], chunk):
            z = (xc[a : a + chunk] @ wc.t()).to(acc)
            g = torch.exp(z - lse[a : a + chunk, None]) * scale[a : a + chunk, None]
            g.scatter_add_(-1, draft_ids[a : a + chunk], -(q[a : a + chunk] * g_kl[a : a + chunk, None]))
            g = g.to(dt)
            if gx is not None:
                gx[a : a + chunk] = (g @ wc).to(x.dtype)
            if gw is not None:
                gw += (g.t() @ xc[a : a + chunk]).to(acc)
        return gx, (gw.to(weight.dtype) if gw is not None else None), None, None, None


def fused_topk_kl(x: torch.Tensor, weight: torch.Tensor, draft_ids: torch.Tensor, q: torch.Tensor,
                  chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kl_loss` of ``logits = x @ weight.T`` and each row's argmax, without keeping the logits.

    Args:
        x: ``[N, H]`` the rows entering ``lm_head`` (the drafter's normed hidden states).
        weight: ``[Vd, H]`` ``lm_head.weight``.
        draft_ids: ``[N, k]`` int64; q: ``[N, k]`` float (as for :func:`kl_loss`).
        chunk: rows per chunk (default: ``LOGITS_CHUNK_BYTES`` of float32 logits).

    Returns:
        ``(kl [N] float32 (float64 when ``x`` and ``weight`` are), argmax [N] int64)``; ``kl`` equals :func:`kl_loss` up to float
        rounding, with gradients for ``x`` and ``weight`` (recomputed chunk by chunk in the
        backward pass; under autocast the matmuls run in autocast's dtype, as ``nn.Linear`` would).
    """
    rows = chunk or max(1, LOGITS_CHUNK_BYTES // (4 * weight.shape[0]))
    return _FusedTopKKL.apply(x, weight, draft_ids, q, int(rows))
