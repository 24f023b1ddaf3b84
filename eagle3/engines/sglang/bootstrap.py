"""The bootstrap drafter: a random EAGLE-3 drafter that makes a stock server capture.

Only in EAGLE3 mode does an SGLang target capture its three aux layers and return
them through ``return_hidden_states``, and that mode needs a drafter. The bootstrap
drafter is a randomly initialised one for this target, exported by
:func:`eagle3.export.export_sglang` like a trained one, written once under
``cache_dir`` and served with :data:`CAPTURE_SPEC`; its outputs are never used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from eagle3.target import resolve_target

log = logging.getLogger(__name__)


#: Minimal speculative settings for the capture server: the bootstrap drafter only has
#: to exist so the target runs in EAGLE3 mode; one chain step keeps its overhead small.
CAPTURE_SPEC = {"num_steps": 1, "topk": 1, "num_draft_tokens": 2}
#: Draft vocabulary of the bootstrap drafter (its lm_head is never trained).
BOOTSTRAP_DRAFT_VOCAB = 4096


def _target_dims(model_cfg: Any, cache_dir: str | os.PathLike) -> dict:
    """Target sizes, aux ids and local folder from ``eagle3.target.resolve_target``
    (for a hub-only target such as Kimi these come from the model config alone)."""
    info = resolve_target(model_cfg, cache_dir)
    dims = {k: getattr(info, k, None) for k in (
        "num_layers", "hidden_size", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings",
        "aux_layer_ids", "path", "content_hash")}
    return dims


def bootstrap_arch(dims: dict, tp: int) -> dict:
    """Sizes of the bootstrap drafter: the target's hidden size (so SGLang shares the
    target's embeddings), a small attention/MLP that divides by the TP degree, a
    :data:`BOOTSTRAP_DRAFT_VOCAB`-token draft vocabulary. Its outputs are never used."""
    tp = max(1, int(tp))
    heads = tp * max(1, -(-8 // tp))  # >= 8, divisible by tp
    return {
        "hidden_size": int(dims["hidden_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": 64,
        "intermediate_size": 128 * tp * max(1, -(-8 // tp)),
        "num_layers": 1,
        "target_hidden_size": int(dims["hidden_size"]),
        "vocab_size": int(dims["vocab_size"]),
        "draft_vocab_size": min(BOOTSTRAP_DRAFT_VOCAB, int(dims["vocab_size"])),
        "rms_norm_eps": float(dims.get("rms_norm_eps") or 1e-6),
        "rope_theta": float(dims.get("rope_theta") or 10000.0),
        "max_position_embeddings": int(dims.get("max_position_embeddings") or 131072),
    }


def write_bootstrap_drafter(out_dir: Path, arch: dict, aux_layer_ids: list[int], architecture: str, meta: dict, seed: int = 0) -> Path:
    """Write a randomly initialised drafter in the SGLang format.

    The drafter is an ``eagle3.model.drafter.Eagle3Drafter`` of sizes ``arch``,
    initialised under ``torch.manual_seed(seed)`` and written by the project's exporter
    (``eagle3.export.sglang.export_sglang``) in the documented format (docs/design.md,
    "Export"): ``config.json`` (``LlamaForCausalLMEagle3``, aux ids in SGLang's
    convention for the architecture) and ``model.safetensors`` with ``fc.weight [H, 3H]``,
    ``midlayer.*``, ``norm.weight``, ``lm_head.weight [Vd, H]`` (bf16), ``d2t [Vd]``
    int64 offsets (all zero: draft id ``i`` is target id ``i``), ``t2d [V]`` bool, and
    no ``embed_tokens.weight`` (``H`` is the target's, so SGLang shares its table).

    Args:
        out_dir: the drafter folder (written atomically).
        arch: sizes from :func:`bootstrap_arch`.
        aux_layer_ids: the target's 3 aux layers, HF convention.
        architecture: the target's family (``llama`` | ``deepseek_v2``), which decides
            the ids written in ``config.json``.
        meta: provenance for ``eagle3_meta.json``; the aux ids and the architecture
            are added to it.
        seed: torch seed of the random weights.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        Eagle3Error: aux ids that SGLang cannot express for that architecture.
    """
    # imported here: the exporter needs transformers, which talking to a server does not
    from eagle3.export import export_sglang
    from eagle3.model.drafter import DrafterArch, Eagle3Drafter

    torch.manual_seed(seed)
    meta = dict(meta, aux_layer_ids=list(aux_layer_ids))
    meta.setdefault("target", {})["architecture"] = architecture
    drafter = Eagle3Drafter(DrafterArch(**{k: arch[k] for k in DrafterArch.__dataclass_fields__ if k in arch}))
    return Path(export_sglang(drafter, Path(out_dir), meta))


def ensure_bootstrap_drafter(model_cfg: Any, dims: dict, aux_layer_ids: list[int], cache_dir: str | os.PathLike) -> Path:
    """The bootstrap drafter folder for this target under ``cache_dir`` (written once)."""
    arch = bootstrap_arch(dims, model_cfg.serve.tp)
    key = json.dumps({"arch": arch, "aux": aux_layer_ids, "family": model_cfg.architecture}, sort_keys=True)
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    out = Path(cache_dir) / "bootstrap-drafters" / f"{model_cfg.name}-{tag}"
    if (out / "config.json").exists():
        return out
    meta = {
        "purpose": "bootstrap drafter: random weights; serves only to run the target in EAGLE3 mode for capture",
        "target": {"name": model_cfg.name, "architecture": model_cfg.architecture,
                   "quantization": {"method": model_cfg.quantization.method}},
        "draft_vocab_size": arch["draft_vocab_size"],
    }
    log.info("writing the bootstrap drafter for %s to %s", model_cfg.name, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_bootstrap_drafter(out, arch, aux_layer_ids, model_cfg.architecture, meta)


def read_draft_aux_ids(draft_path: str | None, architecture: str) -> list[int] | None:
    """HF-convention aux ids a server captures with the drafter at ``draft_path`` (a
    local folder with ``config.json``, read by :class:`eagle3.export.ExportFiles`; SGLang's
    rule applied, :func:`eagle3.target.engine_captured_ids`), or None when it cannot be read
    from here or names no ids.

    Raises:
        Eagle3Error: the ``config.json`` there is not a JSON object.
    """
    from eagle3.export.validate import ExportFiles

    files = ExportFiles(Path(draft_path)) if draft_path else None
    if files is None or not files.config_path.is_file():
        return None
    files.read_config()
    return None if files.written_aux_ids is None else files.captured_aux_ids("sglang", architecture)
