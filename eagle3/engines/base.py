"""The engine interface: what the extract (and evaluate) stages need from a served target.

An engine serves one target. It regenerates assistant turns for rendered prompts and
captures, for full token sequences, the target's aux hidden states and its next-token
top-k distribution at every position. ``eagle3.engines.hf.engine`` runs transformers
in-process; ``eagle3.engines.sglang.engine`` talks to an SGLang server.
"""

from __future__ import annotations

import abc
from typing import Any

from eagle3.features import Capture


class Engine(abc.ABC):
    """A served target.

    Conventions (see docs/design.md): aux layer ids are HF ``output_hidden_states``
    indices (id ``k`` = residual stream entering decoder layer ``k``); position ``t``
    of a capture holds the state at token ``t`` and the distribution of token ``t+1``.
    """

    @abc.abstractmethod
    def info(self) -> dict[str, Any]:
        """JSON-able metadata for the manifest (engine name, device, dtype, versions, flags).

        Everything in it must be equal for a resumed extraction to be valid, so it holds
        only what changes the numerics, not batch sizes or URLs.
        """

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], sampling) -> list[list[int]]:
        """Generate one response per rendered prompt.

        Args:
            prompts: token ids of chat-template-rendered prompts (generation prompt
                included), any lengths.
            sampling: :class:`eagle3.config.SamplingConfig` (temperature 0 = greedy;
                top_p; max_new_tokens; seed).

        Returns:
            Per prompt, the generated token ids in order, ending with the end-of-turn /
            EOS token when the model stopped (included), else ``max_new_tokens`` long.
        """

    @abc.abstractmethod
    def capture(self, sequences: list[list[int]], top_k: int) -> list[Capture]:
        """Run the target over full token sequences and return, per sequence (length T),
        ``Capture(aux_hidden_states [T, 3, H] bf16, topk_ids [T, k] int32,
        topk_logprobs [T, k] float32)`` as CPU tensors; log-probs are a float32
        log-softmax over the full target vocabulary."""

    def close(self) -> None:
        """Release the model / server (idempotent)."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
