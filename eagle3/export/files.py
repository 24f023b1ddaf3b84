"""What the SGLang and speculators exports share on disk.

Both formats sit in a folder written under ``<name>.tmp`` and swapped into place
(:func:`eagle3.io.replace_dir`), carry the provenance file :data:`META_FILE` beside
the weights, and name weight dtypes by the strings in :data:`DTYPES` (those of
``config.json``'s ``torch_dtype``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

META_FILE = "eagle3_meta.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
