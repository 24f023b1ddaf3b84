"""Teacher-forced replay of an evaluated turn: where served tau falls short, is it the
features or where chains start?

For one decoded turn (prompt ids ``x[:P]``, reply ``x[P:T]``), the target runs once over
the whole sequence (one full forward, the way extraction captures features) and the
drafter runs the training-time test's unroll over it (:func:`eagle3.train.ttt.ttt_forward`),
the labels being the reply's own next tokens, so a draft counts as accepted exactly when
it equals the token the decoder emitted. From the chain of ``num_steps`` drafts that
starts at every reply row:

* ``replay``: chains walked where the decoder walked them (the first after the prefill
  token, each next one after the previous chain's bonus token; the walk of
  :mod:`eagle3.train.replay`). Against the decoder's own counts this differs *only* in the
  numerics of the features (one full forward here; prefill and verify passes of
  ``num_draft_tokens`` tokens over a KV cache there) and of the drafter (one batched
  unroll against incremental steps). In float32 the two agree exactly
  (``tests/test_teacher_forced.py``).
* ``every``: a chain at every reply row, the figure training validation reports
  (:func:`eagle3.train.ttt.summarize`); ``every - replay`` is what *where chains start*
  costs (after a rejection the next token is often harder than the average one).

So ``served tau -> replay tau -> every-position tau -> validation tau`` splits a shortfall
into numerics, chain starts, and the prompts' distribution.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from eagle3.train.replay import replay_walk
from eagle3.train.ttt import TTTCollator, batch_to, target_to_draft_index, ttt_forward


def _sample(ids: torch.Tensor, prompt_len: int, aux: torch.Tensor) -> dict:
    """A feature record (:class:`eagle3.train.ttt.TTTCollator`'s input) of one decoded turn.

    Args:
        ids: ``[T]`` int64 prompt + reply ids.
        prompt_len: ``P``; the loss mask is 1 on the reply, positions ``P .. T-1``.
        aux: ``[T, 3*H]`` (any shape with ``T`` rows) or a ``[T, 1, 1]`` placeholder (the caller puts the real
            features in the collated batch); moved to the CPU as float32.

    Returns:
        ``input_ids``, ``aux_hidden_states``, ``loss_mask`` and a "top-1" at each position
        ``p``: the text's token ``p + 1`` (log-prob 0).
    """
    T = ids.numel()
    mask = torch.zeros(T, dtype=torch.int64)
    mask[prompt_len:] = 1
    nxt = torch.zeros(T, 1, dtype=torch.int64)
    nxt[:-1, 0] = ids[1:]
    return {"input_ids": ids, "aux_hidden_states": aux.float().cpu().reshape(T, 1, -1), "loss_mask": mask,
            "topk_ids": nxt, "topk_logprobs": torch.zeros(T, 1)}


@torch.inference_mode()
def chain_acceptance_rows(runner, drafter, prompt_ids: Sequence[int], reply: Sequence[int],
                          num_steps: int) -> Optional[tuple[list[float], int, int]]:
    """Accepted drafts of the teacher-forced chain at every row of ``prompt + reply``.

    Args:
        runner: a :class:`eagle3.spec.TargetRunner` (or the static one); its ``prefill``
            of the whole sequence gives the ``[T, 3*H]`` aux states in the model dtype on
            its device.
        drafter: the :class:`eagle3.model.drafter.Eagle3Drafter` on the same device.
        prompt_ids: ``P >= 2`` target ids.
        reply: ``T - P`` target ids.
        num_steps: drafts per chain.

    Returns:
        ``(accepted, first, end)``: ``accepted[r]`` (``T`` floats) for the chain that starts
        after token ``r`` (:attr:`eagle3.train.ttt.TTTOutput.accepted_rows`); chains start
        at the rows ``first .. end - 1`` (``P - 2 .. T - 3``: the first label is a reply
        token). None when the aux states are not finite (nothing to replay).

    Raises:
        Eagle3Error: the sequence does not fit a static runner's cache.
    """
    P = len(prompt_ids)
    dev = runner.device
    ids = torch.tensor(list(prompt_ids) + list(reply), dtype=torch.int64)
    T = ids.numel()
    # one prefill of the whole sequence (the static runner's too: it places the positions in its cache)
    _, aux = runner.prefill(ids[None].to(dev), runner.new_cache(), capture=True)
    if not bool(torch.isfinite(aux).all()):
        return None
    t2d_index = target_to_draft_index(drafter.d2t.cpu(), drafter.t2d.numel())
    placeholder = torch.zeros(T, 1, 1)  # the collator's own copy of the features is not needed
    batch = TTTCollator(t2d_index, num_steps, max_length=T)([_sample(ids, P, placeholder)])
    batch["aux_hidden_states"] = aux[None]  # the features as computed, on their device and dtype
    out = ttt_forward(drafter, batch_to(batch, dev), num_steps)
    return out.accepted_rows.float().cpu().tolist(), P - 2, T - 2


def teacher_forced_turn(runner, drafter, prompt_ids: Sequence[int], reply: Sequence[int], num_steps: int) -> Optional[dict]:
    """Teacher-forced chains over one decoded turn (see the module docstring).

    Args:
        runner: the decoder's :class:`eagle3.spec.TargetRunner` (its ``prefill`` of the
            whole sequence, ``capture=True``, gives ``[T, 3*H]`` aux states in the model dtype).
        drafter: the :class:`eagle3.model.drafter.Eagle3Drafter` the decoder drafts with.
        prompt_ids: ``P`` target ids of the rendered prompt.
        reply: the decoded reply (``T - P`` ids, the prefill token first).
        num_steps: drafts per chain (``--speculative-num-steps``; chains only, topk 1).

    Returns:
        ``{"replay_counts": [accepted drafts of each replayed chain, in order],
        "every_accepted": int, "every_chains": int, "every_per_step": [chains with
        >= j+1 accepted drafts, j < num_steps]}``; None for a reply of fewer than 3
        tokens (too short to compare chains), a prompt of fewer than 2 tokens, or
        non-finite features.

    Raises:
        Eagle3Error: the sequence does not fit a static runner's cache.
    """
    if len(reply) < 3 or len(prompt_ids) < 2:
        return None
    got = chain_acceptance_rows(runner, drafter, prompt_ids, reply, num_steps)
    if got is None:
        return None
    acc, first, end = got
    every = acc[first:end]
    return {
        "replay_counts": replay_walk(acc, first, end),
        "every_accepted": int(sum(every)),
        "every_chains": len(every),
        "every_per_step": [sum(1 for a in every if a >= j + 1) for j in range(num_steps)],
    }


def summarize_teacher_forced(records: Sequence) -> Optional[dict]:
    """Per-benchmark figures from turn records carrying ``teacher_forced`` (else None).

    Args:
        records: :class:`eagle3.evaluate.inprocess.records.TurnRecord` s; those whose
            ``teacher_forced`` is set (:func:`teacher_forced_turn`) are counted, with
            their ``accept_counts``.

    Returns:
        ``{"served_tau", "replay_tau", "every_tau", "every_per_position", "turns",
        "identical_turns"}``: ``served_tau`` over the same turns (the decoder's own
        counts); ``identical_turns`` counts turns whose replayed chain counts equal the
        decoder's, the last chain left out (the decoder cuts it at ``max_new_tokens`` or a
        stop token, the replay at the reply's end).
    """
    tf = [(r, r.teacher_forced) for r in records if getattr(r, "teacher_forced", None)]
    if not tf:
        return None
    served_acc = sum(sum(r.accept_counts) for r, _ in tf)
    served_passes = sum(len(r.accept_counts) for r, _ in tf)
    rep = [c for _, t in tf for c in t["replay_counts"]]
    ev_acc = sum(t["every_accepted"] for _, t in tf)
    ev_n = sum(t["every_chains"] for _, t in tf)
    steps = len(tf[0][1]["every_per_step"])
    per = [sum(t["every_per_step"][j] for _, t in tf) / ev_n if ev_n else None for j in range(steps)]
    same = sum(list(r.accept_counts[:-1]) == list(t["replay_counts"][: max(0, len(r.accept_counts) - 1)]) for r, t in tf)
    return {
        "served_tau": 1 + served_acc / served_passes if served_passes else None,
        "replay_tau": 1 + sum(rep) / len(rep) if rep else None,
        "every_tau": 1 + ev_acc / ev_n if ev_n else None,
        "every_per_position": per,
        "turns": len(tf),
        "identical_turns": int(same),
    }
