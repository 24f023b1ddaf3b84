"""The extraction's summary: counts over the whole folder, this run's timing, and how they are printed.

Per-shard counts that the manifest does not keep (truncations, generated tokens) live
in a side file, ``extract_stats.json`` (one part file per data-parallel worker, merged
by :func:`eagle3.extract.parallel.run_parallel`).
"""

from __future__ import annotations

from pathlib import Path

from eagle3 import features

STATS_FILE = "extract_stats.json"  # per-shard counts the manifest does not keep (truncations, generated tokens)


def stats_part_name(worker: int, workers: int) -> str:
    """Per-shard counts of one data-parallel worker (merged into ``extract_stats.json``)."""
    return f"extract_stats.part-{worker}-of-{workers}.json"


def _human_bytes(n: float) -> str:
    """``n`` bytes in decimal units, one decimal (``1000`` -> ``1.0 KB``)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


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
        "features": features.stored_features(manifest["metadata"]),
        # what the features store of the same tokens would take (eagle3.features.bytes_per_token)
        "offline_bytes_per_token": features.bytes_per_token(target.hidden_size, int(cfg.capture.top_k),
                                                            cfg.capture.aux_dtype),
        "data_stats": data_stats,
        "this_run": this_run,
    }


_NOT_USED = (("dropped_no_user", "no human turn"),
             ("dropped_empty", "empty"), ("dropped_unknown_role", "a turn of unknown role"),
             ("incomplete_records", "cut off at the end of the file"), ("skipped_bad_records", "damaged, skipped"))


def data_line(d: dict) -> str | None:
    """One line on what the prompt source gave: records read, conversations used and why the
    rest were not (``load_conversations``'s counts), or None where the source counts no records."""
    if not d.get("records") and not d.get("skipped_bad_records"):
        return None
    why = [f"{d[k]} {text}" for k, text in _NOT_USED if d.get(k)]
    late = d.get("started_at_first_user")
    return (f"  prompt source: {d.get('records', 0)} records read, {d.get('conversations', 0)} conversations usable"
            + (f" ({late} of them opened with gpt turns and start at their first human turn)" if late else "")
            + (f"; not used: {', '.join(why)}" if why else ""))


def format_summary(s: dict) -> str:
    """The summary as a few human-readable lines."""
    r = s["this_run"]
    lines = [
        f"extract: {s['target']} on {s['data']} -> {s['output_dir']}",
        f"  samples {s['samples']} of {s['prompts']} prompts | tokens {s['tokens']} | masked (assistant) tokens {s['masked_tokens']}",
        f"  truncated at max_length {s['truncated']} | generated tokens {s['generated_tokens']} | dropped {s['dropped']}"
        + (f" ({'; '.join(f'{v}: {k}' for k, v in s['dropped_reasons'].items())})" if s["dropped"] else ""),
        f"  bytes {_human_bytes(s['bytes'])} | bytes per token {s['bytes_per_token']:.1f}"
        + (f" (kept replies alone, features=none; the features store: {s['offline_bytes_per_token']} a token)"
           if s.get("features") == "none" else ""),
        f"  this run: {r['samples']} samples, {r['tokens']} tokens captured, {r['generated_tokens']} generated, "
        f"wall time {r['wall_time_s']:.1f} s (total {r['total_time_s']:.1f} s), {r['tokens_per_s']:.1f} tokens/s"
        + (f", {r['resumed_shards']} shards kept from an earlier run" if r["resumed_shards"] else ""),
    ]
    extra = data_line(s.get("data_stats") or {})
    if extra:
        lines.insert(1, extra)
    return "\n".join(lines)
