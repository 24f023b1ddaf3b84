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
   (:func:`eagle3.evaluate.inprocess.evaluate_hf`; ``workers > 1``:
   :func:`eagle3.evaluate.parallel.run_evaluate_parallel`).
   ``engine=sglang``: :func:`eagle3.evaluate.served.run_sglang_evaluation`.
4. Writes the report (:func:`eagle3.evaluate.report.write_report`) and per-turn records
   (``samples.jsonl``) under ``output_dir`` (default ``data/eval/<model>``; the Hydra
   job folder in a multirun). Each finished benchmark is kept in
   ``output_dir/partial/<name>.json``; the same command run again (e.g. after a time
   limit stopped it) reuses finished benchmarks whose settings, target, export and
   prompt ids are unchanged (:mod:`eagle3.evaluate.resume`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from eagle3.errors import Eagle3Error
from eagle3.evaluate.benchmarks import benchmark_names, load_benchmarks, prompt_settings
from eagle3.evaluate.inprocess import evaluate_hf
from eagle3.evaluate.parallel import run_evaluate_parallel
from eagle3.export.provenance import (
    check_aux_ids,
    check_drafter_fits,
    check_export,
    feature_dtype_warning,
    load_train_manifest,
    read_export,
)
from eagle3.evaluate.records import SAMPLES_FILE, overall_summary, write_samples
from eagle3.evaluate.report import write_report
from eagle3.evaluate.resume import benchmark_keys, load_finished, save_partial
from eagle3.paths import stage_output_dir
from eagle3.spec import SpecSettings, build_decoder

log = logging.getLogger("eagle3")


def run_evaluate(cfg) -> dict:
    """The evaluate stage (see the module docstring). Returns the report's results dict.

    Raises:
        Eagle3Error: ``engine.url`` / ``engine.urls`` with ``engine=sglang``, no export or a
            damaged one, aux layer ids that disagree between config.json, eagle3_meta.json
            and the training features, a chat-template mismatch, a drafter that does not
            fit the target (vocabulary/hidden size/aux layers), bad speculative settings,
            or benchmark problems (unknown name, overlap with training, missing MT-Bench file).
    """
    if cfg.mode != "evaluate":  # evaluate.py sends mode=doctor to eagle3.doctor.run before this
        raise Eagle3Error(f"mode '{cfg.mode}' is unknown; use mode=evaluate or mode=doctor")
    settings, note = SpecSettings.make(
        cfg.speculative.num_steps, cfg.speculative.topk, cfg.speculative.num_draft_tokens,
        cfg.temperature, cfg.top_p, cfg.max_new_tokens,
    )
    warnings = [note] if note else []
    engine = getattr(cfg.engine, "name", "hf")
    if engine == "sglang":
        from eagle3.evaluate.servers import check_served_urls

        check_served_urls(cfg.engine)  # before any file is read or written
    if engine == "vllm":
        from eagle3.evaluate.served_vllm import run_vllm_stage  # its own export (export/vllm), its own server

        return run_vllm_stage(cfg, settings, warnings)
    from eagle3.export import export_dir

    drafter_dir = export_dir(cfg.drafter_dir, engine)  # <run>/export/sglang (hf, sglang)
    export = read_export(drafter_dir)  # a damaged export stops here, before any work
    meta = export.meta
    manifest, w = load_train_manifest(meta, getattr(cfg, "train_features_dir", None))
    warnings += w + check_aux_ids(export, manifest, cfg.model.architecture)
    if engine == "hf" and int(cfg.workers) > 1 and cfg.worker is None:
        return run_evaluate_parallel(cfg, settings)
    names = benchmark_names(cfg.data)
    output_dir = stage_output_dir(cfg)
    output_dir.mkdir(parents=True, exist_ok=True)
    if engine == "sglang":
        results = _evaluate_served(cfg, drafter_dir, meta, names, manifest, output_dir, warnings)
    elif engine == "hf":
        results = _evaluate_in_process(cfg, settings, drafter_dir, meta, names, manifest, output_dir, warnings)
    else:
        raise Eagle3Error(f"engine '{engine}' cannot evaluate; use engine=hf, engine=sglang or engine=vllm")
    write_report(output_dir, results)
    return results


def _evaluate_served(cfg, drafter_dir: Path, meta: dict, names: list[str], manifest: Optional[dict],
                     output_dir: Path, warnings: list[str]) -> dict:
    """``engine=sglang``: check the export (at ``drafter_dir``, the resolved export folder)
    against the target, then measure the servers."""
    from eagle3.target import chat_template_hash
    from eagle3.target import load_tokenizer, resolve_target

    info = resolve_target(cfg.model, cfg.cache_dir)
    warnings = warnings + check_export(meta, info, chat_template_hash(load_tokenizer(cfg.model, cfg.cache_dir, info)))
    for x in warnings:
        log.warning(x)
    left_out: dict = {}
    benchmarks = load_benchmarks(cfg, names, manifest, left_out)
    from eagle3.evaluate.served import run_sglang_evaluation

    results = run_sglang_evaluation(cfg, benchmarks, meta, output_dir)
    results["warnings"] = warnings + list(results.get("warnings") or [])
    results.setdefault("settings", {}).update(drafter_dir=str(drafter_dir), target=cfg.model.name,
                                              trained_on_left_out=left_out, **prompt_settings(cfg.data))
    return results


@dataclass
class _Loaded:
    """The target and the drafter as the in-process evaluation runs them."""

    model: Any
    tokenizer: Any
    info: Any  # eagle3.target.TargetInfo
    device: torch.device
    drafter: Any  # eagle3.model.drafter.Eagle3Drafter
    aux: list[int]


def _load_in_process(cfg, drafter_dir: Path, meta: dict, manifest: Optional[dict], warnings: list[str]) -> _Loaded:
    """Load the target and the export; append provenance warnings to ``warnings``.

    Args:
        cfg: the ``EvaluateConfig``.
        drafter_dir: the SGLang export folder (:func:`eagle3.export.export_dir` of ``cfg.drafter_dir``).
        meta: the export's ``eagle3_meta.json`` (:func:`read_export_meta`).
        manifest: the training manifest (:func:`load_train_manifest`), or None.
        warnings: the stage's warnings so far (extended in place).

    Raises:
        Eagle3Error: as :func:`eagle3.export.provenance.check_export` and
            :func:`eagle3.export.provenance.check_drafter_fits`.
    """
    from eagle3.devices import resolve_device
    from eagle3.export import load_sglang_export
    from eagle3.target import chat_template_hash, load_target

    device = resolve_device(cfg.engine.device)
    model, tokenizer, info = load_target(cfg.model, cfg.cache_dir, device=str(device),
                                         attn_implementation=cfg.engine.attn_implementation)
    warnings += check_export(meta, info, chat_template_hash(tokenizer))
    w = feature_dtype_warning(manifest, cfg.model.dtype)
    if w:
        warnings.append(w)
    drafter, meta = load_sglang_export(drafter_dir, embed_tokens=model.get_input_embeddings().weight, device=device)
    from eagle3.spec.compiled import compile_decoder_layers, wants_compile

    # auto = on for one process: batch-1 decoding measured 1.41x (plain) and 1.24x (speculative)
    # faster compiled; off for parallel workers sharing a GPU (their tok/s are not batch-1 figures,
    # and each would spend about 50 s compiling)
    alone = int(getattr(cfg, "workers", 1) or 1) == 1
    from eagle3.gqa import fold_drafter_attention, use_gqa_sdpa, wants_fold

    if wants_fold(getattr(cfg.engine, "gqa_fold", None), device.type, cfg.engine.attn_implementation):
        use_gqa_sdpa(model)  # before compiling: the folded attention is traced into the layers
        fold_drafter_attention(drafter)
    if wants_compile(getattr(cfg.engine, "compile_layers", None), device.type, default=alone):
        compile_decoder_layers(model)  # the baseline and the verify pass alike
        compile_decoder_layers(drafter)
    aux = check_drafter_fits(drafter.arch, meta, info, drafter_dir)
    return _Loaded(model, tokenizer, info, device, drafter, aux)


def decode_cache(engine_cfg) -> Optional[bool]:
    """``engine.decode_cache`` as :func:`eagle3.spec.build_decoder`'s ``static`` (None = auto).

    Raises:
        Eagle3Error: a value other than auto, dynamic or static.
    """
    v = str(getattr(engine_cfg, "decode_cache", "auto") or "auto")
    if v not in ("auto", "dynamic", "static"):
        raise Eagle3Error(f"engine.decode_cache={v!r}: use auto, dynamic or static")
    return None if v == "auto" else v == "static"


def _evaluate_in_process(cfg, settings: SpecSettings, drafter_dir: Path, meta: dict, names: list[str],
                         manifest: Optional[dict], output_dir: Path, warnings: list[str]) -> dict:
    """``engine=hf``: both decodings of every prompt here (one worker's share when
    ``cfg.worker`` is set) with the export at ``drafter_dir``, resuming finished benchmarks;
    writes ``samples.jsonl``."""
    from eagle3.target import end_of_turn_ids, render_prompt

    warnings = list(warnings)
    left_out: dict = {}
    benchmarks = load_benchmarks(cfg, names, manifest, left_out)  # a bad prompt file stops here, before the load
    t = _load_in_process(cfg, drafter_dir, meta, manifest, warnings)
    for x in warnings:
        log.warning(x)
    if cfg.worker is not None:  # one worker of run_evaluate_parallel: every workers-th prompt
        benchmarks = {n: ds.select(range(int(cfg.worker), len(ds), int(cfg.workers))) for n, ds in benchmarks.items()}
        benchmarks = {n: ds for n, ds in benchmarks.items() if len(ds)}
    decoder = build_decoder(t.model, t.drafter, t.aux, settings, end_of_turn_ids(t.tokenizer),
                            max_prompt_tokens=cfg.max_prompt_tokens, static=decode_cache(cfg.engine),
                            cuda_graphs=bool(getattr(cfg.engine, "cuda_graphs", True)))
    if settings.max_new_tokens + settings.num_draft_tokens + cfg.max_prompt_tokens > (t.info.max_position_embeddings or 10**9):
        warnings.append(
            f"max_prompt_tokens + max_new_tokens exceed the target's {t.info.max_position_embeddings} positions"
        )

    def render(msgs):
        """Messages -> prompt ids (the target's chat template, generation prompt added)."""
        return render_prompt(t.tokenizer, msgs)

    def decode(ids):
        """Generated ids -> text without special tokens (the next turn's assistant message)."""
        return t.tokenizer.decode(ids, skip_special_tokens=True)

    keys = benchmark_keys(cfg, settings, t.info.content_hash, str(t.model.dtype), t.device.type,
                          drafter_dir, benchmarks)
    done = load_finished(output_dir, keys)
    per_bench, records, w = evaluate_hf(
        {n: ds for n, ds in benchmarks.items()}, decoder, render, decode, settings,
        warmup_prompts=cfg.warmup_prompts, max_prompt_tokens=cfg.max_prompt_tokens, seed=cfg.seed,
        done=done, on_done=lambda n, r, ww: save_partial(output_dir, n, keys[n], r, ww),
        teacher_forced=bool(cfg.teacher_forced),
    )
    warnings += w
    decoder.runner.close()
    write_samples(output_dir / SAMPLES_FILE, records, decode)
    return {
        "engine": "hf",
        "benchmarks": per_bench,
        "overall": overall_summary(records, settings),
        "speculative": {"num_steps": settings.num_steps, "topk": settings.topk,
                        "num_draft_tokens": settings.num_draft_tokens},
        "sampling": {"temperature": settings.temperature, "top_p": settings.top_p,
                     "max_new_tokens": settings.max_new_tokens},
        "settings": {**_in_process_settings(cfg, t, sorted(done), drafter_dir), "decoding": decoding_path(decoder),
                     "trained_on_left_out": left_out},
        "warnings": warnings,
    }


def decoding_path(decoder) -> str:
    """How the in-process decodings ran: ``static KV caches + CUDA graphs``, ``static KV caches``
    or ``dynamic KV caches``, with `` + compiled layers`` when the target's layers are compiled
    (``engine.compile_layers``) and `` + folded GQA attention`` when it attends so
    (``engine.gqa_fold``; the report's ``settings.decoding``)."""
    from eagle3.gqa import GQA_SDPA, GQA_SDPA_OUTSIDE_COMPILE
    from eagle3.spec import StaticTargetRunner
    from eagle3.spec.compiled import layers_compiled

    tail = " + compiled layers" if layers_compiled(decoder.runner.model) else ""
    if getattr(decoder.runner.model.config, "_attn_implementation", None) in (GQA_SDPA, GQA_SDPA_OUTSIDE_COMPILE):
        tail += " + folded GQA attention"
    if not isinstance(decoder.runner, StaticTargetRunner):
        return "dynamic KV caches" + tail
    return ("static KV caches + CUDA graphs" if decoder.runner.cuda_graphs else "static KV caches") + tail


def _in_process_settings(cfg, t: _Loaded, resumed: list[str], drafter_dir: Path) -> dict:
    """The report's ``settings`` of an in-process run (what was measured, and how;
    ``drafter_dir``: the export folder read)."""
    return {
        "target": t.info.name, "target_content_hash": t.info.content_hash, "quantization": t.info.quantization,
        "dtype": str(next(t.model.parameters()).dtype).replace("torch.", ""), "device": str(t.device),
        "attn_implementation": cfg.engine.attn_implementation, "drafter_dir": str(drafter_dir),
        "drafter_dtype": str(t.drafter.fc.weight.dtype).replace("torch.", ""),
        "aux_layer_ids": list(t.aux), "draft_vocab_size": t.drafter.arch.draft_vocab_size,
        "limit": cfg.data.limit, "warmup_prompts": cfg.warmup_prompts, "seed": cfg.seed,
        "batch_size": 1, "torch_threads": torch.get_num_threads(),
        "resumed_benchmarks": resumed, **prompt_settings(cfg.data),
    }
