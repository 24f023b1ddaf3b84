"""Regenerating the assistant turns: the target answers every user turn of a conversation in order.

The system message (if any) and the user turns are kept; the reply to each user turn
is generated from the conversation so far, including the target's own earlier replies,
batched across conversations. :func:`keep_turns` is the path without regeneration.

Each conversation is kept as the ids the target was given and generated (sample layout
``target_ids``, :mod:`eagle3.features.format`): the first prompt is the chat template's
rendering with the generation prompt; the prompt of turn ``r + 1`` is the sequence of
turn ``r`` (its prompt and the generated ids, unchanged) followed by what the template
writes after a reply and before the next generation (:func:`eagle3.target.chat.reply_tail_ids`,
joined by :func:`eagle3.target.chat.close_reply`: the end-of-turn marker only when the
target did not generate it, then the next user turn and the generation prompt). The
replies are never decoded and tokenized again, so the drafter trains on exactly the
sequences the target produced; the loss mask is 1 on exactly the generated ids
(:func:`generated_mask`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from eagle3.target import close_reply, end_of_turn_ids, reply_tail_ids, render_prompt


@dataclasses.dataclass
class _Conv:
    """A conversation being regenerated: its fixed turns and what has been generated."""

    sample_id: str
    messages: list[dict]  # system messages + the turns so far (replies as decoded text)
    users: list[dict]  # user turns to answer
    ids: list[int] = dataclasses.field(default_factory=list)  # the target's sequence so far
    generated: list[list[int]] = dataclasses.field(default_factory=list)  # [start, end) of each reply in ids
    last: list[int] = dataclasses.field(default_factory=list)  # the ids of the last reply
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


def generated_mask(length: int, generated: list[list[int]]) -> list[int]:
    """Loss mask ``[length]`` (0/1 ints): 1 on the positions ``[start, end)`` of every
    generated reply (its end-of-turn token included when the target generated one), 0
    elsewhere; spans past ``length`` (a truncated sample) are cut."""
    mask = [0] * length
    for a, b in generated:
        for t in range(a, min(b, length)):
            mask[t] = 1
    return mask


def _next_prompt(tokenizer, c: _Conv, user: dict, eot: set[int]) -> list[int]:
    """The ids the engine is given for the reply to ``user``: the template's rendering for
    the first turn, else the sequence so far + the template's tail after the last reply."""
    if not c.generated:
        return render_prompt(tokenizer, c.messages + [user])
    return c.ids + close_reply(c.last, reply_tail_ids(tokenizer, c.messages[:-1], user), eot)


def _close(tokenizer, c: _Conv, eot: set[int]) -> None:
    """Append what the template writes after the conversation's last reply (ChatML: ``<|im_end|>\\n``
    when the reply was cut, else ``\\n``)."""
    if c.generated:
        c.ids = c.ids + close_reply(c.last, reply_tail_ids(tokenizer, c.messages[:-1], None), eot)


def _generate_capped(engine, prompts: list[list[int]], sampling, max_length: int, seed: int, r: int) -> list[list[int]]:
    """Generate a reply for every prompt, each capped so that prompt + reply fits ``max_length``.

    Prompts are grouped by their cap (``max_new_tokens``, or the power of two at most the
    room left; few distinct caps keep batches wide), each group seeded by ``(seed, r, cap)``.
    """
    full = int(sampling.max_new_tokens)
    groups: dict[int, list[int]] = {}
    for j, ids in enumerate(prompts):
        room = min(full, max_length - len(ids))
        cap = full if room >= full else max(1, 1 << int(math.log2(room)))
        groups.setdefault(cap, []).append(j)
    replies: dict[int, list[int]] = {}
    for cap, js in sorted(groups.items(), reverse=True):
        smp = dataclasses.replace(sampling, max_new_tokens=cap, seed=seed * 1_000_003 + r * 101 + cap)
        for j, out in zip(js, engine.generate([prompts[j] for j in js], smp)):
            replies[j] = [int(t) for t in out]
    return [replies[j] for j in range(len(prompts))]


def regenerate(engine, tokenizer, conversations: list[tuple[str, list[dict]]], sampling, max_length: int, seed: int,
               max_turns: Optional[int] = None, on_turn=None
               ) -> tuple[dict[str, list[dict]], dict[str, dict], dict[str, Any]]:
    """Regenerate every assistant turn with the target, turn by turn, batched across
    conversations, keeping the target's own ids (see the module docstring).

    For each conversation the system message (if any) and the user turns are kept; the
    reply to user turn ``r`` is generated from the conversation so far (with the
    target's own earlier replies, as ids). A conversation stops early when its next
    prompt would leave no room under ``max_length`` (later turns would be cut anyway),
    and each reply is capped so that prompt + reply fits in ``max_length``.
    ``on_turn(r, n)`` is called before turn ``r`` is generated for ``n`` conversations.

    Returns:
        ``(messages, sequences, stats)`` by sample id. ``messages``: the conversation
        with each reply decoded to text (a record for reading; not what is captured).
        ``sequences``: ``{"input_ids": [T] ints, "generated": [[start, end), ...]}``,
        the ids the target was given and generated, closed as the template closes the
        last reply, and the span of every reply in them. A sample whose first prompt
        alone does not fit is absent from both (``stats["too_long"]`` lists it);
        ``stats["cut"]`` lists conversations stopped before their last user turn,
        ``stats["generated_by_id"]`` the generated tokens per sample.
    """
    convs = []
    for sid, msgs in conversations:
        system, users = _plan_turns(msgs, max_turns)
        convs.append(_Conv(sid, system, users))
    eot = set(end_of_turn_ids(tokenizer))
    stats: dict[str, Any] = {"generated_tokens": 0, "turns": 0, "too_long": [], "cut": [], "generated_by_id": {}}
    r = 0
    while True:
        active = [c for c in convs if not c.done and r < len(c.users)]
        if not active:
            break
        prompts, owners = [], []
        for c in active:
            ids = _next_prompt(tokenizer, c, c.users[r], eot)
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
        outs = _generate_capped(engine, prompts, sampling, max_length, seed, r)
        for c, prompt, out in zip(owners, prompts, outs):
            stats["generated_tokens"] += len(out)
            stats["generated_by_id"][c.sample_id] = stats["generated_by_id"].get(c.sample_id, 0) + len(out)
            stats["turns"] += 1
            text = tokenizer.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            c.messages = c.messages + [c.users[r], {"role": "assistant", "content": text}]
            c.ids, c.last = prompt + out, out
            c.generated.append([len(prompt), len(prompt) + len(out)])
        r += 1
    too_long = set(stats["too_long"])
    kept = [c for c in convs if c.sample_id not in too_long]
    for c in kept:
        _close(tokenizer, c, eot)
    messages = {c.sample_id: c.messages for c in kept}
    sequences = {c.sample_id: {"input_ids": c.ids, "generated": c.generated} for c in kept}
    return messages, sequences, stats
