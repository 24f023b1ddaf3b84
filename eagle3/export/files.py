"""What the SGLang, vLLM and speculators exports share on disk.

All formats sit in a folder written under ``<name>.tmp`` and swapped into place
(:func:`eagle3.io.replace_dir`), carry the provenance file :data:`META_FILE` beside
the weights, and name weight dtypes by the strings in :data:`DTYPES` (those of
``config.json``'s ``torch_dtype``).

The SGLang and vLLM exports hold the same files and weights and differ only in the aux
layer ids of ``config.json``, written in the serving engine's convention
(:mod:`eagle3.target.layers`); ``eagle3_meta.json`` records which in
:data:`CONVENTION_FIELD` (absent in exports written before there was a vLLM export: SGLang).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from eagle3.errors import Eagle3Error

META_FILE = "eagle3_meta.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: ``eagle3_meta.json`` field naming the engine whose aux-id convention ``config.json`` uses
CONVENTION_FIELD = "aux_id_convention"
#: the conventions an export can be written in, each in its own folder ``<output_dir>/export/<convention>``
CONVENTIONS = ("sglang", "vllm")


def export_convention(meta: dict) -> str:
    """The aux-id convention an export's ``eagle3_meta.json`` records (``sglang`` when absent).

    Raises:
        Eagle3Error: the field holds something other than ``sglang`` or ``vllm``.
    """
    conv = meta.get(CONVENTION_FIELD, "sglang") if meta else "sglang"
    if conv not in CONVENTIONS:
        raise Eagle3Error(f"{META_FILE} field '{CONVENTION_FIELD}' is {conv!r}, not one of {list(CONVENTIONS)}; "
                          "re-export the drafter")
    return conv


def check_convention(export_dir: Path, meta: dict, want: str) -> None:
    """Refuse an export written for another engine than ``want`` (``sglang`` | ``vllm``).

    The two engines read ``eagle_aux_hidden_state_layer_ids`` differently (SGLang adds 1
    on Llama, vLLM does not), so an export served by the other engine feeds the drafter
    the wrong layers.

    Raises:
        Eagle3Error: the export's :data:`CONVENTION_FIELD` differs from ``want``; the
            message names the folder of the right export.
    """
    got = export_convention(meta)
    if got == want:
        return
    d = Path(export_dir)
    right = d.parent / want if d.name == got else f"<train output_dir>/export/{want}"
    raise Eagle3Error(
        f"{d} is the export for {got} (aux layer ids in {got}'s convention, which {want} reads as other layers); "
        f"use {right} instead (train.py writes both)"
    )


def dtype_name(dtype: torch.dtype) -> str:
    """The ``torch_dtype`` string of ``dtype`` (one of the values of :data:`DTYPES`).

    Raises:
        KeyError: ``dtype`` is not bf16, fp16 or fp32.
    """
    return {v: k for k, v in DTYPES.items()}[dtype]


def write_json(path: Path, obj) -> None:
    """Write ``obj`` as indented JSON (keys in insertion order) with a final newline."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def staging_dir(out: Path) -> Path:
    """``<out>.tmp`` beside ``out``, with any leftover of an interrupted export removed.

    The folder itself is not created; the caller fills it and hands it to
    :func:`eagle3.io.replace_dir`.
    """
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    return tmp
