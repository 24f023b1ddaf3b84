"""The explicit attention masks of static and batched decoding, in the form each attention
implementation reads, and the attention keys that run outside compiled code.

:data:`SDPA_OUTSIDE_COMPILE` is transformers' ``sdpa`` registered under a key whose calls
stay eager inside compiled decoder layers (:mod:`eagle3.spec.compiled` registers it);
:data:`OUTSIDE_COMPILE` holds it and :data:`eagle3.gqa.GQA_SDPA_OUTSIDE_COMPILE`. Both read
a mask as ``sdpa`` does.
"""

from __future__ import annotations

import torch

from eagle3.errors import Eagle3Error
from eagle3.gqa import GQA_DECODE, GQA_SDPA, GQA_SDPA_OUTSIDE_COMPILE

#: transformers attention-implementation key of sdpa kept outside compiled code (:mod:`eagle3.spec.compiled`)
SDPA_OUTSIDE_COMPILE = "eagle3_sdpa_outside_compile"
#: every attention implementation key that runs outside compiled code (this one and eagle3.gqa's)
OUTSIDE_COMPILE = (SDPA_OUTSIDE_COMPILE, GQA_SDPA_OUTSIDE_COMPILE)


def explicit_mask(visible: torch.Tensor, attn_implementation: str, dtype: torch.dtype, what: str) -> torch.Tensor:
    """A 4D bool visibility mask (``[B, 1, n, S]``, True = attend) in the form an attention
    implementation reads: ``sdpa`` takes it as is, ``eager`` an additive mask in ``dtype``
    (0 = attend, the dtype's minimum = masked; transformers ``eager_attention_forward``); the
    GQA attentions (:mod:`eagle3.gqa`, :mod:`eagle3.engines.hf.attention`) and the
    compile-disabled keys (:data:`OUTSIDE_COMPILE`) read it as ``sdpa`` does.

    Raises:
        Eagle3Error: another implementation (it takes no explicit mask); ``what`` names the
            caller in the message.
    """
    if attn_implementation == "eager":
        zero = torch.zeros((), dtype=dtype, device=visible.device)
        return torch.where(visible, zero, torch.finfo(dtype).min)
    if attn_implementation in ("sdpa", GQA_SDPA, GQA_DECODE, *OUTSIDE_COMPILE):  # sdpa and the keys reading its mask
        return visible
    raise Eagle3Error(f"{what} needs an explicit attention mask, which attn_implementation='{attn_implementation}' "
                      "does not take; use engine.attn_implementation=sdpa or eager")
