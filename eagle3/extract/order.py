"""The order in which extraction plans its conversations (and so fills its generation windows)."""

from __future__ import annotations

from typing import Optional


PLAN_ORDERS = ("auto", "source", "turns")


def bucket_by_turns(capture_cfg) -> bool:
    """Whether extraction orders its plan by turn count (``capture.plan_order``): ``turns``
    always, ``source`` never, ``auto`` when it regenerates more than one turn.

    Raises:
        Eagle3Error: ``capture.plan_order`` is not one of auto, source, turns.
    """
    order = str(getattr(capture_cfg, "plan_order", "auto") or "auto")
    if order not in PLAN_ORDERS:
        from eagle3.errors import Eagle3Error

        raise Eagle3Error(f"capture.plan_order={order!r}: use auto, source or turns")
    if order != "auto":
        return order == "turns"
    return bool(capture_cfg.regenerate) and capture_cfg.max_turns != 1


def turn_order(messages: list[list[dict]], max_turns: Optional[int]) -> list[int]:
    """Indices of ``messages`` by the number of turns regeneration answers
    (``min(user turns, max_turns)``), source order kept within a count (a stable sort).

    Regeneration is lockstep by turn inside a generation window (turn ``r`` is one batched
    ``generate`` over the window's conversations that have an ``r``-th user turn), so a
    window costs its longest conversation's turns times ``max_new_tokens`` decode steps.
    Windows of conversations with the same number of turns keep every batch full: on the
    first 4,096 ShareGPT conversations in windows of 280, 71 sequential turn batches
    instead of 277 (``docs/performance.md``).
    """
    cap = float("inf") if max_turns is None else int(max_turns)
    turns = [min(sum(1 for m in msgs if m.get("role") == "user"), cap) for msgs in messages]
    return sorted(range(len(messages)), key=lambda i: turns[i])
