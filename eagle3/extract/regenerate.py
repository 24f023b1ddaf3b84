"""Regenerating the assistant turns: the target answers every user turn of a conversation in order.

The system message (if any) and the user turns are kept; the reply to each user turn
is generated from the conversation so far, including the target's own earlier replies,
batched across conversations. :func:`keep_turns` is the path without regeneration.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from eagle3.target import render_prompt


@dataclasses.dataclass
class _Conv:
    """A conversation being regenerated: its fixed turns and what has been generated."""

    sample_id: str
    prefix: list[dict]  # system messages + everything up to the next user turn
    users: list[dict]  # user turns still to answer
    done: bool = False
    cut: bool = False  # stopped early: the next prompt would not fit in max_length


def _plan_turns(messages: list[dict], max_turns: Optional[int] = None) -> tuple[list[dict], list[dict]]:
    """System message (kept) and the first ``max_turns`` user turns (each gets a regenerated reply)."""
    system = [dict(m) for m in messages if m["role"] == "system"][:1]
    users = [dict(m) for m in messages if m["role"] == "user"]
    return system, users if max_turns is None else users[: int(max_turns)]


def keep_turns(messages: list[dict], max_turns: Optional[int]) -> list[dict]:
    """``messages`` up to (not including) its ``max_turns + 1``-th user turn."""
    if max_turns is None:
        return list(messages)
    out, users = [], 0
    for m in messages:
        if m["role"] == "user":
            users += 1
            if users > max_turns:
                break
        out.append(m)
    return out


def regenerate(engine, tokenizer, conversations: list[tuple[str, list[dict]]], sampling, max_length: int, seed: int,
               max_turns: Optional[int] = None, on_turn=None) -> tuple[dict[str, list[dict]], dict[str, Any]]:
    """Regenerate every assistant turn with the target, turn by turn, batched across
    conversations.

    For each conversation the system message (if any) and the user turns are kept; the
    reply to user turn ``r`` is generated from the rendered conversation so far (with
    the target's own earlier replies). A conversation stops early when its next prompt
    would leave no room under ``max_length`` (later turns would be cut anyway), and
    each reply is capped so that prompt + reply fits in ``max_length``. ``on_turn(r, n)``
    is called before turn ``r`` is generated for ``n`` conversations (progress display).

    Returns:
        ``(messages by sample id, stats)``; a sample whose first prompt alone does not
        fit is absent from the messages (``stats["too_long"]`` lists it);
        ``stats["cut"]`` lists conversations stopped before their last user turn and
        ``stats["generated_by_id"]`` the generated tokens per sample.
    """
    convs = []
    for sid, msgs in conversations:
        system, users = _plan_turns(msgs, max_turns)
        convs.append(_Conv(sid, system, users))
    stats: dict[str, Any] = {"generated_tokens": 0, "turns": 0, "too_long": [], "cut": [], "generated_by_id": {}}
    r = 0
    while True:
        active = [c for c in convs if not c.done and r < len(c.users)]
        if not active:
            break
        prompts, owners = [], []
        for c in active:
            msgs = c.prefix + [c.users[r]]
            ids = render_prompt(tokenizer, msgs)
            if len(ids) >= max_length:
                c.done = True
                if r == 0:
                    stats["too_long"].append(c.sample_id)
                else:
                    c.cut = True
                    stats["cut"].append(c.sample_id)
                continue
            prompts.append(ids)
            owners.append(c)
        if on_turn is not None:
            on_turn(r, len(prompts))
        # group by the room left under max_length so no reply is generated past it
        full = int(sampling.max_new_tokens)
        groups: dict[int, list[int]] = {}
        for j, ids in enumerate(prompts):
            room = min(full, max_length - len(ids))
            cap = full if room >= full else max(1, 1 << int(math.log2(room)))  # few distinct caps
            groups.setdefault(cap, []).append(j)
        replies: dict[int, list[int]] = {}
        for cap, js in sorted(groups.items(), reverse=True):
            smp = dataclasses.replace(sampling, max_new_tokens=cap, seed=seed * 1_000_003 + r * 101 + cap)
            outs = engine.generate([prompts[j] for j in js], smp)
            for j, out in zip(js, outs):
                replies[j] = out
        for j, c in enumerate(owners):
            out = replies[j]
            stats["generated_tokens"] += len(out)
            stats["generated_by_id"][c.sample_id] = stats["generated_by_id"].get(c.sample_id, 0) + len(out)
            stats["turns"] += 1
            text = tokenizer.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            c.prefix = c.prefix + [c.users[r], {"role": "assistant", "content": text}]
        r += 1
    result = {c.sample_id: c.prefix for c in convs if c.sample_id not in set(stats["too_long"])}
    return result, stats
