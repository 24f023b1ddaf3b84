"""Chat-template rendering and the assistant loss mask.

The loss mask is derived from the rendered text, not from a model-specific pattern:
the conversation is rendered once with the target's chat template; each assistant
message's content is located in that string (searching from the end of the rendered
prefix ``messages[:i]`` + generation prompt, which the full rendering starts with for
any prefix-consistent template); the character span is mapped to tokens through the
fast tokenizer's offsets (a slow tokenizer, such as Kimi's tiktoken one, gives none:
they are found by decoding, :func:`_decoded_offsets`); and the end-of-turn marker that
the template writes right after the content (``<|im_end|>`` for ChatML, ``<|eot_id|>``
for Llama 3, ...) is added, because the target generates it too.

``loss_mask[t] = 1`` iff token ``t`` overlaps an assistant message's content or is its
end-of-turn marker. Training uses ``loss_mask[t+1]`` for the prediction made at ``t``.
This text path serves conversations whose replies are given as text (dataset replies).

Replies the target generates keep its own ids instead (:mod:`eagle3.extract.regenerate`):
:func:`reply_tail_ids` gives the ids the template writes after a reply (its end-of-turn
marker, then the next user turn and generation prompt, or the conversation's closing),
and :func:`close_reply` joins them to the generated ids so that an end-of-turn token
the target generated is not written twice, and one it never generated (a reply cut at
the token limit) is written by the template, not by the target.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

from eagle3.errors import Eagle3Error
from eagle3.messages import ROLES, validate_messages  # noqa: F401  (re-exported by eagle3.target)

_SENTINEL = "EAGLE3_SENTINEL_CONTENT"


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    out = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
    )
    if not isinstance(out, str):
        raise Eagle3Error("the chat template did not render to a string; check model.chat_template")
    return out


def _encode(tokenizer, text: str, offsets: bool = False):
    return tokenizer(
        text, add_special_tokens=False, return_offsets_mapping=offsets, return_attention_mask=False
    )


def render_prompt(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template plus the generation prompt.

    This is what the target sees before it writes the next assistant turn (the template
    adds any BOS itself; no extra special tokens are added).
    """
    return list(_encode(tokenizer, _render(tokenizer, messages, True))["input_ids"])


def chat_template_hash(tokenizer) -> str:
    """``sha256:<hex>`` of the tokenizer's chat template text (as rendered for the target)."""
    tmpl = tokenizer.chat_template
    if isinstance(tmpl, dict):  # named templates: hash them all in a stable order
        tmpl = "\n".join(f"{k}\n{tmpl[k]}" for k in sorted(tmpl))
    return "sha256:" + hashlib.sha256((tmpl or "").encode()).hexdigest()


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    try:
        for tid, tok in tokenizer.added_tokens_decoder.items():
            if getattr(tok, "special", False):
                ids.add(int(tid))
    except AttributeError:
        pass
    return ids


