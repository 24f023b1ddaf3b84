"""``python evaluate.py mode=doctor``: the doctor's checklist, probe and exit code.

:func:`run_doctor` resolves the served target (``model=``), then checks the export of
``drafter_dir`` for the serving engine (:func:`eagle3.export.export_dir`: a training run's
folder gives its ``export/sglang`` or ``export/vllm``; an export folder is checked as given)
row by row (:mod:`eagle3.doctor.checks`: schema, ``tie_word_embeddings``, ``d2t``;
:mod:`eagle3.doctor.aux_ids`: the aux layer ids under the serving engine's rule;
:mod:`eagle3.doctor.provenance`: chat template, target build and quantization, compute
dtype), runs the acceptance probe when ``doctor.probe`` (:mod:`eagle3.doctor.probe`),
prints the table, writes ``<output_dir>/doctor.json`` and exits 1 when a row failed.
"""

from __future__ import annotations

from typing import Optional

from eagle3.doctor.aux_ids import check_aux, serving_engine
from eagle3.doctor.checks import check_d2t, check_loads, check_schema, failed, row
from eagle3.doctor.probe import probe_rows
from eagle3.doctor.provenance import provenance_rows
from eagle3.doctor.report import exit_code, format_table, write_doctor_json
from eagle3.errors import Eagle3Error
from eagle3.export.validate import ExportFiles


def _target(cfg) -> tuple[dict, object, object, Optional[str]]:
    """``(row, TargetInfo or None, tokenizer or None, chat template hash or None)`` of ``model=``."""
    from eagle3.target import chat_template_hash, load_tokenizer, resolve_target

    try:
        info = resolve_target(cfg.model, cfg.cache_dir)
    except Eagle3Error as e:
        return failed("target", e), None, None, None
    detail = (f"model={cfg.model.name}: {info.architecture}, {info.num_layers} layers, hidden {info.hidden_size}, "
              f"vocabulary {info.vocab_size}, quantization {(info.quantization or {}).get('method', 'none')}")
    try:
        tok = load_tokenizer(cfg.model, cfg.cache_dir, info)
    except Eagle3Error as e:
        r = failed("target", e)
        return row("target", "warn", f"{detail}; its tokenizer cannot be loaded: {r['detail']}", r["fix"]), info, None, None
    return row("target", "pass", detail), info, tok, chat_template_hash(tok)


def _probe_aux_ids(files: ExportFiles, rows: list[dict], engine: str, architecture: str,
                   num_layers: Optional[int]) -> Optional[list[int]]:
    """The HF layers the serving engine captures for the export's ids, or None when the export
    cannot be loaded (schema, d2t or read-back failed) or they leave the target."""
    broken = {"export schema", "d2t", "export reads back", "target"}
    if any(r["status"] == "fail" and r["name"] in broken for r in rows):
        return None
    try:
        ids = files.captured_aux_ids(engine, architecture)
    except (Eagle3Error, TypeError):
        return None
    return ids if num_layers is None or all(1 <= i <= num_layers for i in ids) else None


def diagnose(cfg) -> tuple[list[dict], dict]:
    """Every row of the checklist and the probe, without printing or exiting.

    Returns:
        ``(rows, doc)``: ``doc`` is what ``doctor.json`` holds.

    Raises:
        Eagle3Error: ``doctor.serving_engine`` (or ``engine.name``) has no aux-id convention, or
            ``drafter_dir`` is neither a training run's folder nor an export folder
            (:func:`eagle3.export.export_dir`).
    """
    from eagle3.export.provenance import load_train_manifest
    from eagle3.export import export_dir

    engine = serving_engine(cfg)
    drafter_dir = export_dir(cfg.drafter_dir, engine)  # the export the serving engine would read
    target_row, info, tokenizer, template_hash = _target(cfg)
    rows = [target_row]
    schema, files = check_schema(drafter_dir, info)
    rows += schema
    rows.append(check_d2t(files))
    if all(r["status"] != "fail" for r in rows[1:]):
        rows += [r for r in [check_loads(files)] if r]
    manifest, notes = load_train_manifest(files.meta, getattr(cfg, "train_features_dir", None)) if files.meta else (None, [])
    architecture = info.architecture if info else cfg.model.architecture
    num_layers = info.num_layers if info else None
    rows.append(check_aux(files, manifest, architecture, num_layers, engine))
    rows += provenance_rows(files.meta, info, template_hash, manifest, cfg.model.name, cfg.model.dtype)
    results: dict = {}
    if cfg.doctor.probe:
        aux = _probe_aux_ids(files, rows, engine, architecture, num_layers)
        vd = files.arch.draft_vocab_size if files.arch is not None else None
        probe, results = probe_rows(cfg, drafter_dir, rows, aux, tokenizer, vd)
        rows += probe
    doc = {"drafter_dir": str(drafter_dir), "target": cfg.model.name, "engine": getattr(cfg.engine, "name", "hf"),
           "serving_engine": engine, "ok": exit_code(rows) == 0, "rows": rows, "probe": results, "notes": notes}
    return rows, doc


def run_doctor(cfg) -> dict:
    """``mode=doctor``: print the checklist, write ``doctor.json`` under ``output_dir`` and
    exit 1 when a check failed (a config problem raises :class:`Eagle3Error`: exit 2 through
    :func:`eagle3.cli.run_stage`).

    Returns:
        ``doctor.json``'s dict, when every check passed (or only warned).

    Raises:
        SystemExit: code 1 when any row failed.
        Eagle3Error: as :func:`diagnose`.
    """
    from eagle3.paths import stage_output_dir

    rows, doc = diagnose(cfg)
    path = write_doctor_json(stage_output_dir(cfg), doc)
    context = [f"target: model={cfg.model.name}",
               f"serving engine: {doc['serving_engine']} (its aux-id rule is checked; engine={doc['engine']})",
               f"report: {path}"]
    print(format_table(rows, f"eagle3 doctor: {doc['drafter_dir']}", context), flush=True)
    if exit_code(rows):
        raise SystemExit(1)
    return doc
