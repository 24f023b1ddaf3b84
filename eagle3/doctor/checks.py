"""The doctor's checks of an export's own files: the schema (``config.json`` and the weights
against the target) and the draft vocabulary map (``d2t`` / ``t2d``).

Every check returns one row, ``{name, status, detail, fix}`` with ``status`` one of
``pass`` | ``fail`` | ``warn`` | ``skip`` (:func:`row`). The checks themselves are the
export reader's (:class:`eagle3.export.validate.ExportFiles`, its files read one by one; the
checks of :mod:`eagle3.export.schema`) and the evaluate stage's
(:func:`eagle3.export.provenance.check_drafter_fits`), called piece by piece so that
each fault lands in its own row; an :class:`~eagle3.errors.Eagle3Error` they raise
becomes a failed row whose fix is the sentence's last clause.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from eagle3.errors import Eagle3Error
from eagle3.export.schema import CONFIG_FILE
from eagle3.export.validate import ExportFiles  # noqa: F401  (what the checks after the schema read)

STATUSES = ("pass", "fail", "warn", "skip")
REEXPORT = "re-export the drafter from its training run (train.py writes export/sglang and export/vllm)"


def row(name: str, status: str, detail: str, fix: str = "") -> dict:
    """One checklist row.

    Args:
        name: the check (``export schema``, ``d2t``, ``aux layer ids``, ...).
        status: ``pass`` | ``fail`` | ``warn`` | ``skip``.
        detail: what was found, one sentence.
        fix: one line saying what to change (empty on ``pass``).

    Raises:
        ValueError: an unknown status (a programming error).
    """
    if status not in STATUSES:
        raise ValueError(f"unknown status {status!r}")
    return {"name": name, "status": status, "detail": detail, "fix": fix}


def split_fix(message: str) -> tuple[str, str]:
    """An :class:`Eagle3Error` sentence ``"<what>; <fix>"`` -> ``(what, fix)`` (the project's
    error convention: one sentence ending in what to change)."""
    what, sep, fix = message.rpartition("; ")
    return (what, fix) if sep else (message, "")


def failed(name: str, err: Eagle3Error, fix: Optional[str] = None) -> dict:
    """A failed row from an error (its own fix clause unless ``fix`` is given)."""
    what, own = split_fix(str(err))
    return row(name, "fail", what, fix or own or REEXPORT)


def _target_ties(info) -> Optional[bool]:
    """The target's own ``tie_word_embeddings`` (its local ``config.json``), None when unknown."""
    path = Path(info.path) / CONFIG_FILE if getattr(info, "path", None) else None
    try:
        return bool(json.loads(path.read_text()).get("tie_word_embeddings", False)) if path else None
    except (OSError, ValueError):
        return None


def tie_row(config: dict, info) -> dict:
    """``tie_word_embeddings`` of the drafter's ``config.json``.

    SGLang's ``LlamaForCausalLMEagle3`` (``python/sglang/srt/models/llama_eagle3.py``) makes
    ``lm_head`` the embedding table when the config says ``tie_word_embeddings: true``; the
    drafter's trained ``[Vd, H]`` head is then ignored. A config built from a tied target
    (SmolLM2 ties) inherits ``true``. Absent, SGLang's ``LlamaConfig`` default (false) applies.
    """
    tied = _target_ties(info)
    origin = " (the target ties its embeddings, so a config copied from it inherits true)" if tied else ""
    v = config.get("tie_word_embeddings")
    if v is True:
        return row("tie_word_embeddings", "fail",
                   f"{CONFIG_FILE} sets tie_word_embeddings: true{origin}: a server would replace the trained "
                   "lm_head with the embedding table", 'set "tie_word_embeddings": false in config.json')
    if v is None:
        return row("tie_word_embeddings", "warn", f"{CONFIG_FILE} does not set tie_word_embeddings{origin}; "
                   "servers fall back to their config class's default", 'set "tie_word_embeddings": false in config.json')
    return row("tie_word_embeddings", "pass", "false: the trained lm_head is used")


def _header_for_weights(header: dict, arch) -> dict:
    """The header with a stand-in ``d2t`` when the file has none: its absence is the d2t check's row."""
    from eagle3.export.schema import drafter_name

    if any(drafter_name(k) == "d2t" for k in header):
        return header
    return {**header, "d2t": ([arch.draft_vocab_size], "I64")}


