"""The extract stage: regenerate responses with the served target, capture its features.

Order of work (cheap checks first, so a misconfiguration fails in seconds):

1. validate settings; resolve the target (a hub-only target costs nothing here; a
   package target is built once into ``cache_dir``) and validate its aux layer ids;
2. a remote engine (``sglang``) connects to / launches its server now, and says what
   is missing when it cannot;
3. load the tokenizer and the prompts, split them (deterministic by sample id), apply
   ``data.offset`` and ``data.limit``; when more than one turn is regenerated, order them
   by turn count (:func:`turn_order`: windows of alike conversations keep batches full);
4. preflight: estimated bytes against free disk; then the ``hf`` engine loads the model;
5. per window of shards: regenerate every assistant turn in order, batched across
   conversations (system prompt kept, user turns as given), keeping the ids the target
   was given and generated (loss mask on the generated ids, :mod:`eagle3.extract.regenerate`);
   without regeneration render each conversation with the chat template once (loss mask
   from token offsets, :mod:`eagle3.target.chat`); truncate at ``capture.max_length``;
   capture; write each shard atomically.

A run started again with the same settings resumes: written shards are kept (their
checksums are verified) and the rest are extracted. Shards are grouped into fixed
*windows* by index (enough conversations to fill the engine's generation batches); a
window is generated as a whole and its replies are recorded before its shards are
captured, so a resumed run reuses them (it regenerates only conversations of windows
no earlier run generated) and gives the same tensors (:mod:`eagle3.extract.shards`).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Optional

from eagle3 import features
from eagle3.engines import build_engine
from eagle3.errors import Eagle3Error
from eagle3.extract.metadata import _metadata
from eagle3.extract.order import bucket_by_turns, turn_order
from eagle3.extract.parallel import run_parallel
from eagle3.extract.preflight import _check_settings, check_output_dir, preflight
from eagle3.extract.shards import extract_windows, plan_windows
from eagle3.extract.summary import STATS_FILE, _summary, format_summary, stats_part_name
from eagle3.io import read_json, write_json_atomic
from eagle3.paths import stage_output_dir
from eagle3.prompts import load_conversations, select_for_extraction
from eagle3.target import load_tokenizer, resolve_target


@dataclasses.dataclass
class _Prompts:
    """The selected conversations: ids and messages in plan order, the plan, every split's ids, counts."""

    ids: list[str]
    messages: list[list[dict]]
    plan: list[tuple[str, str]]  # (sample_id, split) in extraction order
    messages_by_id: dict[str, list[dict]]
    splits: dict[str, list[str]]  # sample ids of each split (train/validation/test) of the whole dataset
    data_stats: dict


def _select_prompts(cfg) -> _Prompts:
    """Load ``cfg.data``, split it, keep ``data.splits`` from ``data.offset`` up to ``data.limit``.

    Raises:
        Eagle3Error: no prompt selected, or as :func:`eagle3.prompts.load_conversations`.
    """
    data_stats: dict = {}
    ds = load_conversations(cfg.data, data_stats)
    sel = select_for_extraction(ds, cfg.data.splits, cfg.data.limit, cfg.data.offset)
    if len(sel) == 0:
        if len(ds) == 0:
            raise Eagle3Error(f"data={cfg.data.name} (source {cfg.data.source}) holds no conversation; give prompts that "
                              "have a user turn")
        per_split = ", ".join(f"{s} {ds['split'].count(s)}" for s in ("train", "validation", "test"))
        if int(cfg.data.offset) > 0:
            raise Eagle3Error(f"data.offset={cfg.data.offset} skips every conversation of data={cfg.data.name} in "
                              f"data.splits {list(cfg.data.splits)} (by split: {per_split}); lower data.offset")
        raise Eagle3Error(f"none of the {len(ds)} conversations of data={cfg.data.name} is in data.splits "
                          f"{list(cfg.data.splits)} (by split: {per_split}); change data.splits or "
                          "data.validation_fraction / data.test_fraction")
    ids, msgs_list, split_list = list(sel["id"]), list(sel["messages"]), list(sel["split"])
    if bucket_by_turns(cfg.capture):
        order = turn_order(msgs_list, cfg.capture.max_turns)
        ids, msgs_list, split_list = [ids[i] for i in order], [msgs_list[i] for i in order], [split_list[i] for i in order]
    messages_by_id = dict(zip(ids, msgs_list))
    plan = list(zip(ids, split_list))
    splits = {s: [i for i, sp in zip(ds["id"], ds["split"]) if sp == s] for s in ("train", "validation", "test")}
    return _Prompts(ids, msgs_list, plan, messages_by_id, splits, data_stats)


