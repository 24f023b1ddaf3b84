"""``engine=vllm``: the drafter's vLLM export served by a real vLLM server, against a baseline.

:func:`evaluate_servers` (run by :class:`eagle3.evaluate.vllm.backend.VLLMBackend` once the
export and its provenance are checked):

1. opens two servers at once (:mod:`eagle3.evaluate.vllm.servers`): a baseline (no
   drafter) and a speculative one serving the export, and reads back their effective settings;
2. measures batch-1 pairs and the concurrency sweep (:mod:`eagle3.evaluate.vllm.measure`),
   builds the results (:mod:`eagle3.evaluate.vllm.results`), writes the throughput plot
   and the request log (the stage writes the report).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional


log = logging.getLogger("eagle3")

REQUESTS_NAME = "vllm_requests.jsonl"


def _request_body(cfg: Any, tokenizer) -> dict:
    """What every completion shares: the served name, greedy or seeded sampling, max tokens,
    and the target's end-of-turn ids as stop tokens (as the hf engine stops)."""
    from eagle3.target import end_of_turn_ids

    body = {"model": str(cfg.engine.served_model_name), "max_tokens": int(cfg.max_new_tokens),
            "temperature": float(cfg.temperature), "top_p": float(cfg.top_p), "ignore_eos": False,
            "stop_token_ids": [int(i) for i in end_of_turn_ids(tokenizer)]}
    if float(cfg.temperature) > 0:
        body["seed"] = int(cfg.seed)
    return body


def evaluate_servers(cfg: Any, settings, export, info, tokenizer, benchmarks: dict, concurrency: list[int],
                     output_dir: Path) -> dict:
    """Open both servers, measure, stop what was launched here; the results dict
    (``engine: vllm``, the served results' shape, :mod:`eagle3.evaluate.vllm.results`).

    Raises:
        Eagle3Error: as :func:`eagle3.evaluate.vllm.servers.open_servers` /
            :func:`~eagle3.evaluate.vllm.servers.check_servers`, or a failing request.
    """
    from eagle3.evaluate.plots import PLOT_NAME, plot_throughput
    from eagle3.evaluate.measures import prompt_limit, system_messages
    from eagle3.evaluate.vllm.measure import (Servers, diagnose_mismatches, measure_pairs, pairs_as_sweep,
                                                        sweep_concurrency, warm_up)
    from eagle3.evaluate.vllm.servers import cap_warnings, check_servers, open_servers
    from eagle3.target import render_prompt, resolve_target

    rows = {n: [dict(id=r["id"], messages=r["messages"]) for r in ds] for n, ds in benchmarks.items()}
    local = resolve_target(cfg.model, cfg.cache_dir).path  # None for a hub id not on this machine (e.g. Kimi)
    model_path = str(Path(local).resolve()) if local else str(cfg.model.source)  # read only to launch a server
    opened = open_servers(cfg, model_path, export.dir, output_dir)
    try:
        desc = {role: s.describe() for role, s in opened.items()}
        warnings = check_servers(desc, cfg, export) + cap_warnings(desc, concurrency)
        for w in warnings:
            log.warning(w)
        servers = Servers(opened["baseline"].client, opened["speculative"].client, _request_body(cfg, tokenizer))
        limit, why = prompt_limit([d.get("effective", {}).get("max_model_len") for d in desc.values()],
                                  int(cfg.max_new_tokens), getattr(cfg, "max_prompt_tokens", None))
        firsts = (render_prompt(tokenizer, system_messages(r) + [m for m in r["messages"] if m["role"] == "user"][:1])
                  for rs in rows.values() for r in rs)
        warm = next((p for p in firsts if limit is None or len(p) <= limit), None)
        if warm is not None:  # none fits: measure_pairs says so
            warm_up(servers, warm, int(cfg.warmup_prompts))
        pairs = measure_pairs(servers, rows, lambda msgs: render_prompt(tokenizer, msgs),
                              lambda ids: tokenizer.decode(ids, skip_special_tokens=True), limit, why, warnings)
        # greedy mismatches: a rounding tie of the baseline's two logits, or a changed output
        diagnosis = (diagnose_mismatches(servers.baseline, servers.body["model"], pairs)
                     if float(cfg.temperature) == 0 else None)
        prompts = {n: [p.prompt_ids for p in ps] for n, ps in pairs.items()}
        sweep = sweep_concurrency(servers, prompts, [c for c in concurrency if c != 1])
        if 1 in concurrency:  # what the interleaved pairs measured
            for role, runs in pairs_as_sweep(pairs).items():
                sweep[role][1] = runs
    finally:
        for s in opened.values():
            s.stop()
    results = assemble(cfg, settings, pairs, sweep, desc, concurrency, warnings, export.dir, diagnosis)
    plot_throughput(results, output_dir / PLOT_NAME)
    write_request_log(pairs, sweep, output_dir / REQUESTS_NAME)
    return results


