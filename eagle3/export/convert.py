"""Write the vLLM export of an existing SGLang export (a drafter trained before ``export/vllm``
existed, or copied without it): ``python -m eagle3.export.convert <.../export/sglang> [<.../export/vllm>]``.

The weights are read the way SGLang reads them (:func:`eagle3.export.sglang.load_sglang_export`,
every file checked) and written again with :func:`eagle3.export.vllm.export_vllm`, whose
``config.json`` holds the HF aux ids vLLM captures as given
(:mod:`eagle3.target.layers`); the provenance in ``eagle3_meta.json`` is carried over.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from eagle3.errors import Eagle3Error
from eagle3.export.files import CONVENTIONS, META_FILE
from eagle3.export.sglang import load_sglang_export
from eagle3.export.vllm import export_vllm, read_vllm_export


def sglang_to_vllm(src: str | os.PathLike, dst: str | os.PathLike | None = None) -> Path:
    """Write ``dst`` (default: ``vllm`` beside ``src``) as the vLLM export of the SGLang export ``src``.

    Returns:
        ``dst`` as a Path, checked by :func:`eagle3.export.vllm.read_vllm_export`.

    Raises:
        Eagle3Error: ``src`` is not a readable SGLang export (as :func:`load_sglang_export`),
            or ``dst`` is ``src``.
    """
    src = Path(src)
    dst = Path(dst) if dst is not None else src.parent / "vllm"
    if dst.resolve() == src.resolve():
        raise Eagle3Error(f"the vLLM export would overwrite its source {src}; give another output folder")
    drafter, _ = load_sglang_export(src)
    meta = json.loads((src / META_FILE).read_text())  # as written: HF aux ids, provenance
    for c in CONVENTIONS:
        meta.pop(f"{c}_aux_layer_ids", None)
    export_vllm(drafter, dst, meta)
    read_vllm_export(dst)
    return dst


def main(argv: list[str] | None = None) -> int:
    """Command line: exit 0 with the written folder on stdout, 2 with one line on stderr."""
    p = argparse.ArgumentParser(prog="python -m eagle3.export.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="an SGLang export folder (.../export/sglang)")
    p.add_argument("dst", nargs="?", help="where to write the vLLM export (default: vllm beside src)")
    a = p.parse_args(argv)
    try:
        print(sglang_to_vllm(a.src, a.dst))
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
