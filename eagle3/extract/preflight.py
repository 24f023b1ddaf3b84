"""The extract stage's cheap checks: settings, the token and disk estimate against free space, a slow-CPU warning.

They run before the hf engine loads the target and before anything is written, so a
misconfiguration fails in seconds. The disk estimate counts, per conversation, the
rendered user/system turns plus one reply of ``sampling.max_new_tokens`` per user turn
(the original replies when not regenerating), capped at ``capture.max_length``, at
:func:`eagle3.features.bytes_per_token` bytes each.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from eagle3 import features
from eagle3.cli import output_dir_problem
from eagle3.errors import Eagle3Error
from eagle3.extract.regenerate import _plan_turns, keep_turns
from eagle3.extract.summary import _human_bytes
from eagle3.target import render_prompt

log = logging.getLogger("eagle3")

DISK_MARGIN = 1.10  # refuse unless free space >= 110% of the estimate


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the file system holding ``path`` (its nearest existing parent)."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def check_output_dir(out_dir: Path) -> None:
    """Refuse an ``output_dir`` that is an existing file, or lies under one, before the target loads.

    Raises:
        Eagle3Error: naming the file and saying to pass a folder path.
    """
    problem = output_dir_problem(out_dir)
    if problem:
        raise Eagle3Error(problem)


def _check_settings(cfg) -> None:
    """Refuse capture and sampling settings out of range (Eagle3Error naming the setting)."""
    cap, smp = cfg.capture, cfg.sampling
    if cap.top_k < 1:
        raise Eagle3Error(f"capture.top_k={cap.top_k} must be at least 1")
    if cap.max_length < 2:
        raise Eagle3Error(f"capture.max_length={cap.max_length} must be at least 2")
    if smp.max_new_tokens < 1:
        raise Eagle3Error(f"sampling.max_new_tokens={smp.max_new_tokens} must be at least 1")
    if smp.temperature < 0 or not 0 < smp.top_p <= 1:
        raise Eagle3Error("sampling.temperature must be >= 0 and sampling.top_p in (0, 1]")
    if cap.max_turns is not None and cap.max_turns < 1:
        raise Eagle3Error(f"capture.max_turns={cap.max_turns} must be at least 1 (or null for all turns)")
    if cap.shard_size_mb <= 0:
        raise Eagle3Error(f"capture.shard_size_mb={cap.shard_size_mb} must be positive")
    mode = getattr(getattr(cfg, "features", None), "mode", features.FEATURES_OFFLINE)
    if mode not in (features.FEATURES_OFFLINE, features.FEATURES_NONE):
        raise Eagle3Error(f"features={mode}: extract.py writes features=offline (the features store) or features=none "
                          "(the kept replies alone, for train.py features=online)")
    if cap.aux_dtype not in features.AUX_DTYPES:
        raise Eagle3Error(f"capture.aux_dtype={cap.aux_dtype} must be one of {', '.join(features.AUX_DTYPES)}")


def feature_mode(cfg) -> str:
    """What this extraction stores: ``offline`` (features) or ``none`` (the kept replies alone)."""
    return str(getattr(getattr(cfg, "features", None), "mode", features.FEATURES_OFFLINE))


def _estimate_tokens(tokenizer, rows: list[list[dict]], cfg) -> tuple[list[int], int]:
    """Per conversation: rendered user/system turns + one reply of max_new_tokens per user
    turn (or the original replies when not regenerating), capped at max_length; and the
    number of conversations whose first prompt alone reaches max_length."""
    est, too_long = [], 0
    max_length = int(cfg.capture.max_length)
    for msgs in rows:
        system, users = _plan_turns(msgs, cfg.capture.max_turns)
        too_long += len(render_prompt(tokenizer, system + users[:1])) >= max_length
        if cfg.capture.regenerate:
            n = len(render_prompt(tokenizer, system + users)) + len(users) * int(cfg.sampling.max_new_tokens)
        else:
            n = len(render_prompt(tokenizer, keep_turns(msgs, cfg.capture.max_turns)))
        est.append(min(n, max_length))
    return est, too_long


def preflight(cfg, tokenizer, target, ids: list[str], messages: list[list[dict]], data_stats: dict,
              out_dir: Path, manifest_name: str) -> int:
    """Check that the selected prompts can give samples and fit on disk; return samples per shard.

    Logs the plan (prompts, estimated bytes, shard size) and then warns when bf16 will be
    emulated on this CPU (:func:`_warn_slow_cpu_bf16`).

    Args:
        ids, messages: the selected conversations, in plan order.
        data_stats: the prompt counts of :func:`eagle3.prompts.load_conversations` (logged).
        manifest_name: the manifest of this process (a worker's part manifest, or
            ``manifest.json``); when it exists, its shard size is kept and the samples of
            its written shards are not counted again.

    Returns:
        Samples per shard: enough to fill ``capture.shard_size_mb`` with the estimated
        tokens per sample, or the stored value when resuming.

    Raises:
        Eagle3Error: every first prompt alone reaches ``capture.max_length``, or the
            estimated bytes (times :data:`DISK_MARGIN`) exceed the free space.
    """
    max_length, top_k = int(cfg.capture.max_length), int(cfg.capture.top_k)
    est, too_long = _estimate_tokens(tokenizer, messages, cfg)
    if too_long == len(est):
        raise Eagle3Error(
            f"the first prompt of every selected conversation ({too_long}) alone reaches "
            f"capture.max_length={max_length}, so nothing is trainable; raise capture.max_length or use shorter prompts"
        )
    stored = feature_mode(cfg)
    per_shard = features.samples_per_shard(cfg.capture.shard_size_mb, target.hidden_size, top_k, sum(est) / len(est),
                                           cfg.capture.aux_dtype, stored)
    done_ids: set[str] = set()
    if (out_dir / manifest_name).exists():
        old = features.load_manifest(out_dir, require_complete=False, name=manifest_name)
        per_shard = int(old.get("samples_per_shard", per_shard))
        for sh in old.get("shards", []):
            done_ids.update(p[0] for p in old["plan"][sh["index"] * per_shard:(sh["index"] + 1) * per_shard])
    need = features.estimate_bytes(sum(n for i, n in zip(ids, est) if i not in done_ids), target.hidden_size, top_k,
                                   cfg.capture.aux_dtype, stored)
    free = free_disk_bytes(out_dir)
    if need * DISK_MARGIN > free:
        raise Eagle3Error(
            f"extracting {len(ids)} prompts needs about {_human_bytes(need)} in {out_dir} but only "
            f"{_human_bytes(free)} is free; free space, pass output_dir= on a larger disk, or lower "
            "data.limit / capture.max_length"
        )
    log.info("extract: %d prompts (%s), about %s on disk, %d samples per shard", len(ids), data_stats, _human_bytes(need), per_shard)
    _warn_slow_cpu_bf16(cfg)
    return per_shard


def _warn_slow_cpu_bf16(cfg) -> None:
    """Say so when the hf engine will compute bf16 on a CPU without native bf16 (slow)."""
    from eagle3.devices import cpu_has_native_bf16, resolve_device

    if getattr(cfg.engine, "name", None) != "hf" or str(cfg.model.dtype) not in ("bfloat16", "bf16"):
        return
    if resolve_device(str(cfg.engine.device)).type == "cpu" and cpu_has_native_bf16() is False:
        log.warning(
            "the target computes in bfloat16 on a CPU without native bf16 (no avx512_bf16/amx_bf16), where bf16 "
            "matmuls are emulated and can be several times slower than float32 (measure: benchmarks/"
            "extract_throughput.py --dtype float32). For a CPU run use experiment=extract-cpu (float32) and pass "
            "model.dtype=float32 to train.py and evaluate.py"
        )
