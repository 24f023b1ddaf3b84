"""The extraction loop: pending shards in generation windows, each regenerated, then captured shard by shard.

Shards are grouped into fixed *windows* by index (enough conversations to fill the
engine's generation batches); a window is generated as a whole (its batches and seed
are those of an uninterrupted run), and its replies are recorded in
``replies/window-NNNNN.json`` (:data:`REPLIES_DIR`) before its first shard is
captured. A resumed run takes the recorded replies of a window whose inputs and
settings are unchanged, so it regenerates nothing that an earlier run generated: only
the pending shards are captured again, and they come out byte-identical to an
uninterrupted run's. A window without a valid record is regenerated as a whole. A worker
of a data-parallel run takes every ``workers``-th window. In a shard, each regenerated
conversation is the ids the target was given and generated, with the loss mask on the
generated ids (:mod:`eagle3.extract.regenerate`); a conversation whose replies are
kept (``capture.regenerate=false``) is rendered with the chat template (loss mask from
token offsets, :func:`eagle3.target.render_conversation`). Each is truncated at
``capture.max_length``, captured by the engine and written atomically; the counts that the manifest does not keep (truncations,
generated tokens) are written to the side file of :mod:`eagle3.extract.summary` first,
so a kept shard always has its counts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from eagle3 import features
from eagle3.extract.regenerate import generated_mask, keep_turns, regenerate
from eagle3.io import read_json, write_json_atomic
from eagle3.target import render_conversation

log = logging.getLogger("eagle3")

REPLIES_DIR = "replies"  # <output_dir>/replies/window-NNNNN.json: the regenerated conversations of a window
Plan = list[tuple[str, str]]  # (sample_id, split) in extraction order
Part = Optional[tuple[int, int]]  # (worker, workers) of a data-parallel run; None in a one-process run


def _generation_width(engine_cfg) -> int:
    """How many conversations one generation window should hold (fills the engine's batches)."""
    for key in ("generate_batch_size", "concurrency"):
        v = getattr(engine_cfg, key, None)
        if v:
            return 4 * int(v)
    from eagle3.devices import resolve_device
    from eagle3.engines.hf.engine import DEFAULT_BATCH

    dev = resolve_device(getattr(engine_cfg, "device", "auto")).type
    return 4 * DEFAULT_BATCH["cuda" if dev == "cuda" else "cpu"]["generate_batch_size"]


@dataclasses.dataclass
class Windows:
    """The shards this process extracts, grouped into generation windows.

    Attributes:
        width: shards per window.
        chunks: the planned samples of every shard, by shard index.
        pending: ``(shard index, its samples)`` still to extract here, in index order.
        by_window: window index -> its pending shard indices.
        mine: every shard index this process extracts, now or in an earlier run.
    """

    width: int
    chunks: list[Plan]
    pending: list[tuple[int, Plan]]
    by_window: dict[int, list[int]]
    mine: list[int]


def plan_windows(writer: features.FeatureWriter, plan: Plan, engine_cfg, per_shard: int, part: Part) -> Windows:
    """The windows of ``plan`` (cut into shards of the writer's size) and which are still pending here.

    A window holds enough shards of ``per_shard`` samples to fill the engine's generation
    batches (:func:`_generation_width`); worker ``w`` of ``N`` (``part``) owns the windows
    ``w, w+N, ...``; a shard the writer lists as written is not pending.
    """
    width = max(1, math.ceil(_generation_width(engine_cfg) / per_shard))  # shards per window
    # a worker of a data-parallel run takes every workers-th generation window (whole windows,
    # so each is generated with the same batch and seed as in a one-process run)
    pending = [(i, c) for i, c in writer.pending() if part is None or (i // width) % part[1] == part[0]]
    by_window: dict[int, list[int]] = {}
    for index, _ in pending:
        by_window.setdefault(index // width, []).append(index)
    n_shard = int(writer.manifest["samples_per_shard"])
    chunks = [plan[i : i + n_shard] for i in range(0, len(plan), n_shard)]
    mine = [i for i in range(len(chunks)) if part is None or (i // width) % part[1] == part[0]]
    if part is None:  # a record half-written by a killed run (the orchestrator cleans them for workers)
        for stale in (writer.out_dir / REPLIES_DIR).glob("*.tmp"):
            stale.unlink()
    return Windows(width, chunks, pending, by_window, mine)


@dataclasses.dataclass
class _Replies:
    """The conversations of one window as they are captured.

    Attributes:
        messages: the final messages by sample id (regenerated replies, or the original ones).
        sequences: by sample id, the target's ids and the spans of its replies
            (:func:`eagle3.extract.regenerate.regenerate`); None when the replies are kept.
        too_long: samples whose first prompt alone reaches ``capture.max_length`` (dropped).
        cut: samples stopped before their last user turn (counted as truncated).
        generated_by_id: generated tokens per sample.
    """

    messages: dict[str, list[dict]]
    sequences: Optional[dict[str, dict]]
    too_long: set[str]
    cut: set[str]
    generated_by_id: dict[str, int]


def _regenerate_window(cfg, engine, tokenizer, convs: list[tuple[str, list[dict]]], window: int, bar) -> _Replies:
    """The conversations of window ``window`` with their replies (seed ``sampling.seed + window``)."""
    if cfg.capture.regenerate:
        final, seqs, gstats = regenerate(engine, tokenizer, convs, cfg.sampling, int(cfg.capture.max_length),
                                   seed=cfg.sampling.seed + window, max_turns=cfg.capture.max_turns,
                                   on_turn=lambda r, n: bar.set_postfix_str(f"generating turn {r + 1} of {n} conversations"))
        return _Replies(final, seqs, set(gstats["too_long"]), set(gstats["cut"]), gstats["generated_by_id"])
    final = {sid: keep_turns(m, cfg.capture.max_turns) for sid, m in convs}
    return _Replies(final, None, set(), set(), {})


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _window_replies(cfg, engine, tokenizer, writer: features.FeatureWriter, convs: list[tuple[str, list[dict]]],
                    window: int, bar) -> tuple[_Replies, bool]:
    """The replies of window ``window``: recorded by an earlier run, or regenerated now and recorded.

    The record (``<output_dir>/replies/window-NNNNN.json``) holds a key over the
    manifest's metadata, the window index and the window's conversations, and a sha256
    of the replies; one whose key or checksum does not match is not used and the window
    is regenerated as a whole (:func:`_regenerate_window`). Without regeneration
    (``capture.regenerate=false``) nothing is recorded.

    Returns:
        ``(replies, reused)``: ``reused`` is True when they come from the record.
    """
    if not cfg.capture.regenerate:
        return _regenerate_window(cfg, engine, tokenizer, convs, window, bar), False
    path = writer.out_dir / REPLIES_DIR / f"window-{window:05d}.json"
    key = _digest({"metadata": writer.manifest["metadata"], "window": window, "conversations": convs})
    record = read_json(path, None)
    if isinstance(record, dict) and record.get("key") == key:
        got = record.get("replies")
        if isinstance(got, dict) and _digest(got) == record.get("sha256") and isinstance(got.get("sequences"), dict):
            return _Replies(got["messages"], got["sequences"], set(got["too_long"]), set(got["cut"]),
                            got["generated_by_id"]), True
        log.warning("%s fails its sha256 check; window %d is generated again", path, window)
    replies = _regenerate_window(cfg, engine, tokenizer, convs, window, bar)
    got = {"messages": replies.messages, "sequences": replies.sequences, "too_long": sorted(replies.too_long),
           "cut": sorted(replies.cut), "generated_by_id": replies.generated_by_id}
    path.parent.mkdir(exist_ok=True)
    write_json_atomic(path, {"key": key, "sha256": _digest(got), "replies": got})  # before the window's shards
    return replies, False


def _render_shard(tokenizer, chunk: Plan, replies: _Replies, max_length: int):
    """Render the samples of one shard: ``(records [(id, split, input_ids, loss_mask)], dropped, truncated)``.

    ``input_ids`` and ``loss_mask`` are int lists of at most ``max_length`` tokens: the
    target's own ids with the mask on its generated ids when the replies were
    regenerated, else the template's rendering with the mask on assistant tokens
    (:func:`eagle3.target.render_conversation`);
    ``dropped`` maps a sample id to why it was not captured; ``truncated`` lists the
    samples cut at ``max_length`` or stopped before their last turn.
    """
    records_in, dropped, truncated = [], {}, []
    for sid, split in chunk:
        if sid in replies.too_long:
            dropped[sid] = f"the first prompt alone reaches capture.max_length={max_length}"
            continue
        if replies.sequences is not None:
            seq = replies.sequences[sid]
            input_ids = list(seq["input_ids"])
            mask = generated_mask(len(input_ids), seq["generated"])
        else:
            input_ids, mask = render_conversation(tokenizer, replies.messages[sid])
        if len(input_ids) > max_length or sid in replies.cut:
            truncated.append(sid)
        input_ids, mask = input_ids[:max_length], mask[:max_length]
        if sum(mask) == 0:
            dropped[sid] = f"no assistant token within capture.max_length={max_length}"
            continue
        records_in.append((sid, split, input_ids, mask))
    return records_in, dropped, truncated


def _capture_shard(engine, writer: features.FeatureWriter, index: int, chunk: Plan, rendered, replies: _Replies,
                   top_k: int, side: dict, side_path: Path) -> dict[str, int]:
    """Capture the rendered samples of shard ``index``, write its side counts and then the shard.

    Each record stores ``input_ids [T]`` int32, ``loss_mask [T]`` uint8 and the engine's
    capture (``aux_hidden_states [T, 3, H]`` bf16, ``topk_ids`` / ``topk_logprobs [T, k]``), or
    no capture in a replies-only folder (``features=none``);
    the side counts are written first, so a kept shard always has its counts.

    Returns:
        This shard's counts: samples, tokens, masked_tokens, generated_tokens,
        truncated, dropped.

    Raises:
        Eagle3Error: a capture of the wrong shape, or as :meth:`FeatureWriter.write_shard`.
    """
    records_in, dropped, truncated = rendered
    if features.stored_features(writer.manifest["metadata"]) == features.FEATURES_NONE:
        caps = [None] * len(records_in)  # the kept replies alone: training captures them (features=online)
    else:
        caps = engine.capture([r[2] for r in records_in], top_k) if records_in else []
    records = [
        features.Record(sid, split, torch.tensor(ii, dtype=torch.int32), torch.tensor(mm, dtype=torch.uint8), cap)
        for (sid, split, ii, mm), cap in zip(records_in, caps)
    ]
    kept = {r[0] for r in records_in}
    side[str(index)] = {
        "truncated": [i for i in truncated if i in kept],
        "generated_tokens": sum(replies.generated_by_id.get(sid, 0) for sid, _ in chunk),
    }
    write_json_atomic(side_path, side)  # before the shard: a kept shard always has its stats
    writer.write_shard(index, records, dropped)
    return {
        "samples": len(records),
        "tokens": sum(len(r[2]) for r in records_in),
        "masked_tokens": sum(sum(r[3]) for r in records_in),
        "generated_tokens": side[str(index)]["generated_tokens"],
        "truncated": len(side[str(index)]["truncated"]),
        "dropped": len(dropped),
    }


def extract_windows(cfg, engine, tokenizer, writer: features.FeatureWriter, windows: Windows,
                    messages_by_id: dict[str, list[dict]], side: dict, side_path: Path,
                    part: Part) -> tuple[dict[str, int], float]:
    """Extract every pending shard of ``windows``, window by window, with a progress bar.

    Args:
        side: the per-shard side counts so far (updated and rewritten to ``side_path``
            before each shard is written).

    Returns:
        ``(counts of this run, wall time in seconds)``; the counts are samples, tokens,
        masked_tokens, generated_tokens (generated by this run; 0 for a window whose
        recorded replies were reused), truncated and dropped.

    Raises:
        Eagle3Error: as the engine's ``generate`` / ``capture`` or the writer raise it; the
            shards written before are kept (a run of the same command resumes).
    """
    max_length, top_k = int(cfg.capture.max_length), int(cfg.capture.top_k)
    chunks, width = windows.chunks, windows.width
    run_stats = {"samples": 0, "tokens": 0, "masked_tokens": 0, "generated_tokens": 0, "truncated": 0, "dropped": 0}
    t_run = time.time()
    bar = tqdm(total=sum(len(c) for _, c in windows.pending), desc="extract" if part is None else f"extract[{part[0]}]",
               unit="sample", file=sys.stderr, mininterval=5.0, position=part[0] if part else None)
    for w, shard_indices in sorted(windows.by_window.items()):
        window_shards = list(range(w * width, min((w + 1) * width, len(chunks))))
        convs = [(sid, messages_by_id[sid]) for s in window_shards for sid, _ in chunks[s]]
        replies, reused = _window_replies(cfg, engine, tokenizer, writer, convs, w, bar)
        for index in shard_indices:
            rendered = _render_shard(tokenizer, chunks[index], replies, max_length)
            counts = _capture_shard(engine, writer, index, chunks[index], rendered, replies, top_k, side, side_path)
            if reused:  # generated by an earlier run
                counts["generated_tokens"] = 0
            for k, v in counts.items():
                run_stats[k] += v
            bar.update(len(chunks[index]))
            elapsed = max(time.time() - t_run, 1e-9)
            bar.set_postfix(tok_s=f"{run_stats['tokens'] / elapsed:.0f}", tokens=run_stats["tokens"])
    bar.close()
    return run_stats, time.time() - t_run
