"""Export a trained drafter for vLLM's EAGLE-3 loader; read it back as vLLM would.

vLLM format (``<output_dir>/export/vllm/``): the files of the SGLang export
(:mod:`eagle3.export.sglang`: ``LlamaForCausalLMEagle3`` ``config.json``, flat
``model.safetensors`` with ``d2t``, ``eagle3_meta.json``), which vLLM loads as an
EAGLE-3 drafter (``vllm/model_executor/models/llama_eagle3.py``), with one difference:
``eagle_config.eagle_aux_hidden_state_layer_ids`` holds HF ``output_hidden_states``
indices. vLLM captures id ``k`` after decoder layer ``k-1``
(``vllm/model_executor/models/llama.py``, ``_maybe_add_hidden_state(aux, idx + 1, ...)``),
which is HF index ``k``; SGLang's Llama rule adds 1. Served by vLLM, the SGLang export
would feed the drafter the layers below the trained ones, so each engine gets its own
folder and ``eagle3_meta.json`` records ``aux_id_convention: vllm``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from eagle3.errors import Eagle3Error
from eagle3.export.files import META_FILE
from eagle3.export.sglang import write_eagle3_export
from eagle3.export.validate import CONFIG_FILE, SGLangExport, read_sglang_export
from eagle3.model.drafter import Eagle3Drafter


def export_vllm(drafter: Eagle3Drafter, out_dir: str | os.PathLike, meta: dict,
                dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``drafter`` for vLLM to ``out_dir`` (atomically): the SGLang layout with HF
    aux ids (:func:`eagle3.export.sglang.write_eagle3_export`, ``convention="vllm"``).

    Args:
        drafter: the drafter (any number of layers). meta: provenance with ``aux_layer_ids`` (3 HF ids)
            and ``target.architecture``. dtype: weight dtype on disk (vLLM serves bf16).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        Eagle3Error: missing aux ids / architecture.
    """
    return write_eagle3_export(drafter, out_dir, meta, "vllm", dtype)


def read_vllm_export(export_dir: str | os.PathLike) -> SGLangExport:
    """Open and check a vLLM export without loading its weights.

    The files are checked as :func:`eagle3.export.validate.read_sglang_export` does; the
    aux ids vLLM will capture (``config.json``'s, unchanged) must equal the HF ids the
    drafter was trained on (``eagle3_meta.json``'s ``aux_layer_ids``).

    Returns:
        :class:`~eagle3.export.validate.SGLangExport` with ``convention == "vllm"``.

    Raises:
        Eagle3Error: damaged files, an SGLang export (naming ``.../export/vllm`` as the
            folder to serve), no aux ids, or ids vLLM would capture differently from the
            trained ones.
    """
    exp = read_sglang_export(export_dir, convention="vllm")
    written, trained = exp.written_aux_ids, exp.trained_aux_ids
    if written is None or trained is None:
        field = f"{CONFIG_FILE} field 'eagle_config.eagle_aux_hidden_state_layer_ids'" if written is None \
            else f"{META_FILE} field 'aux_layer_ids'"
        raise Eagle3Error(f"{exp.dir} lacks the {field}, so the layers vLLM captures cannot be checked; "
                          "re-export the drafter")
    family = (exp.meta.get("target") or {}).get("architecture") or "llama"
    captured = exp.captured_aux_ids("vllm", family)
    if captured != trained:
        raise Eagle3Error(
            f"{exp.dir}/{CONFIG_FILE} aux ids {written} make vLLM capture HF layers {captured}, but the drafter was "
            f"trained on {trained}; re-export it (export/vllm writes the HF ids unchanged)"
        )
    return exp
