"""Chat messages as every stage takes them: ``[{"role": ..., "content": ...}]``, checked once.

A module of its own (not :mod:`eagle3.target.chat`, which renders them with a chat
template) so that the prompt readers (:mod:`eagle3.prompts`) and the target's builders
(:mod:`eagle3.target.gptq` reads calibration conversations through the prompt readers)
both depend on it without depending on each other.
"""

from __future__ import annotations

from typing import Sequence

from eagle3.errors import Eagle3Error

ROLES = ("system", "user", "assistant")


def validate_messages(messages: Sequence[dict], where: str = "conversation") -> None:
    """Check a conversation: non-empty, known roles, string contents, a user turn first.

    Raises:
        Eagle3Error: naming ``where`` (a file and line, or a sample id) and the problem.
    """
    if not messages:
        raise Eagle3Error(f"{where}: the conversation is empty; give at least one user message")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise Eagle3Error(
                f"{where}: every message needs a role in {list(ROLES)} and a string content, got {str(m)[:80]!r}"
            )
    first = next((m["role"] for m in messages if m["role"] != "system"), None)
    if first != "user":
        raise Eagle3Error(f"{where}: the conversation has no user turn before the first assistant turn; start it with a user message")
