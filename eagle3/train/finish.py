"""The end of a training run: the last checkpoint, the final validation, the exports and ``metrics.json``.

:func:`finish` writes the checkpoint of the last step (unless it exists), validates once
more, exports the drafter for SGLang (``<output_dir>/export/sglang``) and vLLM
(``export/vllm``: the same weights, aux ids in vLLM's convention) and, where the
optional ``speculators`` package is installed, in that format (``export/speculators``), writes
``<output_dir>/metrics.json`` and records the job in a Hydra sweep's summary.
:func:`stop` is the end of a run stopped early: a checkpoint and nothing else.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import asdict
from typing import Any, Optional

import torch

from eagle3.errors import Eagle3Error
from eagle3.io import write_json_atomic
from eagle3.train.build import Run
from eagle3.train.checkpoint import checkpoint_name, latest_checkpoint, save_checkpoint
from eagle3.model.drafter import Eagle3Drafter
from eagle3.train.loop import Progress, run_train_metrics
from eagle3.train.validation import validate

log = logging.getLogger("eagle3")


def stop(run: Run) -> dict:
    """Checkpoint a run stopped by ``stop_after`` and close its trackers; no export, no metrics.

    Returns:
        ``{"interrupted": True, "step": optimizer steps done, "output_dir": str}``.
    """
    save_checkpoint(run.accelerator, run.output_dir, run.state.step)
    run.accelerator.end_training()
    return {"interrupted": True, "step": run.state.step, "output_dir": str(run.output_dir)}


def _refuse_mostly_skipped(run: Run, progress: Progress) -> None:
    """Stop before exporting when most samples trained on in this launch had non-finite features,
    or most optimizer steps of the run had non-finite gradients.

    The counts are summed over processes (the step counters are global), so every process
    raises or none does.

    Raises:
        Eagle3Error: more than half of the samples (all of them included) or of the steps were skipped.
    """
    counts = torch.tensor([progress.session_skipped, progress.session_samples], dtype=torch.int64,
                          device=run.accelerator.device)
    skipped, seen = (int(x) for x in run.accelerator.reduce(counts, reduction="sum"))
    if seen and 2 * skipped > seen:
        raise Eagle3Error(
            f"{skipped} of the {seen} training samples of this run had non-finite (NaN/inf) features and were "
            f"skipped, so the drafter is untrained and nothing was exported; re-extract the features in "
            f"{', '.join(map(str, run.dirs))} (their shards pass their checksums, so the values were written bad)"
        )
    state = run.state
    if state.step and 2 * state.skipped_steps > state.step:
        raise Eagle3Error(
            f"{state.skipped_steps} of the {state.step} optimizer steps of this run had non-finite gradients (a "
            "NaN/inf loss) and were skipped, so the drafter is barely trained and nothing was exported; lower "
            f"optim.lr, train in float32 (loop.mixed_precision=no) or look for extreme aux states in "
            f"{', '.join(map(str, run.dirs))}"
        )


def finish(run: Run, progress: Progress) -> dict:
    """Checkpoint, final validation, exports and ``metrics.json`` of a run that reached its last
    step, or stopped early by ``loop.time_limit_min`` (``metrics["time_limited"]``).

    Every process calls it (the checkpoint, the validation and an FSDP gather are
    collective); the main process exports and writes the files.

    Returns:
        The metrics (``metrics.json``; ``exports`` maps format to folder on the main process).
    """
    acc, state = run.accelerator, run.state
    _refuse_mostly_skipped(run, progress)
    latest = latest_checkpoint(run.output_dir)
    if latest is None or latest.name != checkpoint_name(state.step):
        save_checkpoint(acc, run.output_dir, state.step)
    last_val = progress.last_val
    if last_val is None or last_val.get("step") != state.step:
        # a run that stops mid-epoch (loop.max_steps, the time limit) last validated at an
        # earlier step; metrics.json must describe the weights it exports
        last_val = validate(run, state.step)
    if last_val is None:
        log.warning("the features hold no validation samples; metrics.json has no validation block")
    metrics = _metrics(run, progress, last_val)
    final = _final_drafter(run)
    if acc.is_main_process:
        metrics["exports"] = _export(run, final, _export_meta(run))
        write_json_atomic(run.output_dir / "metrics.json", metrics)
        _record_sweep_job(metrics)
    acc.wait_for_everyone()  # leave together: a process group torn down while a peer still exports can hang
    acc.end_training()
    if last_val is not None:
        log.info("validation: acc per step %s, simulated tau %.3f, serving-replay tau %s",
                 [round(a, 3) for a in last_val["step_acc"]], last_val["tau"],
                 "-" if last_val.get("replay_tau") is None else f"{last_val['replay_tau']:.3f}")
    return metrics


def _metrics(run: Run, progress: Progress, last_val: Optional[dict]) -> dict:
    """The content of ``metrics.json`` (exports aside): progress, validation, speed (tokens/s,
    seconds), memory (GiB), and the settings that shaped the run."""
    state, acc = run.state, run.accelerator
    return {
        "output_dir": str(run.output_dir),
        "step": state.step,
        "planned_steps": run.total_steps,
        # stopped by loop.time_limit_min before planned_steps (the schedule had not ended)
        "time_limited": progress.time_limited,
        "epoch": state.epoch,
        "train_tokens": state.tokens,
        # training samples drawn from (loop.train_fraction of the training split's)
        "train_samples": run.plan.num_samples,
        "train_split_samples": len(run.train_ds),
        # the last log interval's training metrics; an interval never spans a resume, so after
        # one they cover steps after launch_first_step only (validation covers the final drafter)
        "train": progress.last_train,
        "launch_first_step": progress.first_step,
        # the whole run's training metrics, resumes included (checkpointed sums)
        "train_run": run_train_metrics(run),
        "validation": last_val,
        "tokens_per_s": progress.session_tokens / progress.train_time if progress.train_time > 0 else None,
        "num_processes": acc.num_processes,
        "distributed_type": str(acc.distributed_type.value),
        "train_time_s": progress.train_time,
        "wall_time_s": time.perf_counter() - run.started,
        "skipped_nonfinite": state.skipped_nonfinite,
        "skipped_steps": state.skipped_steps,  # optimizer steps skipped for non-finite gradients, on every process
        "draft_vocab_coverage": run.coverage,
        "device": str(acc.device),
        "mixed_precision": run.mixed_precision,
        "drafter": asdict(run.arch),
        "max_tokens_per_batch": run.max_tokens,
        "ttt_steps": run.cfg.drafter.ttt_steps,
        # loop.compile_drafter: how many of the drafter's modules ran compiled (0 = eager)
        "compiled_modules": sum(getattr(m, "_compiled_call_impl", None) is not None
                                for m in acc.unwrap_model(run.model).drafter.modules()),
        "fused_loss": bool(acc.unwrap_model(run.model).fused_loss),  # loop.fused_loss as the run used it
        "features": _features_block(run, progress),
        **_peak_memory(),
    }


def _features_block(run: Run, progress: Progress) -> dict:
    """``metrics.json``'s ``features``: the mode, the folders' bytes a token on disk, and for
    ``features=online`` this launch's capture statistics (:class:`eagle3.train.online.OnlineStats`:
    the trainer's idle fraction, capture and trainer tokens/s) and the capture engine. A trainer
    idle more than 10% of its time is warned about with both rates."""
    nbytes = sum(sh["bytes"] for m in run.train_ds.manifests for sh in m["shards"])
    ntok = sum(sh["tokens"] for m in run.train_ds.manifests for sh in m["shards"])
    out: dict = {"mode": "online" if run.online is not None else "offline",
                 "disk_bytes_per_token": nbytes / ntok if ntok else None}
    if run.online is None:
        return out
    from eagle3.train.online import SLOW_PRODUCER_IDLE

    rep = run.online.stats.report(progress.train_time, progress.session_tokens)
    engine = run.online.engine
    out.update(rep, engine=engine.info() if engine is not None else None,
               cache_gb=float(run.cfg.features.cache_gb),
               cache_bytes=run.online.cache.bytes if run.online.cache is not None else 0)
    if rep["idle_fraction"] is not None and rep["idle_fraction"] > SLOW_PRODUCER_IDLE:
        log.warning("features=online: the trainer waited %.0f%% of its time for the capture engine (capture %.0f "
                    "tokens/s, trainer %.0f tokens/s when fed); give the engine more of the device (engine.*batch* "
                    "settings), more capture servers, or train with features.cache_gb for later epochs",
                    100 * rep["idle_fraction"], rep["capture_tokens_per_s"] or 0, rep["trainer_tokens_per_s"] or 0)
    return out


def _export_meta(run: Run) -> dict:
    """The provenance every export carries (``eagle3_meta.json``): the target as the features
    recorded it, the chat template hash, aux layer ids, features folders and manifest hashes."""
    target, dirs, record = run.target, run.dirs, run.record
    first = run.train_ds.manifests[0]
    return {
        "target": {
            "name": target.name,
            "source": getattr(target, "source", None),
            "path": getattr(target, "path", None),
            "content_hash": (first["metadata"].get("target") or {}).get("content_hash", target.content_hash),
            "quantization": (first["metadata"].get("target") or {}).get("quantization", target.quantization),
            "architecture": target.architecture,
            "build": (first["metadata"].get("target") or {}).get("build"),  # eagle3.target.build_record
        },
        "chat_template_hash": first["metadata"].get("chat_template_hash"),
        "aux_layer_ids": run.aux_ids,
        "features_dir": str(dirs[0]) if len(dirs) == 1 else [str(d) for d in dirs],
        "features_manifest_sha256": record["features"][0]["manifest_sha256"] if len(dirs) == 1
        else [f["manifest_sha256"] for f in record["features"]],
        "draft_vocab_size": run.arch.draft_vocab_size,
        "ttt_steps": run.cfg.drafter.ttt_steps,
        "train_step": run.state.step,
    }


def _final_drafter(run: Run) -> Eagle3Drafter:
    """The trained drafter; under FSDP a full copy gathered on the main process (every process calls)."""
    acc = run.accelerator
    final = acc.unwrap_model(run.model).drafter
    if acc.distributed_type.value == "FSDP":  # sharded parameters: gather a full copy (every process calls)
        full = acc.get_state_dict(run.model)
        if acc.is_main_process:
            final = Eagle3Drafter(run.arch)
            final.load_state_dict({k[len("drafter."):]: v for k, v in full.items() if k.startswith("drafter.")})
    return final


def _export(run: Run, final: Eagle3Drafter, meta: dict) -> dict[str, str]:
    """Write the exports ``export.*`` asks for; returns ``{format: folder}``."""
    exports: dict[str, str] = {}
    if run.cfg.export.sglang:
        from eagle3.export import export_sglang

        exports["sglang"] = str(export_sglang(final, run.output_dir / "export" / "sglang", meta))
    if getattr(run.cfg.export, "vllm", True):
        from eagle3.export import export_vllm

        exports["vllm"] = str(export_vllm(final, run.output_dir / "export" / "vllm", meta))
    if run.cfg.export.speculators:
        from eagle3.export import export_speculators, speculators_available

        if speculators_available():
            try:  # the SGLang and vLLM exports are written: a drafter this format cannot hold costs only this one
                exports["speculators"] = str(export_speculators(
                    final, run.output_dir / "export" / "speculators", meta, run.cfg.drafter.ttt_steps))
            except Eagle3Error as e:
                log.warning("export/speculators skipped: %s", e)
        else:
            log.info("speculators is not installed: skipping export/speculators (on a CPU machine install it with "
                     "pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 pydantic-settings python-dotenv "
                     "openai httpx2 sniffio; a plain install pulls a CUDA torch)")
    return exports


def _peak_memory() -> dict:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30, "peak_memory_kind": "cuda_max_allocated"}
    return {"peak_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "peak_memory_kind": "process_max_rss"}


def _record_sweep_job(metrics: dict) -> None:
    try:
        from eagle3.sweep.record import record_job_summary
    except ImportError:
        return
    val = metrics.get("validation") or {}
    summary: dict[str, Any] = {"tau": val.get("tau"), "replay_tau": val.get("replay_tau"), "val_loss": val.get("loss")}
    for j, a in enumerate(val.get("step_acc") or []):
        summary[f"acc_{j}"] = a
    summary["tokens_per_s"] = metrics.get("tokens_per_s")
    summary["peak_mem_gb"] = metrics.get("peak_memory_gb")
    record_job_summary(summary, metrics_path=os.path.join(metrics["output_dir"], "metrics.json"))
