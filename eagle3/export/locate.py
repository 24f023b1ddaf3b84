"""Which export folder an engine serves, given evaluate's ``drafter_dir``.

A training run (``train.py``'s ``output_dir``) writes one export per aux-id convention
(:data:`eagle3.export.files.CONVENTIONS`): ``<run>/export/sglang`` (read by SGLang and by the
in-process ``hf`` engine) and ``<run>/export/vllm`` (aux layer ids in vLLM's convention; an
SGLang export served by vLLM feeds the drafter the layers below the trained ones).
``drafter_dir`` names either the run's folder (evaluate's default,
``data/drafters/<model>/sharegpt``) or one export folder itself (what commands written before
passed); :func:`export_dir` turns it into the folder the stage's engine reads. The value of
``drafter_dir`` itself is never rewritten.
"""

from __future__ import annotations

import logging
from pathlib import Path

from eagle3.errors import Eagle3Error
from eagle3.export.files import CONVENTIONS, META_FILE

log = logging.getLogger("eagle3")

#: engine name -> the export convention (subfolder of ``<run>/export``) it reads
ENGINE_EXPORTS = {"hf": "sglang", "sglang": "sglang", "vllm": "vllm"}
#: files any export folder holds (one of them marks a folder as an export, damaged or not)
EXPORT_FILES = ("config.json", "model.safetensors", META_FILE)


def is_export_folder(d: Path) -> bool:
    """Whether ``d`` is an export folder: it holds one of :data:`EXPORT_FILES`, or it is named
    ``export/<convention>`` (a run's export not written yet: its reader names what is missing)."""
    return any((d / f).is_file() for f in EXPORT_FILES) or (d.name in CONVENTIONS and d.parent.name == "export")


def export_dir(drafter_dir: str | Path, engine: str) -> Path:
    """The export folder ``engine`` reads for ``drafter_dir`` (module docstring).

    Args:
        drafter_dir: a training run's folder (holding ``export/``) or an export folder.
        engine: ``hf`` | ``sglang`` (both read ``export/sglang``) | ``vllm`` (``export/vllm``).

    Returns:
        ``<run>/export/<convention>`` for a run folder (whether or not it was written: the
        readers name a missing ``config.json``); an export folder as given, except that
        ``vllm`` given ``<run>/export/sglang`` gets ``<run>/export/vllm`` when that holds a
        ``config.json`` (an SGLang export with no vLLM export beside it is returned as given
        and refused by :func:`eagle3.export.read_vllm_export`, which names the folder to use).

    Raises:
        Eagle3Error: an engine other than ``hf``, ``sglang`` or ``vllm``; or ``drafter_dir``
            is neither a run folder nor an export folder (missing, or holding neither
            ``export/`` nor any of :data:`EXPORT_FILES`).
    """
    want = ENGINE_EXPORTS.get(str(engine))
    if want is None:
        raise Eagle3Error(f"engine '{engine}' has no drafter export; use engine=hf, engine=sglang or engine=vllm")
    d = Path(drafter_dir)
    if (d / "export").is_dir():
        return d / "export" / want
    if is_export_folder(d):
        sibling = d.parent / "vllm"
        if want == "vllm" and d.name == "sglang" and d.parent.name == "export" and (sibling / "config.json").is_file():
            log.info("engine=vllm serves %s, the vLLM export beside %s", sibling, d)
            return sibling
        return d
    what = "does not exist" if not d.exists() else f"holds neither export/ nor {', '.join(EXPORT_FILES)}"
    raise Eagle3Error(
        f"drafter_dir={d} {what}: expected a training run's folder (train.py's output_dir, holding "
        f"export/sglang and export/vllm) or an export folder (config.json, model.safetensors); run train.py "
        f"first or set drafter_dir=<train output_dir>"
    )
