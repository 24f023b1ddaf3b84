"""Speculative decoding in process: the target runner, the drafter's proposer, draft trees, acceptance, the decoder."""

from __future__ import annotations

from eagle3.spec.decoder import (  # noqa: F401
    SpecSettings,
    GenerationResult,
    synchronize,
    truncate_cache,
    target_probs,
    TargetRunner,
    DraftProposer,
    Eagle3Proposer,
    DraftTree,
    build_draft,
    tree_ancestors,
    accept_greedy,
    accept_chain_sampling,
    accept_tree_sampling,
    target_generate,
    SpeculativeDecoder,
)
