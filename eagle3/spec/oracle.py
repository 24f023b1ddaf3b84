"""A perfect drafter at a real drafter's cost, for measuring what a round costs at full acceptance.

:class:`ForcedProposer` runs another proposer (the EAGLE-3 drafter) unchanged, then
raises, in the logits it returns, the draft id of the token a known continuation has
next, so every draft of a chain is accepted (tau = ``num_steps + 1``) while each round
still pays for the drafter's forwards, the verify pass and the rollback. Benchmarks use
it to time rounds at the acceptance a good drafter reaches; tests use it to drive the
verified length of every round above one.

Positions: a ``begin`` over tokens ``start+1 .. start+m`` drafts the token at sequence
index ``start + m + 1``; a draft step at drafter position ``q`` drafts index ``q + 2``
(:mod:`eagle3.spec.tree` places the ``i``-th step at ``start + m - 1 + i``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from eagle3.spec.proposer import DraftProposer


class ForcedProposer(DraftProposer):
    """``inner``'s drafting with ``reference``'s next token forced to rank first.

    Args:
        inner: the proposer whose work is done and timed (its logits are modified in place
            of a copy).
        reference: ``[T]`` target ids: the prompt followed by the target's own greedy
            continuation (what the verifier will accept).
        margin: added to the row maximum for the forced id.

    A reference token outside ``inner``'s draft vocabulary (or beyond the reference) is
    left to ``inner``'s own ranking.
    """

    def __init__(self, inner: DraftProposer, reference: Sequence[int], margin: float = 10.0):
        self.inner, self.margin = inner, float(margin)
        self.aux_layer_ids = inner.aux_layer_ids
        self.vocab_target_ids = inner.vocab_target_ids
        dev = inner.vocab_target_ids.device
        V = int(max(int(inner.vocab_target_ids.max()) + 1, max(reference) + 1))
        to_draft = torch.full((V,), -1, dtype=torch.long, device=dev)
        to_draft[inner.vocab_target_ids] = torch.arange(inner.vocab_target_ids.numel(), device=dev)
        self._forced = to_draft[torch.tensor(list(reference), dtype=torch.long, device=dev)]  # [T], -1 = none

    def _force(self, logits: torch.Tensor, index: int) -> torch.Tensor:
        if not 0 <= index < self._forced.numel():
            return logits
        d = self._forced[index]
        rows = logits.reshape(-1, logits.shape[-1])
        big = rows.max(-1, keepdim=True).values + self.margin
        col = d.clamp(min=0).expand(rows.shape[0], 1)
        forced = rows.scatter(-1, col, torch.where(d >= 0, big, rows.gather(-1, col)))
        return forced.reshape(logits.shape)

    def reset(self) -> None:
        self.inner.reset()

    def begin(self, input_ids, aux, start):
        return self._force(self.inner.begin(input_ids, aux, start), start + input_ids.numel() + 1)

    def step(self, input_ids, parents, position):
        return self._force(self.inner.step(input_ids, parents, position), position + 2)

    def end_round(self) -> None:
        self.inner.end_round()
