"""The doctor's aux-layer check: does the engine that will serve the export capture the
layers the drafter's features were captured from?

Each engine reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` with its own rule
(:mod:`eagle3.target.layers`): SGLang adds 1 on Llama (on DeepSeek/Kimi only when the
first id is 1); vLLM takes the ids as given. So one ``config.json`` feeds the drafter
different layers under the two engines, and each engine needs its own export
(``export/sglang``, ``export/vllm``; ``eagle3_meta.json`` field ``aux_id_convention``,
absent = ``sglang``). The in-process engine (``engine=hf``) reads the SGLang export as
SGLang does.

The trained ids are the training features' (``metadata.aux_layer_ids`` of the manifest the
export meta names, :func:`eagle3.export.provenance.load_train_manifest`), else the
export meta's ``aux_layer_ids`` (HF ``output_hidden_states`` indices).
"""

from __future__ import annotations

from typing import Optional

from eagle3.doctor.checks import failed, row
from eagle3.errors import Eagle3Error
from eagle3.export.files import export_convention
from eagle3.export.validate import ExportFiles
from eagle3.target import ENGINES, engine_captured_ids, to_engine_ids

NAME = "aux layer ids"
IN_PROCESS_CONVENTION = "sglang"  # engine=hf loads export/sglang the way SGLang reads it (eagle3.export.load_sglang_export)


def serving_engine(cfg) -> str:
    """The engine whose aux-id rule applies: ``doctor.serving_engine``, else ``engine.name``
    (``hf`` -> ``sglang``, see the module docstring).

    Raises:
        Eagle3Error: an engine with no known convention.
    """
    name = getattr(cfg.doctor, "serving_engine", None) or getattr(cfg.engine, "name", "hf")
    name = IN_PROCESS_CONVENTION if name == "hf" else name
    if name not in ENGINES:
        raise Eagle3Error(f"doctor.serving_engine '{name}' has no known aux-id convention; use one of {list(ENGINES)}")
    return name


def trained_ids(meta: dict, manifest: Optional[dict]) -> tuple[Optional[list[int]], str]:
    """The HF ids the drafter was trained on and where they come from.

    Returns:
        ``(ids or None, source)``; ``source`` names the features folder or ``eagle3_meta.json``.
    """
    for f in (manifest or {}).get("features") or []:
        if f.get("aux_layer_ids") is not None:
            return [int(i) for i in f["aux_layer_ids"]], f"the training features in {f['dir']}"
    if meta.get("aux_layer_ids") is not None:
        return [int(i) for i in meta["aux_layer_ids"]], "eagle3_meta.json (the training features were not read)"
    return None, "nowhere"


def _ids_ok(ids) -> bool:
    return isinstance(ids, list) and len(ids) == 3 and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)


def check_aux(files: ExportFiles, manifest: Optional[dict], architecture: str, num_layers: Optional[int],
              engine: str) -> dict:
    """The ``aux layer ids`` row.

    Args:
        files: from :func:`eagle3.doctor.checks.check_schema`.
        manifest: from :func:`eagle3.export.provenance.load_train_manifest`, or None.
        architecture: the target family (``llama`` | ``deepseek_v2``).
        num_layers: the target's decoder layers (None: the range is not checked).
        engine: ``sglang`` | ``vllm`` (:func:`serving_engine`).

    Returns:
        ``fail`` when the ids are missing, leave the target's layers, or make ``engine``
        capture other layers than the trained ones (naming an export written for the other
        engine's convention as such); ``warn`` when they could only be checked against the
        export meta; else ``pass``.
    """
    written, meta = files.written_aux_ids, files.meta
    if files.config is None:
        return row(NAME, "skip", "needs a readable config.json (see export schema)")
    if not _ids_ok(written):
        return row(NAME, "fail", f"config.json field eagle_config.eagle_aux_hidden_state_layer_ids is {written!r}, "
                   "not 3 layer ids", "re-export the drafter from its training run")
    trained, source = trained_ids(meta, manifest)
    if trained is None:
        return row(NAME, "fail", "neither eagle3_meta.json nor a training manifest records the aux layer ids the "
                   "drafter was trained on", "re-export the drafter from its training run (it records them)")
    try:
        declared = export_convention(meta)
        captured = files.captured_aux_ids(engine, architecture)
        want = to_engine_ids(trained, engine, architecture)
    except Eagle3Error as e:
        return failed(NAME, e)
    out = [i for i in captured if num_layers is not None and not 1 <= i <= num_layers]
    if out:
        return row(NAME, "fail", f"config.json ids {written} make {engine} capture HF layers {captured}; {out} lie "
                   f"outside the target's {num_layers} layers", f"write the ids {want} ({engine}'s convention for "
                   f"the trained layers {trained}) or re-export the drafter")
    if captured != trained:
        return _mismatch(written, captured, trained, source, declared, engine, architecture, want)
    return _agreeing(files, manifest, architecture, engine, declared, written, trained, source)


def _mismatch(written, captured, trained, source, declared, engine, architecture, want) -> dict:
    """The failed row for ids that make ``engine`` capture other layers than the trained ones."""
    other = next(e for e in ENGINES if e != engine)
    other_captured = engine_captured_ids(list(written), other, architecture)
    if declared == other or other_captured == trained:
        why = f"eagle3_meta.json says aux_id_convention: {declared}" if declared == other else \
            f"under {other}'s rule they capture exactly the trained layers"
        return row(NAME, "fail",
                   f"this export is written for {other} ({why}): config.json ids {written} make {engine} capture "
                   f"HF layers {captured}, but the drafter was trained on {trained} ({source})",
                   f"serve export/{other} with {other}, or serve export/{engine} (ids {want}) with {engine}")
    return row(NAME, "fail",
               f"config.json ids {written} make {engine} capture HF layers {captured}, but the drafter was trained on "
               f"{trained} ({source}); the ids are shifted",
               f"set eagle_config.eagle_aux_hidden_state_layer_ids to {want} ({engine}'s convention) or re-export "
               "the drafter from its training run")


def _agreeing(files, manifest, architecture, engine, declared, written, trained, source) -> dict:
    """The ids capture the trained layers: the remaining consistency checks (the export meta
    against the features; for SGLang's convention :func:`eagle3.export.provenance.check_aux_ids`)."""
    from types import SimpleNamespace

    from eagle3.export.provenance import check_aux_ids

    meta = files.meta
    notes = []
    hf = meta.get("aux_layer_ids")
    if hf is not None and list(hf) != trained:
        return row(NAME, "fail", f"eagle3_meta.json records aux_layer_ids {list(hf)} but the drafter was trained on "
                   f"{trained} ({source})", "re-export the drafter from its training run")
    if declared != engine:
        notes.append(f"eagle3_meta.json says aux_id_convention: {declared}, but these ids capture the same layers "
                     f"under {engine}'s rule")
    if engine == "sglang" and meta:
        export = SimpleNamespace(meta=meta, dir=files.dir, sglang_aux_ids=list(written))
        try:
            notes += check_aux_ids(export, manifest, architecture)
        except Eagle3Error as e:
            return failed(NAME, e)
    elif not (manifest or {}).get("features"):
        notes.append(f"the ids could not be checked against the training features ({source})")
    detail = f"config.json ids {written} make {engine} capture HF layers {trained}, the layers of {source}"
    if notes:
        return row(NAME, "warn", detail + "; " + "; ".join(notes),
                   "keep the training features folder named in eagle3_meta.json so the ids can be checked")
    return row(NAME, "pass", detail)
