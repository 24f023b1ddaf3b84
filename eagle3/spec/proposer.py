"""What drafts the tokens of a round: the proposer interface and the EAGLE-3 drafter behind it.

:class:`DraftProposer` is what :class:`eagle3.spec.decoder.SpeculativeDecoder` calls
(``begin`` once per round, ``step`` for the further draft steps, ``end_round``);
:class:`Eagle3Proposer` runs an ``eagle3.model.drafter.Eagle3Drafter`` with its own KV
cache. The first draft step pairs the target's aux hidden states at position ``t``
(fused by the drafter's ``fc``) with the embedding of token ``t+1``, as step 0 of
training-time test does (:mod:`eagle3.train.ttt`).
"""

from __future__ import annotations

import abc
from typing import Optional, Sequence

import torch

from eagle3.spec.target import truncate_cache


class DraftProposer(abc.ABC):
    """What drafts tokens for :class:`eagle3.spec.decoder.SpeculativeDecoder` (EAGLE-3 drafter, or test oracles).

    A proposer keeps its own per-sequence state (e.g. a KV cache). Per round the
    decoder calls :meth:`begin` once, :meth:`step` ``num_steps - 1`` times, then
    :meth:`end_round`. Logits are over the proposer's *draft vocabulary* ``Vd``;
    :attr:`vocab_target_ids` maps a draft id to a target id.
    """

    #: HF-convention aux layer ids the proposer reads from the target (None = none).
    aux_layer_ids: Optional[list[int]] = None
    #: ``[Vd]`` int64: the target id of every draft id (identity for a full vocabulary).
    vocab_target_ids: torch.Tensor

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget the current sequence (a new prompt starts)."""

    @abc.abstractmethod
    def begin(self, input_ids: torch.Tensor, aux: Optional[torch.Tensor], start: int) -> torch.Tensor:
        """Read newly verified positions and draft the first step.

        Args:
            input_ids: ``[m]`` int64 target ids of tokens ``start+1 .. start+m`` (the
                token *after* each position: EAGLE-3 pairs features at ``t`` with
                token ``t+1``; the last one is the round's root).
            aux: ``[m, 3*Ht]`` target aux hidden states at positions
                ``start .. start+m-1``, or None when the proposer reads none.
            start: first position; equals the number of positions read so far.

        Returns:
            ``[Vd]`` float logits for the token after the root.
        """

    @abc.abstractmethod
    def step(self, input_ids: torch.Tensor, parents: torch.Tensor, position: int) -> torch.Tensor:
        """One further draft step over ``w`` tree nodes of the same depth.

        Args:
            input_ids: ``[w]`` int64 target ids of the nodes (drafted last step).
            parents: ``[w]`` int64 index of each node's parent among the rows returned
                by the previous call (``begin`` returns one row).
            position: drafter position id of the nodes (``start + m - 1 + depth``).

        Returns:
            ``[w, Vd]`` float logits for each node's next token.
        """

    @abc.abstractmethod
    def end_round(self) -> None:
        """Drop the state of this round's draft steps (keep what :meth:`begin` read)."""

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (``draft_id + d2t[draft_id]``)."""
        return self.vocab_target_ids[draft_ids]


class Eagle3Proposer(DraftProposer):
    """The EAGLE-3 drafter as a proposer.

    First step of a round: ``drafter(input_ids = tokens t+1, hidden_states =
    drafter.fuse(aux_t), positions t)`` over the newly verified positions, appended to
    the drafter's KV cache. Later steps feed the drafter's own pre-norm output hidden
    state of the parent node at position ``parent + 1``; tree steps attend to the
    verified prefix and to their own ancestors only (4D bool mask, True = attend).

    Args:
        drafter: an ``eagle3.model.drafter.Eagle3Drafter`` (``fuse``, ``forward``, ``d2t``).
        aux_layer_ids: HF-convention ids the drafter was trained on (from its export).
    """

    def __init__(self, drafter, aux_layer_ids: Sequence[int]):
        self.drafter = drafter
        self.aux_layer_ids = list(aux_layer_ids)
        self.vocab_target_ids = drafter.draft_ids()  # [Vd] int64: i + d2t[i]
        self.dtype = drafter.fc.weight.dtype
        self.reset()

    def reset(self) -> None:
        """Start a new sequence: an empty drafter KV cache, no position read yet."""
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.committed = 0  # positions read with target features
        self._hidden: Optional[torch.Tensor] = None  # [rows, H] outputs of the last call
        self._ancestors: Optional[torch.Tensor] = None  # [rows, draft slots] bool

    def begin(self, input_ids, aux, start):
        """See :meth:`DraftProposer.begin`; ``aux`` is cast to the drafter's dtype.

        Raises:
            RuntimeError: ``start`` is not the number of positions read so far.
        """
        if start != self.committed:
            raise RuntimeError(f"drafter state holds {self.committed} positions, round starts at {start}")
        m = input_ids.numel()
        hidden = self.drafter.fuse(aux.to(self.dtype)[None])  # [1, m, 3Ht] -> [1, m, H]
        pos = torch.arange(start, start + m, device=input_ids.device)[None]
        out = self.drafter(
            input_ids[None], hidden, pos, attention_mask=None, past_key_values=self.cache, use_cache=True,
            return_logits=False,
        )
        self.cache = out.past_key_values
        self.committed = start + m
        self._hidden = out.hidden_states[0, -1:]  # [1, H]
        self._ancestors = None
        return self.drafter.compute_logits(self._hidden)[0]  # [Vd]: only the root's row

    def step(self, input_ids, parents, position):
        """See :meth:`DraftProposer.step`; the hidden input is the parent row's output."""
        w = input_ids.numel()
        hidden = self._hidden[parents]  # [w, H]
        mask = None
        if w > 1 or (self._ancestors is not None and self._ancestors.shape[0] > 1):
            dev = input_ids.device
            prev = (
                self._ancestors[parents]
                if self._ancestors is not None
                else torch.zeros(w, 0, dtype=torch.bool, device=dev)
            )
            anc = torch.cat([prev, torch.eye(w, dtype=torch.bool, device=dev)], dim=1)  # [w, slots]
            self._ancestors = anc
            prefix = torch.ones(w, self.committed, dtype=torch.bool, device=dev)
            mask = torch.cat([prefix, anc], dim=1)[None, None]  # [1, 1, w, committed + slots]
        pos = torch.full((1, w), position, dtype=torch.long, device=input_ids.device)
        out = self.drafter(
            input_ids[None], hidden[None].to(self.dtype), pos,
            attention_mask=mask, past_key_values=self.cache, use_cache=True,
        )
        self.cache = out.past_key_values
        self._hidden = out.hidden_states[0]  # [w, H]
        return out.logits[0]

    def end_round(self) -> None:
        """Crop the drafter cache back to the positions read by :meth:`begin`."""
        truncate_cache(self.cache, self.committed)
        self._ancestors = None
