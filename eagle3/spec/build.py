"""Which target runner and proposer a run decodes with: dynamic caches, or static caches with CUDA graphs.

:func:`build_decoder` is what evaluation and the doctor's probe call. ``static=None``
(auto) picks the static-cache path (:mod:`eagle3.spec.static_target`,
:mod:`eagle3.spec.static_proposer`) on CUDA, where a small target at batch 1 is
launch-bound and graphs pay, and the dynamic ``DynamicCache`` path on CPU, where a
forward is compute-bound and attending over a preallocated buffer only adds work
(measured in ``benchmarks/spec_decode_speed.py``). Both paths decode the same tokens
(``tests/test_static_decode.py``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from eagle3.spec.decoder import SpeculativeDecoder
from eagle3.spec.proposer import Eagle3Proposer
from eagle3.spec.settings import SpecSettings
from eagle3.spec.static_proposer import StaticEagle3Proposer
from eagle3.spec.static_target import StaticTargetRunner
from eagle3.spec.target import TargetRunner


def static_max_len(max_prompt_tokens: int, settings: SpecSettings) -> int:
    """KV slots a static cache needs: prompt + generated tokens + one round's draft nodes
    (``num_draft_tokens`` verified, ``(num_steps - 1) * topk`` drafter slots beyond them)."""
    return int(max_prompt_tokens) + settings.max_new_tokens + settings.num_draft_tokens + settings.num_steps * settings.topk


def use_static(static: Optional[bool], device: torch.device) -> bool:
    """``static`` as given, or (None) True on CUDA and False on CPU."""
    return torch.device(device).type == "cuda" if static is None else bool(static)


def build_decoder(model, drafter, aux_layer_ids: Sequence[int], settings: SpecSettings, stop_ids: Sequence[int],
                  max_prompt_tokens: int, static: Optional[bool] = None,
                  cuda_graphs: Optional[bool] = None, min_span: Optional[int] = 256) -> SpeculativeDecoder:
    """A :class:`SpeculativeDecoder` for ``model`` (target) and ``drafter`` (an ``Eagle3Drafter``).

    Args:
        model: transformers causal LM in eval mode.
        drafter: the EAGLE-3 drafter on the same device.
        aux_layer_ids: HF-convention ids the drafter reads.
        settings: decoding settings (``max_new_tokens`` and the draft shape size the caches).
        stop_ids: generation ends after any of these.
        max_prompt_tokens: longest prompt to be decoded (sizes the static caches).
        static: static caches; None = on CUDA only (module docstring).
        cuda_graphs: with static caches on CUDA, replay forwards from CUDA graphs; None = yes.
        min_span: with static caches, the smallest attention span in slots
            (:meth:`eagle3.runtime.slots.SlotCache.span_for`); None = every call attends over
            all slots sized for ``max_prompt_tokens``.

    Raises:
        Eagle3Error: from the runner (aux ids outside the target, attention without 4D masks).
    """
    device = next(model.parameters()).device
    aux = list(aux_layer_ids)
    if use_static(static, device):
        n = static_max_len(max_prompt_tokens, settings)
        runner = StaticTargetRunner(model, aux, max_len=n, cuda_graphs=cuda_graphs, min_span=min_span)
        proposer = StaticEagle3Proposer(drafter, aux, max_len=n, cuda_graphs=cuda_graphs, min_span=min_span)
    else:
        runner, proposer = TargetRunner(model, aux), Eagle3Proposer(drafter, aux)
    return SpeculativeDecoder(runner, proposer, settings, stop_ids)