def assemble(cfg: Any, settings, pairs: dict, sweep: dict, desc: dict, concurrency: list[int],
             warnings: list[str], drafter_dir: Path, diagnosis: Optional[dict] = None) -> dict:
    """The results dict from the measures (the report's shape, ``engine: vllm``); ``diagnosis``:
    the near-tie test of the greedy mismatches (:func:`eagle3.evaluate.vllm.measure.diagnose_mismatches`);
    ``drafter_dir``: the export folder served, recorded in ``settings``."""
    from eagle3.evaluate.vllm.results import (benchmark_verdict, benchmark_warnings, concurrency_table,
                                                     pair_summary)

    spec_eff = desc["speculative"]["effective"]
    depth = int((spec_eff.get("speculative_config") or {}).get("num_speculative_tokens") or settings.num_steps)
    names = list(pairs)
    per, pooled = concurrency_table(sweep, names, concurrency, depth)
    failed = [d["error"] for d in (diagnosis or {}).values() if d.get("error")]
    if failed:
        warnings.append(f"the near-tie test of {len(failed)} greedy mismatches failed, so they count as changed "
                        f"outputs: {failed[0]}")
    benches = {}
    for n in names:
        b = pair_summary(pairs[n], depth, int(cfg.seed), diagnosis)
        b["concurrency"] = per[n]
        b["verdict"], b["verdict_notes"] = benchmark_verdict(b, spec_eff.get("max_num_seqs"))
        benches[n] = b
        warnings.extend(benchmark_warnings(n, b))
    return {
        "engine": "vllm",
        "benchmarks": benches,
        "concurrency": pooled,
        "servers": desc,
        "speculative": {"num_steps": depth, "topk": 1, "num_draft_tokens": depth + 1},
        "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens},
        "settings": {"drafter_dir": str(drafter_dir), "target": cfg.model.name,
                     "dtype": cfg.model.dtype, "seed": int(cfg.seed), "limit": cfg.data.limit,
                     "warmup_prompts": int(cfg.warmup_prompts), "tau": "1 + accepted / drafts (vLLM counters)",
                     "max_num_seqs": spec_eff.get("max_num_seqs"),
                     "max_num_seqs_source": spec_eff.get("max_num_seqs_source")},
        "warnings": warnings,
        "plots": {"throughput_vs_concurrency": "throughput_vs_concurrency.png"},
    }


def write_request_log(pairs: dict, sweep: dict, path: Path) -> None:
    """Every measured request as one JSON line (phase, role, timings, tokens, counter deltas); atomic."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for ps in pairs.values():
            for p in ps:
                for role, c in (("baseline", p.base), ("speculative", p.spec)):
                    rec = {"phase": "batch1", "role": role, "benchmark": p.benchmark, "sample_id": p.sample_id,
                           "turn": p.turn, "prompt_tokens": len(p.prompt_ids), "completion_tokens": c.completion_tokens,
                           "ttft_s": c.ttft_s, "latency_s": c.latency_s, "finish_reason": c.finish_reason,
                           "first_of_pair": p.order[0] == role, "output_ids": c.output_ids}
                    if role == "speculative":
                        rec.update(drafts=p.counters.drafts, draft_tokens=p.counters.draft_tokens,
                                   accepted=p.counters.accepted, accepted_per_position=p.counters.per_position)
                    f.write(json.dumps(rec) + "\n")
        for role, by_c in sweep.items():
            for c, by_b in by_c.items():
                for name, run in by_b.items():
                    f.write(json.dumps({"phase": "sweep", "role": role, "concurrency": c, "benchmark": name,
                                        "duration_s": run.duration_s, "output_tokens": run.output_tokens,
                                        "ran_first": run.ran_first,
                                        "from_batch1_pairs": run.order_index < 0}) + "\n")
    os.replace(tmp, path)
