"""Draft vocabulary: the target ids the drafter's ``lm_head`` can propose.

The ``N`` most frequent *label* tokens of the training split (tokens with
``loss_mask == 1``: what the target generated) are kept; ties go to the smaller id.
When fewer than ``N`` distinct tokens occur, the rest is filled with the smallest
unused ids so the head always has ``N`` rows. Draft id ``i`` maps to target id
``i + d2t[i]`` (SGLang's ``d2t`` offsets, ``hot_token_id = d2t + arange``); draft ids
are in increasing target-id order. ``t2d [V]`` marks the chosen target ids
(EAGLE-3 / SpecForge convention; SGLang ignores it but it is exported).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from eagle3.errors import Eagle3Error


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose the draft vocabulary from token frequencies.

    Args:
        counts: ``[V]`` integer counts of label tokens over the target vocabulary.
        draft_vocab_size: ``N``, rows of the drafter's ``lm_head``.

    Returns:
        ``(d2t [N] int64, t2d [V] bool)``: ``arange(N) + d2t`` are the chosen target ids
        in increasing order; ``t2d.sum() == N``.

    Raises:
        Eagle3Error: ``N`` is not in ``1..V``.
    """
    V = counts.numel()
    N = int(draft_vocab_size)
    if not 1 <= N <= V:
        raise Eagle3Error(
            f"drafter.draft_vocab_size={N} must be between 1 and the target's vocabulary size {V}; "
            f"set drafter.draft_vocab_size={min(max(N, 1), V)}"
        )
    counts = counts.to(torch.int64).flatten()
    # Sort by count descending, then id ascending (stable sort keeps id order on ties).
    order = torch.sort(-counts, stable=True).indices
    seen = int((counts > 0).sum())
    chosen = order[: min(N, seen)]
    if chosen.numel() < N:  # pad with the smallest unused ids
        unused = torch.ones(V, dtype=torch.bool)
        unused[chosen] = False
        chosen = torch.cat([chosen, unused.nonzero().flatten()[: N - chosen.numel()]])
    ids = torch.sort(chosen).values
    d2t = ids - torch.arange(N, dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def auto_draft_vocab_size(counts: torch.Tensor, cap: int = 32000, multiple: int = 64) -> int:
    """Default draft vocabulary size: the distinct label tokens seen, rounded up to a
    multiple of ``multiple`` (matmul-friendly), at most ``cap`` (EAGLE-3's 32000) and
    the vocabulary size. A small corpus thus gets a small ``lm_head``; a large one
    the published 32000."""
    seen = int((counts > 0).sum())
    n = max(multiple, -(-seen // multiple) * multiple)
    return int(min(n, cap, counts.numel()))


def count_label_tokens(
    features_dirs: Sequence[str | os.PathLike],
    manifests: Sequence[dict],
    vocab_size: int,
    splits: Iterable[str] = ("train",),
    progress: bool = True,
    rows: Optional[dict[Path, set[int]]] = None,
) -> torch.Tensor:
    """Count loss-masked tokens (``loss_mask == 1``) of the given splits.

    Reads only ``input_ids``, ``loss_mask`` and ``offsets`` of each shard (the shard
    layout of :mod:`eagle3.features.format`), never the hidden states. ``rows``
    (:meth:`eagle3.features.FeatureDataset.shard_rows`) restricts the count to those rows
    of those shards (``loop.train_fraction``'s subset); ``None`` counts every sample of the
    splits.

    Returns:
        ``[V]`` int64 counts.

    Raises:
        Eagle3Error: a token id lies outside the target vocabulary.
    """
    splits = set(splits)
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    jobs = [(Path(d), sh) for d, m in zip(features_dirs, manifests) for sh in m["shards"] if sh["file"]]
    for d, sh in tqdm(jobs, desc="draft vocab", unit="shard", disable=not progress):
        keep = [i for i, s in enumerate(sh["samples"]) if s["split"] in splits]
        if rows is not None:
            chosen = rows.get(d / sh["file"], set())
            keep = [i for i in keep if i in chosen]
        if not keep:
            continue
        with safe_open(str(d / sh["file"]), framework="pt") as f:
            ids = f.get_tensor("input_ids").to(torch.int64)
            mask = f.get_tensor("loss_mask").bool()
            off = f.get_tensor("offsets")
        sel = torch.zeros_like(mask)
        for i in keep:
            sel[int(off[i]) : int(off[i + 1])] = True
        labels = ids[mask & sel]
        if labels.numel() and (labels.min() < 0 or labels.max() >= vocab_size):
            raise Eagle3Error(
                f"{d / sh['file']} holds token ids outside the target vocabulary of {vocab_size}; "
                "these features were extracted with another tokenizer"
            )
        counts += torch.bincount(labels, minlength=vocab_size)
    return counts