def end_of_turn_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn: EOS and the template's end-of-turn marker.

    The marker is found by rendering a one-exchange conversation and taking the first
    special token after the assistant content (``<|im_end|>`` for ChatML).
    """
    ids: set[int] = set()
    eos = tokenizer.eos_token_id
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    text = _render(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}], False)
    pos = text.rfind(_SENTINEL)
    if pos >= 0:
        special = _special_ids(tokenizer)
        tail = _encode(tokenizer, text[pos + len(_SENTINEL):])["input_ids"]
        first = next((t for t in tail if t in special), None)
        if first is not None:
            ids.add(int(first))
    return sorted(ids)


def reply_tail_ids(tokenizer, history: Sequence[dict], next_user: Optional[dict]) -> list[int]:
    """Token ids the chat template writes right after the content of the last reply.

    ``history`` is the conversation up to the user turn that reply answers (the reply
    itself excluded). The template renders ``history``, an assistant message with a
    placeholder content and, when ``next_user`` is given, that user message and the
    generation prompt; the text after the placeholder is tokenized on its own (no
    special tokens added). For ChatML that is ``<|im_end|>\n<|im_start|>user\n...
    <|im_end|>\n<|im_start|>assistant\n`` (or ``<|im_end|>\n`` at the end); starting
    with a special token, it tokenizes as it does inside the whole rendering.

    Raises:
        Eagle3Error: the template does not render the placeholder content verbatim.
    """
    msgs = list(history) + [{"role": "assistant", "content": _SENTINEL}]
    if next_user is not None:
        msgs.append(dict(next_user))
    text = _render(tokenizer, msgs, next_user is not None)
    head = _render(tokenizer, history, True)
    pos = text.find(_SENTINEL, len(head) if text.startswith(head) else 0)
    if pos < 0:
        raise Eagle3Error("the chat template does not render assistant content verbatim, so the target's replies "
                          "cannot be placed in the conversation; use a template that renders assistant content as given")
    return list(_encode(tokenizer, text[pos + len(_SENTINEL):])["input_ids"])


def close_reply(generated: Sequence[int], tail: Sequence[int], eot: set[int]) -> list[int]:
    """The ids that follow ``generated`` in the conversation: ``tail`` (:func:`reply_tail_ids`)
    without its end-of-turn marker when the target generated one itself.

    A reply that stopped at an end-of-turn token (``eot``, :func:`end_of_turn_ids`) keeps
    it (a label) and the template's own marker ``tail[0]`` is dropped; a reply without
    one (cut at ``max_new_tokens``) is followed by the whole ``tail``, marker included,
    which is then no label, because the target never generated it.
    """
    if generated and generated[-1] in eot and tail and tail[0] in eot:
        return list(tail[1:])
    return list(tail)


def _token_span(offsets, start: int, end: int) -> tuple[int, int]:
    """Token index range [i, j) of tokens overlapping chars [start, end) (offsets sorted)."""
    i = 0
    n = len(offsets)
    while i < n and offsets[i][1] <= start:
        i += 1
    j = i
    while j < n and offsets[j][0] < end:
        j += 1
    return i, j


def _decoded_offsets(tokenizer, text: str, ids: Sequence[int]) -> list[tuple[int, int]]:
    """Character offsets ``[(start, end)]`` of ``ids`` in ``text``, found by decoding, for a
    tokenizer that gives none (a slow one, e.g. Kimi's tiktoken ``tokenization_kimi.py``).

    Tokens are decoded in the shortest runs that reproduce ``text`` at the cursor (a
    byte-level token may hold part of a character); every token of a run gets the run's
    span, as a fast tokenizer gives every byte-piece of a character that character's span.

    Raises:
        Eagle3Error: the decoded tokens do not spell ``text`` (a tokenizer that rewrites text).
    """
    out: list[tuple[int, int]] = []
    pos, run = 0, []
    for t in ids:
        run.append(int(t))
        piece = tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if text.startswith(piece, pos):
            out += [(pos, pos + len(piece))] * len(run)
            pos, run = pos + len(piece), []
        elif len(run) > 8:  # longer than any UTF-8 character split into byte tokens
            break
    if run or pos != len(text):
        raise Eagle3Error("the target's tokenizer gives no character offsets and its decoded tokens do not spell the "
                          "rendered conversation; use a fast (tokenizers) tokenizer with model.tokenizer=<folder>")
    return out


def render_conversation(tokenizer, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
    """Render a whole conversation: ``(input_ids, loss_mask)``, both length T.

    ``loss_mask`` is 1 on the tokens of every assistant message's content and on the
    end-of-turn token the template writes right after it (only whitespace between),
    0 elsewhere (system, user, role headers, generation prompts, separators).

    Raises:
        Eagle3Error: an invalid conversation (:func:`validate_messages`), a slow
            tokenizer whose decoded tokens do not spell the rendering, an
            assistant content the template does not reproduce verbatim, or a
            degenerate mask (all 0 with an assistant turn, or all 1).
    """
    validate_messages(messages)
    text = _render(tokenizer, messages, False)
    enc = _encode(tokenizer, text, offsets=True)
    ids = list(enc["input_ids"])
    offsets = enc.get("offset_mapping")
    offsets = [tuple(o) for o in offsets] if offsets is not None else _decoded_offsets(tokenizer, text, ids)
    mask = [0] * len(ids)
    eot = set(end_of_turn_ids(tokenizer))
    cursor = 0
    n_assistant = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        n_assistant += 1
        prefix = _render(tokenizer, messages[:i], True)
        start_from = len(prefix) if text.startswith(prefix) else cursor
        content = m["content"]
        a = text.find(content, start_from)
        if a < 0 and content.strip():
            content = content.strip()
            a = text.find(content, start_from)
        if a < 0:
            raise Eagle3Error(
                f"the chat template does not reproduce assistant message {i} verbatim, so its loss "
                "mask cannot be located; use a template that renders assistant content as given"
            )
        b = a + len(content)
        ti, tj = _token_span(offsets, a, b)
        for t in range(ti, tj):
            mask[t] = 1
        # end-of-turn marker: the first special token after the content, if only whitespace precedes it
        k = tj
        while k < len(ids) and offsets[k][0] < b:
            k += 1
        if k < len(ids) and ids[k] in eot and not text[b:offsets[k][0]].strip():
            mask[k] = 1
            b = offsets[k][1]
        cursor = b
    total = sum(mask)
    if n_assistant and total == 0:
        raise Eagle3Error("the chat template yields an all-zero loss mask for a conversation with assistant turns; check model.chat_template")
    if ids and total == len(ids):
        raise Eagle3Error("the chat template yields an all-one loss mask (nothing but assistant tokens); check model.chat_template")
    return ids, mask
