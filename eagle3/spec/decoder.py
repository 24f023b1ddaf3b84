"""EAGLE-3 speculative decoding with an in-process transformers target (batch 1).

This module runs the rounds (:class:`SpeculativeDecoder`) and the target's own
decoding that it is compared with (:func:`target_generate`). One *round* = draft,
verify, accept, roll back:

1. **Draft** (:mod:`eagle3.spec.proposer`, :mod:`eagle3.spec.tree`). The proposer first
   reads the positions verified in the previous round (EAGLE-3: the target's aux hidden
   states at position ``t`` fused by the drafter's ``fc``, paired with the embedding of
   token ``t+1``), then runs ``num_steps`` draft forward steps in total; steps after the
   first feed back the drafter's own output hidden state. With ``topk == 1`` the draft
   is a chain of ``num_steps`` tokens; with ``topk > 1`` it is a tree built as SGLang
   builds it (the expansion and selection are described in :mod:`eagle3.spec.tree`).
2. **Verify** (:mod:`eagle3.spec.target`). One target forward over ``[root] + draft
   tokens``: the root is the last verified token (not yet in the target's KV cache), so
   a pass verifies ``num_draft_tokens`` tokens as SGLang counts them. Trees use a 4D
   tree attention mask and tree position ids. Forward hooks on three decoder layers give
   the aux hidden states of every verified position for the next round.
3. **Accept** (:mod:`eagle3.spec.accept`). Temperature 0: the longest draft path whose
   every token equals the target's argmax at its parent, plus the bonus token (the
   target's argmax after the last accepted node). Temperature > 0: standard speculative
   sampling on chains, SGLang's target-only tree sampling on trees; both lossless, the
   output distribution is the target's.
4. **Roll back.** Rejected tokens are removed from the target's KV cache (the accepted
   tree path is first moved into contiguous slots), and the drafter's speculative
   KV entries are cropped, so both caches hold exactly the verified prefix.

Counting (SGLang's ``meta_info`` fields): a verify pass yields its accepted drafts
plus one bonus token. ``acceptance length (tau) = tokens emitted by verify passes /
verify passes``. The first generated token comes from the prefill, not from a verify
pass, and is not counted (SGLang's ``completion_tokens`` includes it, which adds
``1 / verify_passes`` to its tau); tokens of the last pass beyond the stop token or
``max_new_tokens`` are not emitted and not counted. ``acceptance rate = accepted
drafts / (verify passes * num_steps)`` (SGLang's ``spec_num_correct_drafts /
spec_num_proposed_drafts``), and the per-pass histogram of accepted drafts is
SGLang's ``spec_correct_drafts_histogram``.

Performance: one host sync per round (two for trees at temperature > 0); the draft
and the acceptance test stay on the device. KV caches are transformers
``DynamicCache`` objects rolled back by cropping.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from eagle3.errors import Eagle3Error
from eagle3.spec.accept import _sample, accept_chain_sampling, accept_greedy, accept_tree_sampling, target_probs
from eagle3.spec.proposer import DraftProposer
from eagle3.spec.settings import GenerationResult, SpecSettings
from eagle3.spec.target import TargetRunner, synchronize
from eagle3.spec.tree import DraftTree, build_draft, tree_ancestors


def _stop_index(tokens: Sequence[int], stop_ids: frozenset[int], room: int) -> int:
    """How many of ``tokens`` to emit: up to ``room``, through the first stop token."""
    for i, t in enumerate(tokens[:room]):
        if t in stop_ids:
            return i + 1
    return min(len(tokens), room)


@torch.inference_mode()
def target_generate(
    runner: TargetRunner,
    prompt_ids: Sequence[int],
    settings: SpecSettings,
    stop_ids: Sequence[int] = (),
    generator: Optional[torch.Generator] = None,
) -> GenerationResult:
    """The target's own decoding (the baseline): prefill, then one token per forward.

    Same prefill and KV cache as :class:`SpeculativeDecoder`; greedy at temperature 0,
    else sampled from :func:`target_probs`. Returns tokens and synchronised seconds
    (no verify passes).

    Args:
        runner: the target (its aux capture is switched off for these forwards).
        prompt_ids: ``[P]`` target ids, chat-rendered.
        settings: temperature, top_p and ``max_new_tokens`` are read.
        stop_ids: generation ends after any of these tokens (EOS, end of turn).
        generator: the sequence's random generator (temperature > 0).
    """
    stop = frozenset(int(s) for s in stop_ids)
    dev = runner.device
    synchronize(dev)
    t0 = time.perf_counter()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
    cache = runner.new_cache()
    runner.reserve(cache, ids.shape[1] + settings.max_new_tokens)
    logits, _ = runner.prefill(ids, cache, capture=False)
    out: list[int] = []
    n = ids.shape[1]
    prefill = None
    while True:
        if settings.greedy:
            tok = logits[-1:].argmax(-1)
        else:
            tok = _sample(target_probs(logits[-1:], settings.temperature, settings.top_p), generator)
        t = int(tok)  # host sync
        if prefill is None:
            prefill = time.perf_counter() - t0
        out.append(t)
        if t in stop or len(out) >= settings.max_new_tokens:
            break
        logits = runner.decode(tok, n, cache)
        n += 1
    synchronize(dev)
    return GenerationResult(tokens=out, seconds=time.perf_counter() - t0, prefill_seconds=prefill)


class SpeculativeDecoder:
    """EAGLE-3 speculative decoding at batch 1 (see the module docstring).

    Args:
        runner: the target (its ``aux_layer_ids`` must equal the proposer's).
        proposer: the drafter (or a test proposer).
        settings: from :meth:`SpecSettings.make`.
        stop_ids: generation ends after any of these tokens (EOS, end of turn).

    Raises:
        Eagle3Error: the runner and the proposer name different aux layer ids.
    """

    def __init__(self, runner: TargetRunner, proposer: DraftProposer, settings: SpecSettings,
                 stop_ids: Sequence[int] = ()):
        if proposer.aux_layer_ids != runner.aux_layer_ids:
            raise Eagle3Error(
                f"the target runner captures aux layers {runner.aux_layer_ids} but the drafter reads "
                f"{proposer.aux_layer_ids}; build the TargetRunner with the drafter's aux ids"
            )
        self.runner, self.proposer, self.settings = runner, proposer, settings
        self.stop = frozenset(int(s) for s in stop_ids)

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], generator: Optional[torch.Generator] = None) -> GenerationResult:
        """Generate for one prompt (``[P]`` target ids, chat-rendered) -> :class:`GenerationResult`."""
        s, runner, prop = self.settings, self.runner, self.proposer
        dev = runner.device
        synchronize(dev)
        t0 = time.perf_counter()
        prop.reset()
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
        plen = ids.shape[1]
        cache = runner.new_cache()
        runner.reserve(cache, plen + s.max_new_tokens + s.num_draft_tokens)
        logits, aux = runner.prefill(ids, cache)
        if s.greedy:
            root = logits[-1:].argmax(-1)  # [1]
        else:
            root = _sample(target_probs(logits[-1:], s.temperature, s.top_p), generator)
        first = int(root)
        res = GenerationResult(tokens=[first])
        synchronize(dev)
        res.prefill_seconds = time.perf_counter() - t0
        if first in self.stop or s.max_new_tokens <= 1:
            res.seconds = res.prefill_seconds
            return res
        # drafter reads positions 0..P-1: tokens 1..P (the last is the root), features 0..P-1
        new_ids = torch.cat([ids[0, 1:], root])
        start = 0
        length = plen  # target KV length = positions verified and in the cache
        while True:
            first_logits = prop.begin(new_ids, aux, start)
            tree = build_draft(prop, root, first_logits, start + new_ids.numel() - 1, s, generator)
            prop.end_round()
            path, proposed, aux_all = self._verify(tree, cache, length, generator)
            a = len(path) - 1
            res.verify_passes += 1
            res.accepted_drafts += a
            res.accept_counts.append(a)
            room = s.max_new_tokens - len(res.tokens)
            take = _stop_index(proposed, self.stop, room)
            res.tokens.extend(proposed[:take])
            res.emitted += take
            if take < len(proposed) or proposed[take - 1] in self.stop or len(res.tokens) >= s.max_new_tokens:
                break
            # roll back: keep root + accepted path in the target cache (and their aux states)
            path_t = runner.rollback(cache, length, path)
            if aux_all is not None:
                aux = aux_all[: a + 1] if path_t is None else aux_all[path_t]
            start, length = length, length + a + 1
            new_ids = torch.tensor(proposed, dtype=torch.long, device=dev)
            root = new_ids[-1:]
        synchronize(dev)
        res.seconds = time.perf_counter() - t0
        return res

    def _verify(
        self, tree: DraftTree, cache, length: int, generator: Optional[torch.Generator]
    ) -> tuple[list[int], list[int], Optional[torch.Tensor]]:
        """The verify pass of a round: the target over the draft, then acceptance.

        Args:
            tree: the round's draft (``N`` nodes, root first).
            cache: the target's cache holding the ``length`` verified positions; the
                ``N`` nodes are appended (the caller rolls back).
            length: verified positions in ``cache`` (the root's position).
            generator: the sequence's random generator (temperature > 0).

        Returns:
            ``(path, proposed, aux_all)``: tree indices of the accepted path (root
            first), the tokens it yields (accepted drafts, then the bonus or sampled
            token), and the ``[N, 3*H]`` aux states of every node (None without aux ids).
        """
        s, runner = self.settings, self.runner
        ancestors = None if s.is_chain else tree_ancestors(tree.parents, s.num_steps)
        logits, aux_all = runner.verify(tree.tokens, tree.depth, ancestors, cache, length)
        if s.greedy:
            path, proposed = accept_greedy(tree, logits, s.num_steps)
        else:
            p = target_probs(logits, s.temperature, s.top_p)
            if s.is_chain:
                path, proposed = accept_chain_sampling(tree, p, self.proposer.vocab_target_ids, generator)
            else:
                path, proposed = accept_tree_sampling(tree, p, generator)
        return path, proposed, aux_all
