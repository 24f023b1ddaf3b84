"""The extract stage: regenerate responses with the served target, capture its features.

Order of work (cheap checks first, so a misconfiguration fails in seconds):

1. validate settings; resolve the target (a hub-only target costs nothing here; a
   package target is built once into ``cache_dir``) and validate its aux layer ids;
2. a remote engine (``sglang``) connects to / launches its server now, and says what
   is missing when it cannot;
3. load the tokenizer and the prompts, split them (deterministic by sample id), apply
   ``data.limit``;
4. preflight: estimated bytes against free disk; then the ``hf`` engine loads the model;
5. per window of shards: regenerate every assistant turn in order, batched across
   conversations (system prompt kept, user turns as given); render each conversation
   with the chat template once (loss mask from token offsets, :mod:`eagle3.target.chat`);
   truncate at ``capture.max_length``; capture; write each shard atomically.

A run started again with the same settings resumes: written shards are kept (their
checksums are verified) and the rest are extracted. Shards are grouped into fixed
*windows* by index (enough conversations to fill the engine's generation batches);
a window is always regenerated as a whole, so a resumed run batches every
conversation exactly as an uninterrupted one does and gives the same tensors.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm import tqdm

from eagle3.errors import Eagle3Error
from eagle3.io import read_json, write_json_atomic
from eagle3.paths import stage_output_dir

log = logging.getLogger("eagle3")

DISK_MARGIN = 1.10  # refuse unless free space >= 110% of the estimate
STATS_FILE = "extract_stats.json"  # per-shard counts the manifest does not keep (truncations, generated tokens)


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the file system holding ``path`` (its nearest existing parent)."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _versions() -> dict:
    import compressed_tensors
    import datasets
    import safetensors
    import torch
    import transformers

    import eagle3

    return {
        "eagle3": eagle3.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "compressed_tensors": compressed_tensors.__version__,
        "datasets": datasets.__version__,
        "safetensors": safetensors.__version__,
    }


def _check_settings(cfg) -> None:
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


# ------------------------------------------------------------------ regeneration
@dataclasses.dataclass
class _Conv:
    """A conversation being regenerated: its fixed turns and what has been generated."""

    sample_id: str
    prefix: list[dict]  # system messages + everything up to the next user turn
    users: list[dict]  # user turns still to answer
    done: bool = False
    cut: bool = False  # stopped early: the next prompt would not fit in max_length


def _plan_turns(messages: list[dict], max_turns: Optional[int] = None) -> tuple[list[dict], list[dict]]:
    """System message (kept) and the first ``max_turns`` user turns (each gets a regenerated reply)."""
    system = [dict(m) for m in messages if m["role"] == "system"][:1]
    users = [dict(m) for m in messages if m["role"] == "user"]
    return system, users if max_turns is None else users[: int(max_turns)]


def keep_turns(messages: list[dict], max_turns: Optional[int]) -> list[dict]:
    """``messages`` up to (not including) its ``max_turns + 1``-th user turn."""
    if max_turns is None:
        return list(messages)
    out, users = [], 0
    for m in messages:
        if m["role"] == "user":
            users += 1
            if users > max_turns:
                break
        out.append(m)
    return out


def regenerate(engine, tokenizer, conversations: list[tuple[str, list[dict]]], sampling, max_length: int, seed: int,
               max_turns: Optional[int] = None, on_turn=None) -> tuple[dict[str, list[dict]], dict[str, Any]]:
    """Regenerate every assistant turn with the target, turn by turn, batched across
    conversations.

    For each conversation the system message (if any) and the user turns are kept; the
    reply to user turn ``r`` is generated from the rendered conversation so far (with
    the target's own earlier replies). A conversation stops early when its next prompt
    would leave no room under ``max_length`` (later turns would be cut anyway), and
    each reply is capped so that prompt + reply fits in ``max_length``. ``on_turn(r, n)``
    is called before turn ``r`` is generated for ``n`` conversations (progress display).

    Returns:
        ``(messages by sample id, stats)``; a sample whose first prompt alone does not
        fit is absent from the messages (``stats["too_long"]`` lists it);
        ``stats["cut"]`` lists conversations stopped before their last user turn and
        ``stats["generated_by_id"]`` the generated tokens per sample.
    """
    from eagle3.target import render_prompt

    convs = []
    for sid, msgs in conversations:
        system, users = _plan_turns(msgs, max_turns)
        convs.append(_Conv(sid, system, users))
    stats: dict[str, Any] = {"generated_tokens": 0, "turns": 0, "too_long": [], "cut": [], "generated_by_id": {}}
    r = 0
    while True:
        active = [c for c in convs if not c.done and r < len(c.users)]
        if not active:
            break
        prompts, owners = [], []
        for c in active:
            msgs = c.prefix + [c.users[r]]
            ids = render_prompt(tokenizer, msgs)
            if len(ids) >= max_length:
                c.done = True
                if r == 0:
                    stats["too_long"].append(c.sample_id)
                else:
                    c.cut = True
                    stats["cut"].append(c.sample_id)
                continue
            prompts.append(ids)
            owners.append(c)
        if on_turn is not None:
            on_turn(r, len(prompts))
        # group by the room left under max_length so no reply is generated past it
        full = int(sampling.max_new_tokens)
        groups: dict[int, list[int]] = {}
        for j, ids in enumerate(prompts):
            room = min(full, max_length - len(ids))
            cap = full if room >= full else max(1, 1 << int(math.log2(room)))  # few distinct caps
            groups.setdefault(cap, []).append(j)
        replies: dict[int, list[int]] = {}
        for cap, js in sorted(groups.items(), reverse=True):
            smp = dataclasses.replace(sampling, max_new_tokens=cap, seed=seed * 1_000_003 + r * 101 + cap)
            outs = engine.generate([prompts[j] for j in js], smp)
            for j, out in zip(js, outs):
                replies[j] = out
        for j, c in enumerate(owners):
            out = replies[j]
            stats["generated_tokens"] += len(out)
            stats["generated_by_id"][c.sample_id] = stats["generated_by_id"].get(c.sample_id, 0) + len(out)
            stats["turns"] += 1
            text = tokenizer.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            c.prefix = c.prefix + [c.users[r], {"role": "assistant", "content": text}]
        r += 1
    result = {c.sample_id: c.prefix for c in convs if c.sample_id not in set(stats["too_long"])}
    return result, stats


# ------------------------------------------------------------------------ stage
def _metadata(cfg, target, engine, tokenizer) -> dict:
    from eagle3.target import chat_template_hash

    d = cfg.data
    return {
        "target": {
            "name": target.name,
            "source": target.source,
            "content_hash": target.content_hash,
            "architecture": target.architecture,
            "num_layers": target.num_layers,
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "quantization": target.quantization,
            "dtype": target.dtype,
        },
        "aux_layer_ids": list(target.aux_layer_ids),
        "aux_layer_convention": "hf_output_hidden_states",
        "chat_template_hash": chat_template_hash(tokenizer),
        "engine": engine.info(),
        "sampling": dataclasses.asdict(cfg.sampling) if dataclasses.is_dataclass(cfg.sampling) else dict(cfg.sampling),
        "regenerate": bool(cfg.capture.regenerate),
        "capture": {"top_k": int(cfg.capture.top_k), "max_length": int(cfg.capture.max_length),
                    "max_turns": cfg.capture.max_turns},
        "data": {
            "name": d.name,
            "source": d.source,
            "path": d.path,
            "seed": int(d.seed),
            "fractions": {"validation": float(d.validation_fraction), "test": float(d.test_fraction)},
            "splits": list(d.splits),
            "limit": d.limit,
        },
        "versions": _versions(),
    }


def _estimate_tokens(tokenizer, rows: list[list[dict]], cfg) -> tuple[list[int], int]:
    """Per conversation: rendered user/system turns + one reply of max_new_tokens per user
    turn (or the original replies when not regenerating), capped at max_length; and the
    number of conversations whose first prompt alone reaches max_length."""
    from eagle3.target import render_prompt

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


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def run_extract(cfg) -> dict:
    """Run the extract stage for the typed :class:`eagle3.config.ExtractConfig`.

    Returns:
        The summary (also printed and stored in the manifest): samples, tokens, masked
        tokens, truncated, dropped (with reasons), generated tokens, bytes, bytes per
        token, wall time and tokens/s of this run, output folder.

    Raises:
        Eagle3Error: any user-fixable problem (bad settings, unknown source, missing
            server/tokenizer, layer ids out of range, too little disk, a folder holding
            another extraction); nothing is written before the preflight passes.
    """
    from eagle3 import features
    from eagle3.target import render_conversation
    from eagle3.engines import build_engine
    from eagle3.target import load_tokenizer, resolve_target
    from eagle3.prompts import load_conversations, select_for_extraction

    t_start = time.time()
    _check_settings(cfg)
    par = getattr(cfg, "parallel", None)
    workers = int(par.workers) if par is not None else 1
    worker = par.worker if par is not None else None
    if workers > 1 and worker is None:
        return run_parallel(cfg)
    part = (int(worker), workers) if workers > 1 else None
    out_dir = stage_output_dir(cfg)
    manifest_name = features.MANIFEST if part is None else features.part_manifest_name(*part)
    cache_dir = Path(cfg.cache_dir)
    max_length, top_k = int(cfg.capture.max_length), int(cfg.capture.top_k)

    # 1-2. target; a remote engine is reached now (a missing server fails before any data work),
    # the in-process one is loaded after the data checks (its load is the expensive step)
    target = resolve_target(cfg.model, cache_dir)
    remote = getattr(cfg.engine, "name", None) != "hf"
    engine = build_engine(cfg.model, cfg.engine, cache_dir, out_dir) if remote else None
    try:
        tokenizer = load_tokenizer(cfg.model, cache_dir, target)

        # 3. prompts
        data_stats: dict = {}
        ds = load_conversations(cfg.data, data_stats)
        sel = select_for_extraction(ds, cfg.data.splits, cfg.data.limit)
        if len(sel) == 0:
            raise Eagle3Error(f"no prompts selected from data={cfg.data.name} (splits {list(cfg.data.splits)}); check data.splits and data.limit")
        ids, msgs_list, split_list = sel["id"], sel["messages"], sel["split"]
        messages_by_id = dict(zip(ids, msgs_list))
        plan = list(zip(ids, split_list))
        splits = {s: [i for i, sp in zip(ds["id"], ds["split"]) if sp == s] for s in ("train", "validation", "test")}

        # 4. preflight
        est, too_long = _estimate_tokens(tokenizer, msgs_list, cfg)
        if too_long == len(est):
            raise Eagle3Error(
                f"the first prompt of every selected conversation ({too_long}) alone reaches "
                f"capture.max_length={max_length}, so nothing is trainable; raise capture.max_length or use shorter prompts"
            )
        per_shard = features.samples_per_shard(cfg.capture.shard_size_mb, target.hidden_size, top_k, sum(est) / len(est))
        done_ids: set[str] = set()
        if (out_dir / manifest_name).exists():
            old = features.load_manifest(out_dir, require_complete=False, name=manifest_name)
            per_shard = int(old.get("samples_per_shard", per_shard))
            for sh in old.get("shards", []):
                done_ids.update(p[0] for p in old["plan"][sh["index"] * per_shard:(sh["index"] + 1) * per_shard])
        need = features.estimate_bytes(sum(n for i, n in zip(ids, est) if i not in done_ids), target.hidden_size, top_k)
        free = free_disk_bytes(out_dir)
        if need * DISK_MARGIN > free:
            raise Eagle3Error(
                f"extracting {len(plan)} prompts needs about {_human_bytes(need)} in {out_dir} but only "
                f"{_human_bytes(free)} is free; free space, pass output_dir= on a larger disk, or lower "
                "data.limit / capture.max_length"
            )
        log.info("extract: %d prompts (%s), about %s on disk, %d samples per shard", len(plan), data_stats, _human_bytes(need), per_shard)
        _warn_slow_cpu_bf16(cfg)

        # 5. extraction
        if engine is None:
            engine = build_engine(cfg.model, cfg.engine, cache_dir, out_dir)
        metadata = _metadata(cfg, target, engine, tokenizer)
        writer = features.FeatureWriter.open(out_dir, metadata, plan, per_shard, splits=splits, part=part)
        width = max(1, math.ceil(_generation_width(cfg.engine) / per_shard))  # shards per window
        # a worker of a data-parallel run takes every workers-th generation window (whole windows,
        # so each is generated with the same batch and seed as in a one-process run)
        pending = [(i, c) for i, c in writer.pending() if part is None or (i // width) % workers == part[0]]
        windows: dict[int, list[int]] = {}
        for index, _ in pending:
            windows.setdefault(index // width, []).append(index)
        n_shard = int(writer.manifest["samples_per_shard"])
        chunks = [plan[i : i + n_shard] for i in range(0, len(plan), n_shard)]
        mine = [i for i in range(len(chunks)) if part is None or (i // width) % workers == part[0]]
        run_stats = {"samples": 0, "tokens": 0, "masked_tokens": 0, "generated_tokens": 0, "truncated": 0, "dropped": 0}
        side_path = out_dir / (STATS_FILE if part is None else stats_part_name(*part))
        side = read_json(side_path, {}) if len(pending) < len(chunks) else {}
        t_run = time.time()
        bar = tqdm(total=sum(len(c) for _, c in pending), desc="extract" if part is None else f"extract[{part[0]}]",
                   unit="sample", file=sys.stderr, mininterval=5.0, position=part[0] if part else None)
        for w, shard_indices in sorted(windows.items()):
            window_shards = list(range(w * width, min((w + 1) * width, len(chunks))))
            convs = [(sid, messages_by_id[sid]) for s in window_shards for sid, _ in chunks[s]]
            if cfg.capture.regenerate:
                final, gstats = regenerate(engine, tokenizer, convs, cfg.sampling, max_length, seed=cfg.sampling.seed + w,
                                           max_turns=cfg.capture.max_turns,
                                           on_turn=lambda r, n: bar.set_postfix_str(f"generating turn {r + 1} of {n} conversations"))
                too_long, cut, gen_by_id = set(gstats["too_long"]), set(gstats["cut"]), gstats["generated_by_id"]
            else:
                final = {sid: keep_turns(m, cfg.capture.max_turns) for sid, m in convs}
                too_long, cut, gen_by_id = set(), set(), {}
            for index in shard_indices:
                records_in, dropped, truncated = [], {}, []
                for sid, split in chunks[index]:
                    if sid in too_long:
                        dropped[sid] = f"the first prompt alone reaches capture.max_length={max_length}"
                        continue
                    input_ids, mask = render_conversation(tokenizer, final[sid])
                    if len(input_ids) > max_length or sid in cut:
                        truncated.append(sid)
                    input_ids, mask = input_ids[:max_length], mask[:max_length]
                    if sum(mask) == 0:
                        dropped[sid] = f"no assistant token within capture.max_length={max_length}"
                        continue
                    records_in.append((sid, split, input_ids, mask))
                caps = engine.capture([r[2] for r in records_in], top_k) if records_in else []
                records = [
                    features.Record(sid, split, torch.tensor(ii, dtype=torch.int32), torch.tensor(mm, dtype=torch.uint8), cap)
                    for (sid, split, ii, mm), cap in zip(records_in, caps)
                ]
                kept = {r[0] for r in records_in}
                side[str(index)] = {
                    "truncated": [i for i in truncated if i in kept],
                    "generated_tokens": sum(gen_by_id.get(sid, 0) for sid, _ in chunks[index]),
                }
                write_json_atomic(side_path, side)  # before the shard: a kept shard always has its stats
                writer.write_shard(index, records, dropped)
                run_stats["samples"] += len(records)
                run_stats["tokens"] += sum(len(r[2]) for r in records_in)
                run_stats["masked_tokens"] += sum(sum(r[3]) for r in records_in)
                run_stats["generated_tokens"] += side[str(index)]["generated_tokens"]
                run_stats["truncated"] += len(side[str(index)]["truncated"])
                run_stats["dropped"] += len(dropped)
                bar.update(len(chunks[index]))
                elapsed = max(time.time() - t_run, 1e-9)
                bar.set_postfix(tok_s=f"{run_stats['tokens'] / elapsed:.0f}", tokens=run_stats["tokens"])
        bar.close()
        wall = time.time() - t_run
    finally:
        if engine is not None:
            engine.close()

    this_run = {
        **run_stats,
        "wall_time_s": wall,
        "total_time_s": time.time() - t_start,
        "tokens_per_s": run_stats["tokens"] / wall if wall > 0 else 0.0,
        "resumed_shards": len(mine) - len(pending),
    }
    if part is not None:  # a worker: its counts go to the orchestrator, which merges and summarises
        side["_run"] = {"this_run": this_run, "data_stats": data_stats}
        write_json_atomic(side_path, side)
        return this_run
    summary = _summary(cfg, target, writer.manifest, side, len(plan), data_stats, this_run, out_dir)
    writer.finalize(summary)
    print(format_summary(summary))
    return summary


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


def stats_part_name(worker: int, workers: int) -> str:
    """Per-shard counts of one data-parallel worker (merged into ``extract_stats.json``)."""
    return f"extract_stats.part-{worker}-of-{workers}.json"


def _summary(cfg, target, manifest: dict, side: dict, prompts: int, data_stats: dict, this_run: dict,
             out_dir: Path) -> dict:
    """Counts over the whole folder (from the manifest and per-shard side counts), timing of this run."""
    shards = manifest["shards"]
    tokens = sum(s["tokens"] for s in shards)
    nbytes = sum(s["bytes"] for s in shards)
    dropped_reasons: dict[str, int] = {}
    for s in shards:
        for reason in s["dropped"].values():
            dropped_reasons[reason] = dropped_reasons.get(reason, 0) + 1
    return {
        "output_dir": str(out_dir),
        "target": target.name,
        "data": cfg.data.name,
        "prompts": prompts,
        "samples": sum(len(s["samples"]) for s in shards),
        "tokens": tokens,
        "masked_tokens": sum(s["masked_tokens"] for s in shards),
        "truncated": sum(len(side.get(str(s["index"]), {}).get("truncated", [])) for s in shards),
        "generated_tokens": sum(side.get(str(s["index"]), {}).get("generated_tokens", 0) for s in shards),
        "dropped": sum(dropped_reasons.values()),
        "dropped_reasons": dropped_reasons,
        "bytes": nbytes,
        "bytes_per_token": nbytes / tokens if tokens else 0.0,
        "data_stats": data_stats,
        "this_run": this_run,
    }


def run_parallel(cfg) -> dict:
    """Data-parallel extraction: ``parallel.workers`` spawned workers, then one merged manifest.

    Worker ``w`` extracts generation windows ``w, w+N, ...`` on its own device into the
    shared output folder (shard files by global index, its own part manifest); when all
    have finished, :meth:`eagle3.features.store.FeatureWriter.merge_parts` writes one
    ``manifest.json`` listing every planned sample exactly once. Running the same command
    again after an interruption resumes every worker.

    Raises:
        Eagle3Error: bad parallel settings, a failed worker (its finished shards are kept),
            or an inconsistent merge.
    """
    import copy

    from eagle3 import features
    from eagle3.target import resolve_target
    from eagle3.workers import run_workers, worker_devices

    n = int(cfg.parallel.workers)
    if getattr(cfg.engine, "name", None) != "hf":
        raise Eagle3Error(
            f"parallel.workers={n} runs target replicas of the in-process hf engine; with engine="
            f"{getattr(cfg.engine, 'name', None)} list several servers in engine.urls and keep parallel.workers=1"
        )
    devices = worker_devices(str(cfg.engine.device), list(cfg.parallel.devices), n, "parallel.devices")
    out_dir = stage_output_dir(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.tmp"):  # no worker is running yet
        stale.unlink()
    target = resolve_target(cfg.model, Path(cfg.cache_dir))  # build the target (e.g. the INT4 checkpoint) once, not N times
    log.info("extract: %d workers on %s", n, ", ".join(devices))
    cfgs = []
    for w, dev in enumerate(devices):
        wcfg = copy.deepcopy(cfg)
        wcfg.parallel.worker = w
        wcfg.engine.device = dev
        wcfg.output_dir = str(out_dir)
        cfgs.append(wcfg)
    t0 = time.time()
    run_workers("eagle3.extract.run.run_extract", cfgs, "extraction")
    writer = features.FeatureWriter.merge_parts(out_dir, n)
    side: dict = {}
    runs = []
    for w in range(n):
        part_side = read_json(out_dir / stats_part_name(w, n), {})
        runs.append(part_side.pop("_run", {}))
        side.update(part_side)
    write_json_atomic(out_dir / STATS_FILE, side)
    wall = time.time() - t0
    keys = ("samples", "tokens", "masked_tokens", "generated_tokens", "truncated", "dropped", "resumed_shards")
    this_run = {k: sum(r.get("this_run", {}).get(k, 0) for r in runs) for k in keys}
    this_run.update(wall_time_s=wall, total_time_s=wall, workers=n, devices=devices,
                    tokens_per_s=this_run["tokens"] / wall if wall > 0 else 0.0)
    data_stats = next((r["data_stats"] for r in runs if r.get("data_stats")), {})
    summary = _summary(cfg, target, writer.manifest, side, len(writer.manifest["plan"]), data_stats, this_run, out_dir)
    writer.finalize(summary)
    print(format_summary(summary))
    return summary


def format_summary(s: dict) -> str:
    """The summary as a few human-readable lines."""
    r = s["this_run"]
    lines = [
        f"extract: {s['target']} on {s['data']} -> {s['output_dir']}",
        f"  samples {s['samples']} of {s['prompts']} prompts | tokens {s['tokens']} | masked (assistant) tokens {s['masked_tokens']}",
        f"  truncated at max_length {s['truncated']} | generated tokens {s['generated_tokens']} | dropped {s['dropped']}"
        + (f" ({'; '.join(f'{v}: {k}' for k, v in s['dropped_reasons'].items())})" if s["dropped"] else ""),
        f"  bytes {_human_bytes(s['bytes'])} | bytes per token {s['bytes_per_token']:.0f}",
        f"  this run: {r['samples']} samples, {r['tokens']} tokens captured, {r['generated_tokens']} generated, "
        f"wall time {r['wall_time_s']:.1f} s (total {r['total_time_s']:.1f} s), {r['tokens_per_s']:.1f} tokens/s"
        + (f", {r['resumed_shards']} shards kept from an earlier run" if r["resumed_shards"] else ""),
    ]
    return "\n".join(lines)


def unknown_group_choice(overrides: list[str], conf_dir: Path, groups=("model", "data", "engine", "experiment")) -> Optional[str]:
    """One sentence naming an unknown config-group choice on the command line, or None.

    Hydra reports a missing group option with a multi-line message and a traceback
    hint; the entry point checks the overrides first (``model=NAME``, ``+model=NAME``,
    comma lists for ``--multirun``) and lists the available ``conf/<group>/*.yaml``.
    """
    for ov in overrides:
        key, sep, value = ov.lstrip("+").partition("=")
        if not sep or key not in groups:
            continue
        avail = sorted(p.stem for p in (Path(conf_dir) / key).glob("*.yaml"))
        for choice in value.split(","):
            choice = choice.strip()
            if choice and all(ch.isalnum() or ch in "-_." for ch in choice) and choice not in avail:
                return f"{key} '{choice}' is unknown; available {key} configs: {', '.join(avail)}"
    return None
