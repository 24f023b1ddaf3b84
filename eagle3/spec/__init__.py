"""Speculative decoding in process: the target runner, the drafter's proposer, draft trees, acceptance, the decoder."""

from __future__ import annotations

from eagle3.spec.settings import (  # noqa: F401
    SpecSettings,
    GenerationResult,
)
from eagle3.spec.target import (  # noqa: F401
    synchronize,
    truncate_cache,
    TargetRunner,
)
from eagle3.spec.proposer import (  # noqa: F401
    DraftProposer,
    Eagle3Proposer,
)
from eagle3.spec.tree import (  # noqa: F401
    DraftTree,
    build_draft,
    tree_ancestors,
)
from eagle3.spec.accept import (  # noqa: F401
    target_probs,
    accept_greedy,
    accept_chain_sampling,
    accept_tree_sampling,
)
from eagle3.spec.decoder import (  # noqa: F401
    target_generate,
    SpeculativeDecoder,
)
from eagle3.runtime.slots import SlotCache  # noqa: F401
from eagle3.spec.static_target import StaticTargetRunner  # noqa: F401
from eagle3.spec.static_proposer import StaticEagle3Proposer  # noqa: F401
from eagle3.spec.oracle import ForcedProposer  # noqa: F401
from eagle3.spec.build import build_decoder, static_max_len  # noqa: F401
