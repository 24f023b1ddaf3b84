"""The results of a served evaluation: the report dict, the throughput plot, the request log.

:func:`build_results` turns the two servers' sweeps into the report's results: per
benchmark the hf report's keys measured at the lowest concurrency plus a ``concurrency``
table (speed-up = speculative output tokens/s / baseline output tokens/s at the same
concurrency), and the same table pooled over benchmarks
(:func:`eagle3.evaluate.plots.plot_throughput` draws it); :func:`write_request_log` keeps every
measured request.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eagle3.evaluate.metrics import diversity, ratio
from eagle3.evaluate.measures import Pairs, RequestRecord, summarize
from eagle3.evaluate.plots import PLOT_NAME
from eagle3.evaluate.sglang.servers import ROLES
from eagle3.evaluate.turns import lossless_check, paired_speedup, served_pair_turns, served_turn, tau_interval

REQUESTS_NAME = "sglang_requests.jsonl"

#: ``{role: {concurrency: {benchmark: (records, wall seconds)}}}``, as swept
Runs = dict[str, dict[int, dict[str, tuple[list[RequestRecord], float]]]]


def _headline(concurrency: list[int]) -> int:
    return min(concurrency)


def build_results(
    runs: Runs,
    servers: dict[str, dict],
    cfg: Any,
    warnings: list[str],
    paired: dict[str, Pairs] | None = None,
    interleaved: bool = True,
) -> dict:
    """Per-benchmark results (the hf report's keys) plus a ``concurrency`` table per
    benchmark and aggregated over benchmarks.

    Args:
        runs: both servers' sweeps (:func:`eagle3.evaluate.sglang.sweeps.sweep_server`).
        servers: ``{role: Server.describe()}`` (the speculative server's effective
            ``speculative_*`` settings win over the configured ones).
        cfg: the ``EvaluateConfig`` (``concurrency``, ``speculative``, sampling, ``seed``).
        warnings: kept as the results' ``warnings`` (extended with a note per benchmark
            whose speed-up interval contains 1.0 or whose greedy outputs differ).
        paired: the interleaved batch-1 pairs
            (:func:`eagle3.evaluate.sglang.sweeps.interleave_batch1`); the headline keys
            come from them (tau, acceptance, tokens/s, ``speedup`` with
            ``speedup_interval``, ``lossless_matches`` at temperature 0). Without them
            the headline is the sweep's lowest concurrency and nothing is checked for
            losslessness.
        interleaved: whether the pairs were sent prompt by prompt to both servers up at
            once (else they are the two servers' concurrency-1 runs, one after the other).
    """
    conc = sorted(int(c) for c in cfg.concurrency)
    head = _headline(conc)
    eff_spec = servers["speculative"]["effective"]
    depth = eff_spec.get("speculative_num_steps") or cfg.speculative.num_steps
    names = list(next(iter(runs["speculative"].values())).keys())
    benchmarks = {name: _benchmark_result(runs, name, conc, head, depth) for name in names}
    if paired:
        greedy = float(cfg.temperature) == 0.0
        for name in names:
            if paired.get(name):
                seed = int(getattr(cfg, "seed", 0) or 0)
                benchmarks[name].update(_paired_result(paired[name], depth, greedy, seed, interleaved))
                warnings = warnings + _paired_warnings(name, benchmarks[name])
    return {
        "engine": "sglang",
        "benchmarks": benchmarks,
        "concurrency": _pooled_table(runs, names, conc, depth),
        "servers": servers,
        "speculative": {
            "num_steps": eff_spec.get("speculative_num_steps", cfg.speculative.num_steps),
            "topk": eff_spec.get("speculative_eagle_topk", cfg.speculative.topk),
            "num_draft_tokens": eff_spec.get("speculative_num_draft_tokens", cfg.speculative.num_draft_tokens),
        },
        "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens},
        "warnings": warnings,
        "plots": {"throughput_vs_concurrency": PLOT_NAME},
    }


def _benchmark_result(runs: Runs, name: str, conc: list[int], head: int, depth: int) -> dict:
    """One benchmark's report entry: its concurrency table and the headline row's keys."""
    table = []
    for c in conc:
        base = summarize(*runs["baseline"][c][name])
        spec = summarize(*runs["speculative"][c][name], positions=depth)
        n_jobs = len({r.sample_id for r in runs["speculative"][c][name][0]})
        table.append({
            "concurrency": c,
            "effective_concurrency": min(c, n_jobs),
            "baseline": base,
            "speculative": spec,
            "speedup": ratio(spec["output_tokens_per_s"], base["output_tokens_per_s"]),
        })
    row = table[conc.index(head)]
    spec, base = row["speculative"], row["baseline"]
    recs = runs["speculative"][head][name][0]
    return {
        "num_prompts": len({r.sample_id for r in recs}),
        "num_turns": spec["requests"],
        "requests": spec["requests"],
        "acceptance_length": spec.get("acceptance_length"),
        "acceptance_length_interval": tau_interval([served_turn(None, r) for r in recs]),
        "acceptance_length_verify_only": spec.get("acceptance_length_verify_only"),
        "acceptance_length_non_looping": spec.get("acceptance_length_non_looping"),
        "acceptance_rate": spec.get("acceptance_rate"),
        "verify_passes": spec.get("verify_passes"),
        "generated_tokens": spec["output_tokens"],
        "accepted_drafts": spec.get("accepted_drafts"),
        "proposed_drafts": spec.get("proposed_drafts"),
        "accept_histogram": spec.get("accept_histogram"),
        "per_position_acceptance": spec.get("per_position_acceptance"),
        "conditional_acceptance": spec.get("conditional_acceptance"),
        "tokens_per_s_spec": spec["output_tokens_per_s"],
        "tokens_per_s_base": base["output_tokens_per_s"],
        "speedup": row["speedup"],
        "lossless_matches": None,
        "lossless_checked": None,
        "diversity": diversity([r.output_ids for r in recs]),
        "output_tokens_spec": spec["output_tokens"],
        "output_tokens_base": base["output_tokens"],
        "ttft_ms_spec": spec["ttft_ms"],
        "tpot_ms_spec": spec["tpot_ms"],
        "ttft_ms_base": base["ttft_ms"],
        "tpot_ms_base": base["tpot_ms"],
        "measured_at_concurrency": head,
        "concurrency": table,
    }


def _paired_result(pairs: Pairs, depth: int, greedy: bool, seed: int, interleaved: bool = True) -> dict:
    """The headline keys of one benchmark from its interleaved batch-1 pairs."""
    recs = [r for _, spec in pairs for r in spec]
    base_recs = [r for base, _ in pairs for r in base]
    spec = summarize(recs, sum(r.latency_s for r in recs), positions=depth)
    base = summarize(base_recs, sum(r.latency_s for r in base_recs))
    sp = paired_speedup(pairs, seed=seed)
    ll = lossless_check(pairs) if greedy else None
    keys = ("acceptance_length", "acceptance_length_verify_only", "acceptance_length_non_looping", "acceptance_rate",
            "verify_passes", "accepted_drafts", "proposed_drafts", "accept_histogram", "per_position_acceptance",
            "conditional_acceptance")
    return {
        **{k: spec.get(k) for k in keys},
        "acceptance_length_interval": tau_interval(served_pair_turns(pairs)),
        "num_prompts": len(pairs),
        "num_turns": spec["requests"],
        "requests": spec["requests"],
        "generated_tokens": spec["output_tokens"],
        "output_tokens_spec": spec["output_tokens"],
        "output_tokens_base": base["output_tokens"],
        "tokens_per_s_spec": sp["tokens_per_s_spec"],
        "tokens_per_s_base": sp["tokens_per_s_base"],
        "speedup": sp["speedup"],
        "speedup_interval": sp["interval"],
        "speedup_interval_level": sp["level"],
        "speedup_significant": sp["significant"],
        "lossless_matches": ll["matches"] if ll else None,
        "lossless_checked": ll["checked"] if ll else None,
        "lossless_mismatches": ll["mismatches"] if ll else None,
        "lossless_near_ties": ll["near_ties"] if ll else None,
        "diversity": diversity([r.output_ids for r in recs]),
        "ttft_ms_spec": spec["ttft_ms"], "tpot_ms_spec": spec["tpot_ms"],
        "ttft_ms_base": base["ttft_ms"], "tpot_ms_base": base["tpot_ms"],
        "measured_at_concurrency": 1,
        "measured": ("batch 1, baseline and speculative requests interleaved prompt by prompt" if interleaved
                     else "batch 1, the baseline's run, then the speculative server's"),
    }


def _paired_warnings(name: str, b: dict) -> list[str]:
    """What a reader must not miss about one benchmark's batch-1 pairs."""
    out = []
    iv = b.get("speedup_interval")
    if iv is not None and b.get("speedup") is not None and iv[0] <= 1.0 <= iv[1]:
        out.append(
            f"{name}: tokens/s ratio {b['speedup']:.2f} with {b['speedup_interval_level']:.0%} interval "
            f"[{iv[0]:.2f}, {iv[1]:.2f}] over {b['num_prompts']} prompts contains 1.0: no speed-up (or slow-down) "
            "can be claimed at batch 1; evaluate more prompts (data.limit) to narrow it"
        )
    if b.get("lossless_matches") is not None and b["lossless_matches"] < b["lossless_checked"]:
        ms = b["lossless_mismatches"]
        bad = b["lossless_checked"] - b["lossless_matches"]
        ties = b.get("lossless_near_ties") or 0
        out.append(
            f"{name}: the speculative server's greedy output differs from the baseline's on {bad} of "
            f"{b['lossless_checked']} prompts, {ties} of them only at near-ties of the top two log-probs "
            f"(sample, turn, position, gap: {[(m['sample_id'], m['turn'], m['first_diff'], m.get('logit_gap')) for m in ms[:5]]})"
            + ("; the others point at the drafter's d2t, the server's dtype or its verify kernels" if ties < bad else "")
        )
    return out


def _pooled_table(runs: Runs, names: list[str], conc: list[int], depth: int) -> list[dict]:
    """Both servers at every concurrency, all benchmarks pooled (wall times summed)."""
    overall = []
    for c in conc:
        agg = {}
        for role in ROLES:
            recs = [r for name in names for r in runs[role][c][name][0]]
            dur = sum(runs[role][c][name][1] for name in names)
            agg[role] = summarize(recs, dur, positions=depth)
        overall.append({"concurrency": c, "baseline": agg["baseline"], "speculative": agg["speculative"],
                        "speedup": ratio(agg["speculative"]["output_tokens_per_s"], agg["baseline"]["output_tokens_per_s"])})
    return overall


def write_request_log(runs: dict, path: Path, paired: dict[str, Pairs] | None = None) -> None:
    """Every measured request as one JSON line (role, concurrency, timings, counters);
    the interleaved batch-1 requests carry ``"phase": "interleaved"`` and the prompt's
    index, the sweep's ``"phase": "sweep"`` (a sweep record that is also a pair's is
    written once, as the pair's). Written atomically."""
    def line(r: RequestRecord, **extra) -> str:
        d = dict(r.__dict__, tpot_s=r.tpot_s, **extra)
        d.pop("output_ids")
        return json.dumps(d) + "\n"

    tmp = path.with_name(path.name + ".tmp")
    seen = {id(r) for pairs in (paired or {}).values() for pair in pairs for recs in pair for r in recs}
    with open(tmp, "w") as f:
        for name, pairs in (paired or {}).items():
            for k, (base, spec) in enumerate(pairs):
                for role, recs in (("baseline", base), ("speculative", spec)):
                    for r in recs:
                        f.write(line(r, role=role, concurrency=1, phase="interleaved", pair=k))
        for role, by_c in runs.items():
            for c, by_b in by_c.items():
                for recs, _ in by_b.values():
                    for r in recs:
                        if id(r) not in seen:  # the concurrency-1 row may be the pairs themselves
                            f.write(line(r, role=role, concurrency=c, phase="sweep"))
    os.replace(tmp, path)
