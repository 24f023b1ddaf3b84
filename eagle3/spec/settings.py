"""Settings of one speculative decoding run and the result of one prompt's generation.

:class:`SpecSettings` holds (and validates) what SGLang's ``--speculative-*`` flags and
the sampling parameters mean; :class:`GenerationResult` holds the generated tokens and
the verify-pass counts that SGLang reports in ``meta_info`` (how they are counted:
:mod:`eagle3.spec.decoder`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from eagle3.errors import Eagle3Error


@dataclass(frozen=True)
class SpecSettings:
    """Speculative decoding and sampling settings of one run.

    ``num_steps``/``topk``/``num_draft_tokens`` mean what SGLang's
    ``--speculative-num-steps``/``--speculative-eagle-topk``/
    ``--speculative-num-draft-tokens`` mean. Build with :meth:`make`, which validates.
    """

    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 128

    @property
    def is_chain(self) -> bool:
        """True when the draft is a chain (``topk == 1``), False for a tree."""
        return self.topk == 1

    @property
    def greedy(self) -> bool:
        """True at temperature 0 (argmax decoding), False when sampling."""
        return self.temperature <= 0.0

    @classmethod
    def make(
        cls,
        num_steps: int,
        topk: int,
        num_draft_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_new_tokens: int = 128,
    ) -> tuple["SpecSettings", Optional[str]]:
        """Validated settings plus an optional note.

        With ``topk == 1`` the number of draft tokens is forced to ``num_steps + 1``
        (as SGLang does); the note says so when the configured value differed.

        Raises:
            Eagle3Error: non-positive steps/topk/max_new_tokens, a tree whose
                ``num_draft_tokens`` is outside ``2 .. 1 + topk + (num_steps-1)*topk**2``
                (the candidates SGLang's tree building can offer), or top_p outside (0, 1].
        """
        if num_steps < 1 or topk < 1:
            raise Eagle3Error(
                f"speculative.num_steps ({num_steps}) and speculative.topk ({topk}) must be >= 1"
            )
        if max_new_tokens < 1:
            raise Eagle3Error(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not 0.0 < top_p <= 1.0:
            raise Eagle3Error(f"top_p must be in (0, 1], got {top_p}")
        note = None
        if topk == 1:
            if num_draft_tokens != num_steps + 1:
                note = (
                    f"speculative.num_draft_tokens={num_draft_tokens} ignored: a chain (topk=1) "
                    f"verifies num_steps+1 = {num_steps + 1} tokens per pass (as SGLang forces)"
                )
            num_draft_tokens = num_steps + 1
        else:
            most = 1 + topk + (num_steps - 1) * topk * topk
            if not 2 <= num_draft_tokens <= most:
                raise Eagle3Error(
                    f"speculative.num_draft_tokens={num_draft_tokens} is impossible with "
                    f"num_steps={num_steps}, topk={topk}; use a value in 2..{most}"
                )
        return (
            cls(num_steps, topk, num_draft_tokens, float(temperature), float(top_p), int(max_new_tokens)),
            note,
        )


@dataclass
class GenerationResult:
    """One prompt's generation.

    ``tokens``: generated target token ids (first one from the prefill), ending at the
    first stop token (included) or at ``max_new_tokens``. ``verify_passes``,
    ``accepted_drafts``: counts over the verify passes (accepted drafts counted as the
    verifier decided, before truncation at the end). ``accept_counts[i]``: drafts
    accepted by pass i. ``emitted``: tokens emitted by verify passes (bonus included,
    truncated at the end) = ``len(tokens) - 1``. ``seconds``: wall time of the whole
    generation, device-synchronised; ``prefill_seconds``: of which until the first
    token was known.
    """

    tokens: list[int]
    verify_passes: int = 0
    accepted_drafts: int = 0
    emitted: int = 0
    accept_counts: list[int] = field(default_factory=list)
    seconds: float = 0.0
    prefill_seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """tau = emitted tokens / verify passes (``nan`` without a pass)."""
        return self.emitted / self.verify_passes if self.verify_passes else float("nan")
