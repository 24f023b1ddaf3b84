"""Acceptance of a verified draft: which drafted tokens the target keeps, and the token after them.

:func:`target_probs` is the distribution the target samples from (baseline and
speculative decoding alike); :func:`accept_greedy`, :func:`accept_chain_sampling` and
:func:`accept_tree_sampling` pick the accepted path of a :class:`DraftTree` from the
target's logits or probabilities at its nodes.

Temperature 0: the longest draft path whose every token equals the target's argmax at
its parent, plus the bonus token (the target's argmax after the last accepted node).
Temperature > 0 (both lossless, the output distribution is the target's):

* chain: drafts are sampled from the drafter's distribution ``q`` and verified by
  standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept
  ``x`` with probability ``min(1, p(x)/q(x))``, on rejection sample from
  ``norm(max(p - q, 0))``; when all are accepted, the bonus is sampled from ``p``.
* tree: drafts are the deterministic top-k candidates; at each node the children
  are tried in order, each accepted with probability ``p(x) / (mass of p not yet
  rejected)``, a rejected child's token is removed from ``p``; if no child is
  accepted the next token is sampled from what remains (the target-only tree
  sampling SGLang uses, ``tree_speculative_sampling_target_only`` with thresholds
  1). Sequentially trying candidates is exact sampling from ``p``.
"""

from __future__ import annotations

from typing import Optional

import torch

from eagle3.spec.tree import DraftTree


def target_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Next-token distribution the target samples from.

    Args:
        logits: ``[..., V]`` any float dtype.
        temperature: > 0.
        top_p: nucleus mass in (0, 1]; 1 keeps the full distribution.

    Returns:
        ``[..., V]`` float32 probabilities (tokens outside the nucleus are 0),
        each row summing to 1. Baseline and speculative decoding both sample from it.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep a token while the mass before it is < top_p (the top token always kept)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _sample(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One token id per row of ``probs [n, V]``: ``[n]`` int64, drawn with ``generator``."""
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor, max_depth: int) -> tuple[list[int], list[int]]:
    """Temperature-0 acceptance (one host sync).

    Args:
        tree: the verified draft (``N`` nodes).
        target_logits: ``[N, V]`` target logits at each node.
        max_depth: ``num_steps``.

    Returns:
        ``(path, tokens)``: tree indices of the accepted path (root first, parents
        before children) and the tokens it yields: the accepted drafts, then the bonus
        token (target argmax at the path's end).
    """
    best = target_logits.argmax(-1)  # [N]
    parent = tree.parents.clamp(min=0)
    ok = tree.tokens == best[parent]
    ok[0] = True
    for _ in range(max_depth):
        ok = ok & ok[parent]
    flags, parents, best_cpu, tokens = torch.stack([ok.long(), tree.parents, best, tree.tokens]).tolist()
    # follow accepted children from the root (the first one if two siblings share a token)
    path, node = [0], 0
    for j in range(1, len(flags)):
        if flags[j] and parents[j] == node:
            path.append(j)
            node = j
    return path, [tokens[j] for j in path[1:]] + [best_cpu[node]]


def accept_chain_sampling(
    tree: DraftTree,
    p: torch.Tensor,
    vocab_target_ids: torch.Tensor,
    generator: Optional[torch.Generator] = None,
) -> tuple[list[int], list[int]]:
    """Standard speculative sampling on a chain (one host sync).

    Args:
        tree: a chain with ``draft_probs [k, Vd]`` (drafts were sampled from them).
        p: ``[k+1, V]`` float32 target probabilities at root and each draft node.
        vocab_target_ids: ``[Vd]`` target id of each draft id.
        generator: the sequence's random generator.

    Returns:
        ``(path, tokens)``: accepted path (``[0 .. a]``) and the tokens it yields: the
        accepted drafts, then the token sampled after them (from the residual
        ``norm(max(p - q, 0))`` at the first rejection, or from ``p`` after the last
        draft). The result is distributed exactly as ``p``.
    """
    k = tree.tokens.numel() - 1
    q = torch.zeros(k, p.shape[1], dtype=torch.float32, device=p.device)
    q.index_add_(1, vocab_target_ids, tree.draft_probs.float())  # [k, V] in target ids
    drafts = tree.tokens[1:]
    rows = torch.arange(k, device=p.device)
    ratio = p[rows, drafts] / q[rows, drafts]
    u = torch.rand(k, device=p.device, generator=generator)
    accepted = u < ratio  # min(1, ratio) is implied
    residual = torch.clamp(p[:k] - q, min=0.0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p[:k])
    dist = torch.cat([residual, p[k:]])  # [k+1, V]
    samples = torch.multinomial(dist, 1, generator=generator)[:, 0]  # [k+1]
    flags, samples, tokens = torch.stack(
        [torch.cat([accepted.long(), accepted.new_zeros(1).long()]), samples, tree.tokens]
    ).tolist()
    a = 0
    while a < k and flags[a]:
        a += 1
    return list(range(a + 1)), tokens[1 : a + 1] + [samples[a]]


def accept_tree_sampling(
    tree: DraftTree,
    p: torch.Tensor,
    generator: Optional[torch.Generator] = None,
) -> tuple[list[int], list[int]]:
    """Target-only sampling over a tree of deterministic candidates (two host syncs).

    At each node the children are tried in tree order; child ``x`` is accepted with
    probability ``p(x) / (1 - mass of rejected siblings)``; a rejected child's token is
    removed; with no child accepted the next token is sampled from the remaining
    ``p``. This is exact sampling from ``p`` (``[N, V]`` float32 at each node).

    Args:
        tree: the verified draft (``N`` nodes, deterministic top-k candidates).
        p: ``[N, V]`` float32 target probabilities at each node (:func:`target_probs`).
        generator: the sequence's random generator.

    Returns:
        ``(path, tokens)``: accepted path and the accepted drafts plus the next token.
    """
    n = tree.tokens.numel()
    parent = tree.parents.clamp(min=0)
    child_p = p[parent, tree.tokens]  # [N]: p at parent of each node's token
    u = torch.rand(n, device=p.device, generator=generator)
    tokens, parents, child_p, u = (
        tree.tokens.tolist(), tree.parents.tolist(), child_p.tolist(), u.tolist()
    )
    children: dict[int, list[int]] = {}
    for j in range(1, n):
        children.setdefault(parents[j], []).append(j)
    path, node, rejected = [0], 0, []
    while True:
        removed, moved = 0.0, False
        rejected = []
        for c in children.get(node, []):
            remaining = 1.0 - removed
            if remaining > 0 and u[c] * remaining < child_p[c]:
                path.append(c)
                node, moved = c, True
                break
            removed += child_p[c]
            rejected.append(tokens[c])
        if not moved:
            break
    dist = p[node].clone()
    if rejected:
        dist[torch.tensor(rejected, device=p.device)] = 0.0
        # all mass rejected can only happen numerically; fall back to p then
        dist = torch.where(dist.sum() > 0, dist, p[node])
    nxt = int(torch.multinomial(dist, 1, generator=generator))
    return path, [tokens[j] for j in path[1:]] + [nxt]
