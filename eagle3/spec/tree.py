"""The draft of one round: running the draft steps and building the chain or tree to verify.

:func:`build_draft` runs the proposer's remaining draft steps and returns a
:class:`DraftTree` (root included); :func:`tree_ancestors` gives the ancestor relation
that the target's tree attention mask is built from.

With ``topk == 1`` the draft is a chain of ``num_steps`` tokens. With ``topk > 1`` it is
a tree built as SGLang builds it (``python/sglang/srt/speculative/eagle_utils.py``:
``select_top_k_tokens``, ``organize_draft_results``): the first step keeps the ``topk``
most probable children of the root; each later step expands the ``topk`` kept nodes by
their ``topk`` children each, scores every child by the product of draft probabilities
along its path, keeps the best ``topk`` for the next step, and finally the best
``num_draft_tokens - 1`` candidates of all steps (a set closed under parents) are
verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from eagle3.spec.proposer import DraftProposer
from eagle3.spec.settings import SpecSettings


@dataclass
class DraftTree:
    """A round's draft, root included.

    ``tokens [N]`` int64 target ids (index 0 = root, the last verified token);
    ``parents [N]`` int64 (``parents[0] = -1``; ``parents[j] < j``); ``depth [N]``
    int64 (root 0). ``draft_probs``: for chains sampled at temperature > 0,
    ``[num_steps, Vd]`` float32 draft distributions each draft token was sampled from.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    draft_probs: Optional[torch.Tensor] = None


def build_draft(
    proposer: DraftProposer,
    root: torch.Tensor,
    first_logits: torch.Tensor,
    last_position: int,
    settings: SpecSettings,
    generator: Optional[torch.Generator] = None,
) -> DraftTree:
    """Run the remaining ``num_steps - 1`` draft steps and return the draft to verify.

    Args:
        proposer: after :meth:`DraftProposer.begin` (which produced ``first_logits``).
        root: ``[1]`` int64 target id of the last verified token.
        first_logits: ``[Vd]`` draft logits for the root's children.
        last_position: drafter position of the root's features (``start + m - 1``).
        settings: steps/topk/draft tokens; temperature > 0 samples chain drafts.
        generator: for sampled chain drafts.

    Chains (topk=1): argmax at temperature 0, else sampled from
    ``softmax(logits / T)``. Trees: SGLang's top-k expansion and selection (module
    docstring); scores are sums of draft log-probabilities (the log of SGLang's
    products), and ties keep the earlier candidate so the selection is closed under
    parents.
    """
    if settings.is_chain:
        return _draft_chain(proposer, root, first_logits, last_position, settings, generator)
    return _draft_tree(proposer, root, first_logits, last_position, settings)


def _draft_chain(
    proposer: DraftProposer,
    root: torch.Tensor,
    first_logits: torch.Tensor,
    last_position: int,
    settings: SpecSettings,
    generator: Optional[torch.Generator],
) -> DraftTree:
    """The chain of :func:`build_draft` (``topk == 1``): argmax or sampled drafts."""
    k, dev = settings.num_steps, root.device
    logits, ids, probs = first_logits[None], [], []
    for i in range(k):
        if i:
            logits = proposer.step(proposer.to_target(ids[-1]), torch.zeros(1, dtype=torch.long, device=dev),
                                   last_position + i)
        if settings.greedy:
            ids.append(logits.argmax(-1))
        else:
            q = torch.softmax(logits.float() / settings.temperature, dim=-1)  # [1, Vd]
            ids.append(torch.multinomial(q, 1, generator=generator)[:, 0])
            probs.append(q[0])
    tokens = torch.cat([root, proposer.to_target(torch.cat(ids))])
    parents = torch.arange(-1, k, device=dev)
    depth = torch.arange(0, k + 1, device=dev)
    return DraftTree(tokens, parents, depth, torch.stack(probs) if probs else None)


def _draft_tree(
    proposer: DraftProposer,
    root: torch.Tensor,
    first_logits: torch.Tensor,
    last_position: int,
    settings: SpecSettings,
) -> DraftTree:
    """The tree of :func:`build_draft` (``topk > 1``): SGLang's expansion and selection.

    The candidate *pool* holds every child scored at every step (``topk`` after the
    first step, ``topk**2`` after each later one), in step order; the ``num_draft_tokens - 1``
    best of it, sorted back into pool order, become tree nodes ``1..``.
    """
    k, dev = settings.num_steps, root.device
    topk = settings.topk
    logp, ids = torch.log_softmax(first_logits.float(), -1).topk(topk)  # [topk]
    pool_scores, pool_ids = [logp], [ids]
    pool_parents = [torch.full((topk,), -1, dtype=torch.long, device=dev)]  # pool index, -1 = root
    pool_depth = [torch.ones(topk, dtype=torch.long, device=dev)]
    cur_ids, cur_scores = ids, logp
    cur_pool = torch.arange(topk, device=dev)
    cur_parents = torch.zeros(topk, dtype=torch.long, device=dev)  # rows of begin's output
    base = topk
    for i in range(1, k):
        logits = proposer.step(proposer.to_target(cur_ids), cur_parents, last_position + i)  # [topk, Vd]
        lp, child = torch.log_softmax(logits.float(), -1).topk(topk, dim=-1)  # [topk, topk]
        scores = (cur_scores[:, None] + lp).flatten()  # [topk*topk]
        child = child.flatten()
        pool_scores.append(scores)
        pool_ids.append(child)
        pool_parents.append(cur_pool.repeat_interleave(topk))
        pool_depth.append(torch.full((topk * topk,), i + 1, dtype=torch.long, device=dev))
        sel = scores.topk(topk).indices
        cur_ids, cur_scores = child[sel], scores[sel]
        cur_pool = base + sel
        cur_parents = sel // topk
        base += topk * topk
    scores = torch.cat(pool_scores)
    order = torch.sort(-scores, stable=True).indices[: settings.num_draft_tokens - 1]
    chosen = order.sort().values  # pool indices, parents before children
    tree_index = torch.full((scores.numel() + 1,), -1, dtype=torch.long, device=dev)  # pool idx -> tree idx
    tree_index[chosen] = torch.arange(1, chosen.numel() + 1, device=dev)
    tree_index[-1] = 0  # pool parent -1 (the root) -> tree index 0
    parents = torch.cat([torch.tensor([-1], device=dev), tree_index[torch.cat(pool_parents)[chosen]]])
    tokens = torch.cat([root, proposer.to_target(torch.cat(pool_ids)[chosen])])
    depth = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), torch.cat(pool_depth)[chosen]])
    return DraftTree(tokens, parents, depth)


def tree_ancestors(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[N, N]`` bool: ``[i, j]`` True iff node j is node i or one of its ancestors.

    ``parents``: ``[N]`` int64, ``parents[0] = -1`` (root); ``max_depth`` bounds the
    depth of any node. Runs on the device without a host sync.
    """
    n = parents.numel()
    rows = torch.arange(n, device=parents.device)
    anc = torch.eye(n, dtype=torch.bool, device=parents.device)
    cur = parents.clone()
    for _ in range(max_depth):  # integer indexing only: no host sync
        valid = cur >= 0
        col = cur.clamp(min=0)
        anc[rows, col] = anc[rows, col] | valid
        cur = torch.where(valid, parents[col], cur)
    return anc