def check_schema(export_dir: Path, info) -> tuple[list[dict], ExportFiles]:
    """The export's files: ``config.json`` (``LlamaForCausalLMEagle3``, the required sizes),
    every tensor of ``model.safetensors`` present, consumed and of the shape the config
    implies, the sizes matching the target (vocabulary, hidden size), ``tie_word_embeddings``.

    Args:
        export_dir: the export folder (:func:`eagle3.export.export_dir` of ``drafter_dir``).
        info: the served target's :class:`eagle3.target.TargetInfo`, or None when it could not
            be resolved (the target-fit part is skipped).

    Returns:
        ``(rows, files)``: the ``export schema`` and ``tie_word_embeddings`` rows, and what was read.
    """
    from eagle3.export.provenance import check_drafter_fits
    from eagle3.export.schema import check_weights

    d = Path(export_dir)
    files = ExportFiles(d)
    name = "export schema"
    gone = files.missing()
    if gone:
        return [row(name, "fail", f"{d} has no {gone}", "set drafter_dir=<train output_dir>/export/sglang "
                    "(or export/vllm), or run train.py")], files
    try:
        files.read_config()
        files.read_meta()
        files.read_arch()
    except Eagle3Error as e:
        fix = ('set "architectures": ["LlamaForCausalLMEagle3"] in config.json (the class SGLang and vLLM '
               "load EAGLE-3 drafters with)") if "declares" in str(e) else None
        return [failed(name, e, fix)], files
    try:
        files.read_header()
    except Eagle3Error as e:
        return [failed(name, e, "copy the export again or re-export the drafter"), tie_row(files.config, info)], files
    try:
        files.keys = check_weights(files.weights_path, _header_for_weights(files.header, files.arch), files.arch)
        files.keys = {n: k for n, k in files.keys.items() if k in files.header}
        if info is not None:  # the aux ids are the aux row's: a stand-in keeps this to vocabulary and hidden size
            check_drafter_fits(files.arch, {"aux_layer_ids": [-1]}, info, d)
    except Eagle3Error as e:
        return [failed(name, e), tie_row(files.config, info)], files
    a = files.arch
    fit = f", matching {info.name}" if info is not None else " (target not resolved: its sizes are not compared)"
    detail = (f"LlamaForCausalLMEagle3, hidden {a.hidden_size}, target hidden {a.target_hidden_size}, vocabulary "
              f"{a.vocab_size}, draft vocabulary {a.draft_vocab_size}; {len(files.keys)} tensors, all consumed{fit}")
    rows = [row(name, "pass", detail), tie_row(files.config, info)]
    return rows, files


def check_d2t(files: ExportFiles) -> dict:
    """The draft vocabulary map: ``d2t`` present, offsets rather than ids
    (``target_id = i + d2t[i]``, SGLang's and vLLM's convention), in range, no target id
    twice, agreeing with the stored ``t2d`` (:func:`eagle3.export.check_vocab_maps`).

    Returns:
        The ``d2t`` row (``skip`` when the schema check could not read the sizes or weights).
    """
    from eagle3.export.schema import check_vocab_maps

    name = "d2t"
    if files.arch is None or files.header is None:
        return row(name, "skip", "needs a readable config.json and model.safetensors (see export schema)")
    path = files.weights_path
    if "d2t" not in files.keys:
        return row(name, "fail", f"{path} has no d2t (the draft -> target id offsets): a server would map draft id i "
                   "to target id i", "re-export the drafter from its training run (train.py writes d2t)")
    d2t, t2d = files.read_vocab()
    try:
        mask = check_vocab_maps(d2t, t2d, files.arch.vocab_size, path)
    except Eagle3Error as e:
        return failed(name, e)
    ids = mask.nonzero().flatten()
    return row(name, "pass", f"{d2t.numel()} offsets map the draft vocabulary onto distinct target ids "
               f"{int(ids.min())}..{int(ids.max())}" + (", t2d agrees" if t2d is not None else " (no t2d stored)"))


def check_loads(files: ExportFiles) -> Optional[dict]:
    """The export reader's own full check (:func:`eagle3.export.read_sglang_export`, in the
    convention the export declares: whether that suits the serving engine is the aux row's),
    as a catch-all after the piecewise rows passed: a failed row, or None when it reads."""
    from eagle3.export.files import export_convention
    from eagle3.export.validate import read_sglang_export

    try:
        read_sglang_export(files.dir, convention=export_convention(files.meta))
    except Eagle3Error as e:
        return failed("export reads back", e)
    return None
