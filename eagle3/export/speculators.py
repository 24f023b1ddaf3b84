"""Export a trained drafter in the speculators format, which vLLM serves.

The speculators format (``export/speculators/``, read by vLLM) is written by the
``speculators`` library itself (``Eagle3DraftModel.save_pretrained``); its aux ids
are HF ``output_hidden_states`` indices. ``speculators`` is optional
(``pip install 'eagle3[speculators]'``) and imported only when an export runs.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from eagle3.model.drafter import Eagle3Drafter
from eagle3.errors import Eagle3Error
from eagle3.export.files import META_FILE, staging_dir, write_json
from eagle3.io import replace_dir


def speculators_available() -> bool:
    """True when the optional ``speculators`` package imports."""
    try:
        import speculators.models.eagle3  # noqa: F401
    except Exception:  # noqa: BLE001  (a broken optional install counts as absent)
        return False
    return True


def to_speculators_model(drafter: Eagle3Drafter, meta: dict, ttt_steps: int):
    """The drafter as a ``speculators`` ``Eagle3DraftModel`` with the same weights.

    Aux ids are written in HF convention (speculators' own); the verifier is recorded
    by ``meta['target']['path']`` or name and ``architectures``.

    Args:
        drafter: the drafter (its ``rotary_emb`` buffers are not copied).
        meta: provenance with ``aux_layer_ids`` (3 HF ids) and ``target``.
        ttt_steps: speculative tokens of the greedy proposal.

    Raises:
        Eagle3Error: ``hidden_size`` differs from the target's, or the speculators
            model does not take the drafter's weights.
    """
    from transformers import LlamaConfig
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    a = drafter.arch
    if not a.shares_target_embeddings:
        raise Eagle3Error("the speculators format needs hidden_size == the target's hidden size")
    lc = LlamaConfig(
        hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_attention_heads=a.num_attention_heads, num_key_value_heads=a.num_key_value_heads,
        head_dim=a.head_dim, num_hidden_layers=a.num_layers, vocab_size=a.vocab_size,
        rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta, max_position_embeddings=a.max_position_embeddings,
        tie_word_embeddings=False,
    )
    lc._attn_implementation = "sdpa"
    target = meta.get("target") or {}
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=lc,
        draft_vocab_size=a.draft_vocab_size,
        target_hidden_size=a.target_hidden_size,
        eagle_aux_hidden_state_layer_ids=list(meta["aux_layer_ids"]),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=int(ttt_steps))],
            default_proposal_method="greedy",
            verifier=VerifierConfig(
                name_or_path=target.get("path") or target.get("name"),
                architectures=list(target.get("hf_architectures") or ["LlamaForCausalLM"]),
            ),
        ),
    )
    model = Eagle3DraftModel(cfg)
    sd = {k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = set(missing) - {"verifier_lm_head.weight", "verifier_norm.weight"}
    if missing or unexpected:
        raise Eagle3Error(f"speculators Eagle3DraftModel does not fit this drafter: missing {sorted(missing)}, "
                          f"unexpected {sorted(unexpected)}")
    return model


def export_speculators(drafter: Eagle3Drafter, out_dir: str | os.PathLike, meta: dict, ttt_steps: int,
                       dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the vLLM (speculators) format through ``speculators`` (atomically).

    Args:
        drafter: the drafter to export (copied to float32 on the CPU, then cast).
        out_dir: the export folder; ``eagle3_meta.json`` is written beside the model.
        meta: provenance, see :func:`to_speculators_model`.
        ttt_steps: speculative tokens of the greedy proposal.
        dtype: weight dtype on disk.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        Eagle3Error: ``speculators`` is not installed (``pip install speculators``).
    """
    if not speculators_available():
        raise Eagle3Error("the speculators export needs the optional package: pip install 'eagle3[speculators]'")
    out = Path(out_dir)
    tmp = staging_dir(out)
    model = to_speculators_model(copy.deepcopy(drafter).float().cpu(), meta, ttt_steps).to(dtype)
    model.save_pretrained(str(tmp))
    write_json(tmp / META_FILE, dict(meta, draft_vocab_size=drafter.arch.draft_vocab_size))
    replace_dir(tmp, out)
    return out
