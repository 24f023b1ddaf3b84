"""In-process (``engine=hf``) evaluation as a backend: the target and the export loaded
here, both decodings of every prompt (:func:`eagle3.evaluate.inprocess.decode.evaluate_hf`),
resumable per benchmark (:mod:`eagle3.evaluate.inprocess.resume`), data-parallel over
``workers`` processes (:mod:`eagle3.evaluate.inprocess.parallel`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from eagle3.errors import Eagle3Error
from eagle3.evaluate.base import Backend, StageInputs
from eagle3.evaluate.benchmarks import benchmark_names, load_benchmarks, prompt_settings
from eagle3.evaluate.inprocess.decode import evaluate_hf
from eagle3.evaluate.inprocess.parallel import run_evaluate_parallel
from eagle3.evaluate.inprocess.records import SAMPLES_FILE, overall_summary, write_samples
from eagle3.evaluate.inprocess.resume import benchmark_keys, load_finished, save_partial
from eagle3.export.provenance import check_drafter_fits, check_export, feature_dtype_warning
from eagle3.spec import build_decoder

log = logging.getLogger("eagle3")


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


class InProcessBackend(Backend):
    """``engine=hf``: the target and the drafter loaded here, both decodings of every prompt
    (``workers > 1``: :func:`eagle3.evaluate.inprocess.parallel.run_evaluate_parallel`)."""

    name = "hf"

    def run(self, inputs: StageInputs) -> dict:
        """The in-process evaluation (:func:`evaluate_in_process`, or the parallel workers'
        merged results when ``workers > 1`` and this is not a worker)."""
        cfg = self.cfg
        if int(cfg.workers) > 1 and cfg.worker is None:
            return run_evaluate_parallel(cfg, inputs.settings)
        return evaluate_in_process(cfg, inputs)


def evaluate_in_process(cfg, inputs: StageInputs) -> dict:
    """``engine=hf``: both decodings of every prompt here (one worker's share when
    ``cfg.worker`` is set) with the export at ``inputs.drafter_dir``, resuming finished
    benchmarks; writes ``samples.jsonl``; returns the report's results dict.

    Raises:
        Eagle3Error: benchmark problems, and as :func:`_load_in_process`.
    """
    from eagle3.target import end_of_turn_ids, render_prompt

    settings, drafter_dir, manifest = inputs.settings, inputs.drafter_dir, inputs.manifest
    warnings = list(inputs.warnings)
    names = benchmark_names(cfg.data)
    output_dir = inputs.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    left_out: dict = {}
    benchmarks = load_benchmarks(cfg, names, manifest, left_out)  # a bad prompt file stops here, before the load
    t = _load_in_process(cfg, drafter_dir, inputs.meta, manifest, warnings)
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