def _part(cfg) -> Optional[tuple[int, int]]:
    """``(worker, workers)`` when ``cfg`` runs one worker of a data-parallel extraction, else None."""
    par = getattr(cfg, "parallel", None)
    workers = int(par.workers) if par is not None else 1
    return (int(par.worker), workers) if workers > 1 else None


def run_extract(cfg) -> dict:
    """Run the extract stage for the typed :class:`eagle3.config.ExtractConfig`.

    Returns:
        The summary (also printed and stored in the manifest): samples, tokens, masked
        tokens, truncated, dropped (with reasons), generated tokens, bytes, bytes per
        token, wall time and tokens/s of this run, output folder. A worker of a
        data-parallel run returns only its ``this_run`` counts.

    Raises:
        Eagle3Error: any user-fixable problem (bad settings, an output_dir that is a
            file, unknown source, missing server/tokenizer, layer ids out of range, too
            little disk, a folder holding another extraction or a damaged manifest);
            nothing is written before the preflight passes.
    """
    t_start = time.time()
    _check_settings(cfg)
    out_dir = stage_output_dir(cfg)
    check_output_dir(out_dir)
    par = getattr(cfg, "parallel", None)
    if par is not None and int(par.workers) > 1 and par.worker is None:
        return run_parallel(cfg)  # the orchestrator: spawns the workers, then merges their parts
    part = _part(cfg)
    manifest_name = features.MANIFEST if part is None else features.part_manifest_name(*part)
    cache_dir = Path(cfg.cache_dir)

    # 1. prompts: a bad data setting is said before the target is built (minutes on first use)
    prompts = _select_prompts(cfg)

    # 2-3. target; a remote engine is reached now (a missing server fails before the preflight),
    # the in-process one is loaded after the data checks (its load is the expensive step)
    target = resolve_target(cfg.model, cache_dir)
    remote = getattr(cfg.engine, "name", None) != "hf"
    engine = build_engine(cfg.model, cfg.engine, cache_dir, out_dir) if remote else None
    try:
        tokenizer = load_tokenizer(cfg.model, cache_dir, target)

        # 4. preflight
        per_shard = preflight(cfg, tokenizer, target, prompts.ids, prompts.messages, prompts.data_stats,
                              out_dir, manifest_name)

        # 5. extraction
        if engine is None:
            engine = build_engine(cfg.model, cfg.engine, cache_dir, out_dir)
        metadata = _metadata(cfg, target, engine, tokenizer)
        writer = features.FeatureWriter.open(out_dir, metadata, prompts.plan, per_shard, splits=prompts.splits, part=part)
        windows = plan_windows(writer, prompts.plan, cfg.engine, per_shard, part)
        side_path = out_dir / (STATS_FILE if part is None else stats_part_name(*part))
        side = read_json(side_path, {}) if len(windows.pending) < len(windows.chunks) else {}
        run_stats, wall = extract_windows(cfg, engine, tokenizer, writer, windows, prompts.messages_by_id,
                                          side, side_path, part)
    finally:
        if engine is not None:
            engine.close()

    this_run = {
        **run_stats,
        "wall_time_s": wall,
        "total_time_s": time.time() - t_start,
        "tokens_per_s": run_stats["tokens"] / wall if wall > 0 else 0.0,
        "resumed_shards": len(windows.mine) - len(windows.pending),
    }
    if part is not None:  # a worker: its counts go to the orchestrator, which merges and summarises
        side["_run"] = {"this_run": this_run, "data_stats": prompts.data_stats}
        write_json_atomic(side_path, side)
        return this_run
    summary = _summary(cfg, target, writer.manifest, side, len(prompts.plan), prompts.data_stats, this_run, out_dir)
    writer.finalize(summary)
    print(format_summary(summary))
    return summary
