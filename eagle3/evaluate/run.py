"""The evaluate stage: real speculative decoding against the configured target.

``run_evaluate(cfg)``:

1. Checks the drafter export's files before any work (``drafter_dir``, a training run's
   folder, default ``data/drafters/<model>/sharegpt``, whose ``export/sglang`` the hf and
   sglang engines read, or an export folder: :func:`eagle3.export.export_dir`;
   :func:`eagle3.export.provenance.read_export`: JSON, sizes, tensor shapes, ``d2t``
   offsets), checks that its aux layer ids agree between ``config.json``,
   ``eagle3_meta.json`` and the training features
   (:func:`eagle3.export.provenance.check_aux_ids`), opens it the way a server does
   (:func:`eagle3.export.load_sglang_export`) and
   compares its ``eagle3_meta.json`` with the configured target: a different content
   hash or quantization gives a loud warning (a drafter trained on BF16 features
   meeting an INT4 deployment accepts little); a different chat template is refused
   (:mod:`eagle3.export.provenance`).
2. Loads the benchmarks (:func:`eagle3.evaluate.benchmarks.load_benchmarks`): gsm8k,
   humaneval, held-out sharegpt (refused if its ids overlap the training manifest),
   mtbench when ``data.mtbench_path`` is set; or, with ``data=jsonl data.path=FILE`` (or
   ``sharegpt_json``, ``mtbench``, ...), that source alone; ``data.limit`` prompts each.
   Every engine evaluates the same prompts.
3. ``engine=hf``: for every prompt (every user turn of multi-turn prompts, the history
   carrying the speculative answer), speculative decoding
   (:class:`eagle3.spec.decoder.SpeculativeDecoder`) and the target's own decoding
   (the baseline, same prefill and KV cache code) on the same rendered prompt, both
   timed with device synchronisation at batch 1 after ``warmup_prompts`` untimed
   prompts. At temperature 0 the two token sequences must be equal (lossless check)
   (:func:`eagle3.evaluate.inprocess.decode.evaluate_hf`; ``workers > 1``:
   :func:`eagle3.evaluate.inprocess.parallel.run_evaluate_parallel`).
   ``engine=sglang``: :func:`eagle3.evaluate.sglang.evaluation.run_sglang_evaluation`;
   ``engine=vllm``: :func:`eagle3.evaluate.vllm.evaluation.evaluate_servers` on the export's
   ``export/vllm`` folder. Each engine is a backend (:mod:`eagle3.evaluate.base`) chosen
   by :func:`eagle3.evaluate.build_backend`; this stage drives them all the same way.
   ``mode=schedule`` (``engine=vllm``): the served concurrency sweep that derives and checks
   speculative tokens per batch size (:mod:`eagle3.evaluate.vllm.schedule`), reported by
   :mod:`eagle3.evaluate.schedule_report` instead of the steps below.
4. Writes the report (:func:`eagle3.evaluate.report.write_report`) and per-turn records
   (``samples.jsonl``) under ``output_dir`` (default ``data/eval/<model>``; the Hydra
   job folder in a multirun). Each finished benchmark is kept in
   ``output_dir/partial/<name>.json``; the same command run again (e.g. after a time
   limit stopped it) reuses finished benchmarks whose settings, target, export and
   prompt ids are unchanged (:mod:`eagle3.evaluate.inprocess.resume`).
"""

from __future__ import annotations

import logging

from eagle3.errors import Eagle3Error
from eagle3.evaluate import build_backend
from eagle3.evaluate.base import StageInputs
from eagle3.evaluate.report import write_report
from eagle3.export import export_dir
from eagle3.export.provenance import check_aux_ids, load_train_manifest
from eagle3.paths import stage_output_dir
from eagle3.spec import SpecSettings

log = logging.getLogger("eagle3")


def run_evaluate(cfg) -> dict:
    """The evaluate stage (see the module docstring). Returns the report's results dict.

    Raises:
        Eagle3Error: ``engine.url`` / ``engine.urls`` with a served engine, no export or a
            damaged one, aux layer ids that disagree between config.json, eagle3_meta.json
            and the training features, a chat-template mismatch, a drafter that does not
            fit the target (vocabulary/hidden size/aux layers), bad speculative settings,
            or benchmark problems (unknown name, overlap with training, missing MT-Bench file).
    """
    if cfg.mode not in ("evaluate", "schedule"):  # evaluate.py sends mode=doctor to eagle3.doctor.run before this
        raise Eagle3Error(f"mode '{cfg.mode}' is unknown; use mode=evaluate, mode=schedule or mode=doctor")
    settings, note = SpecSettings.make(
        cfg.speculative.num_steps, cfg.speculative.topk, cfg.speculative.num_draft_tokens,
        cfg.temperature, cfg.top_p, cfg.max_new_tokens,
    )
    warnings = [note] if note else []
    with build_backend(cfg) as backend:
        warnings += backend.check(settings)  # before any file is read or written
        inputs = read_inputs(cfg, backend, settings, warnings)
        if cfg.mode == "schedule":  # its own report: eagle3.evaluate.schedule_report
            from eagle3.evaluate.schedule_report import write_schedule_report

            results = backend.run_schedule(inputs)
            write_schedule_report(inputs.output_dir, results, str(inputs.drafter_dir))
            return results
        results = backend.run(inputs)
    write_report(inputs.output_dir, results)
    return results


def read_inputs(cfg, backend, settings: SpecSettings, warnings: list[str]) -> StageInputs:
    """The export folder the backend serves (:func:`eagle3.export.export_dir` of
    ``cfg.drafter_dir``: ``export/sglang`` for hf and sglang, ``export/vllm`` for vllm),
    read by the backend (a damaged export stops here, before any work), the training
    manifest, and the aux ids checked against it (their warnings after ``warnings``).

    Raises:
        Eagle3Error: no export or a damaged one, aux layer ids that disagree between
            config.json, eagle3_meta.json and the training features.
    """
    drafter_dir = export_dir(cfg.drafter_dir, backend.export_engine)
    export = backend.read_export(drafter_dir)
    manifest, w = load_train_manifest(export.meta, getattr(cfg, "train_features_dir", None))
    warnings = warnings + w + check_aux_ids(export, manifest, cfg.model.architecture)
    return StageInputs(settings, export, drafter_dir, manifest, stage_output_dir(cfg), warnings)
