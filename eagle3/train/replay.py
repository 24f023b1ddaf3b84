"""Validation that replays serving: chains start where a speculative decoder starts them.

The training-time test's simulated tau (:mod:`eagle3.train.ttt`) averages a chain that
starts at *every* reply position. A server starts chains only where the previous verify
pass left off (EAGLE-3, Li et al. 2025; SGLang ``eagle_worker``, vLLM ``EagleProposer``):
after prefill, the target writes the first reply token ``x[P]`` from position ``P - 1``,
so the first chain drafts from row ``q = P - 1`` (features ``f[q]``, token ``x[q + 1]``,
first draft ``x[q + 2]``); a chain at ``q`` that gets ``n`` drafts accepted emits
``n + 1`` tokens (the bonus token from the target), and the next chain starts at row
``q + n + 1``. Positions right after a rejection are often harder than the average
position, so this replay's tau is the figure to set beside served tau; the gap between
the two validation figures says how much of a served shortfall is *where* chains start.
With greedy decoding and the target's own replies as the captured text, the replay is
exact for a chain drafter: the target's argmax is the captured token, and an
out-of-vocabulary target token is a rejection (the drafter cannot propose it).
"""

from __future__ import annotations

import torch


def serving_replay(accepted_rows: torch.Tensor, chain_starts: torch.Tensor, seq_len: int) -> tuple[int, int]:
    """Accepted draft steps and chains of a serving replay over a collated batch.

    Args:
        accepted_rows: ``[B*T]`` float32, accepted draft steps of the chain that starts
            at each row (:attr:`eagle3.train.ttt.TTTOutput.accepted_rows`).
        chain_starts: ``[B*T]`` bool, rows whose first label is a generated token; each
            reply is one contiguous run of them, from row ``P - 2`` to ``E - 2`` for a
            reply ``x[P..E]``.
        seq_len: ``T``.

    Returns:
        ``(accepted, chains)``: the replay's tau is ``1 + accepted / chains``.
    """
    acc = accepted_rows.reshape(-1, seq_len).tolist()
    starts = chain_starts.reshape(-1, seq_len).tolist()
    total = chains = 0
    for a_row, s_row in zip(acc, starts):
        r = 0
        while r < seq_len:
            if not s_row[r]:
                r += 1
                continue
            end = r
            while end < seq_len and s_row[end]:
                end += 1  # rows r .. end-1: one reply
            counts = replay_walk(a_row, r, end)
            total += sum(counts)
            chains += len(counts)
            r = end
    return total, chains


def replay_walk(accepted_row: list, first: int, end: int) -> list[int]:
    """Accepted drafts of each chain of one reply, in order, walked as a decoder walks them.

    Args:
        accepted_row: per row of one sample, the accepted drafts of the chain that starts
            there (:attr:`eagle3.train.ttt.TTTOutput.accepted_rows`, as a list).
        first: the reply's first chain-start row (``P - 2`` for a reply ``x[P..E]``).
        end: one past its last chain-start row.

    Returns:
        The counts: the first chain at row ``first + 1`` (the target wrote ``x[P]``
        itself, the first chain drafts ``x[P + 1]``), each next one ``n + 1`` rows after
        a chain that got ``n`` drafts accepted.
    """
    out = []
    q = first + 1
    while q < end:
        n = int(accepted_row[q])
        out.append(n)
        q += n + 1
    return out
