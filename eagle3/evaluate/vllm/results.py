"""The results of a vLLM served evaluation, in the report's shape (:mod:`eagle3.evaluate.report`).

Per benchmark, from the batch-1 pairs (:func:`eagle3.evaluate.vllm.measure.measure_pairs`):

* tau = 1 + accepted / drafts and acceptance rate = accepted / draft tokens from the
  speculative server's own counters summed over its requests; per-position acceptance
  = accepted at position i / drafts (vLLM's counters, :mod:`eagle3.engines.vllm.metrics`);
* tokens/s = completion tokens / request latency (prefill included) at batch 1, per
  prompt for each server; ``speedup`` is the median over prompts of the per-prompt ratio
  speculative / baseline, with a seeded bootstrap 95% interval over prompts; an
  interval containing 1.0 is reported as no measurable speed-up (and never as slower);
* lossless: prompts whose speculative greedy token ids equal the baseline's, with the
  first mismatch (turn, position, both tokens) and, at T=0, how many mismatching prompts
  differ only at rounding ties of the baseline server's two logits (``lossless_near_ties``);

plus the concurrency table of :func:`eagle3.evaluate.vllm.measure.sweep_concurrency`
(speed-up = speculative / baseline output tokens/s over the run's wall time).
"""

from __future__ import annotations

from statistics import median
from typing import Any, Optional

from eagle3.engines.vllm import SpecCounters
from eagle3.evaluate.metrics import diversity, ratio, verdict
from eagle3.evaluate.measures import percentiles_ms
from eagle3.evaluate.turns import DecodedTurn, lossless_turns, tau_interval
from eagle3.evaluate.vllm.measure import ROLES, Pair, SweepRun

BOOTSTRAP_RESAMPLES = 2000
MIN_PROMPTS_FOR_INTERVAL = 3


def bootstrap_median_ci(values: list[float], seed: int, n: int = BOOTSTRAP_RESAMPLES) -> Optional[tuple[float, float]]:
    """Percentile bootstrap 95% interval of the median of ``values`` (resampled with
    replacement ``n`` times, numpy generator seeded with ``seed``); None for fewer than
    :data:`MIN_PROMPTS_FOR_INTERVAL` values (no interval worth the name)."""
    import numpy as np

    if len(values) < MIN_PROMPTS_FOR_INTERVAL:
        return None
    a = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(int(seed))
    meds = np.median(a[rng.integers(0, len(a), size=(int(n), len(a)))], axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def speedup_statement(med: Optional[float], ci: Optional[tuple[float, float]]) -> str:
    """``speed-up x1.23 (95% CI 1.10-1.35)``, ``slower: x0.80 (...)`` or ``no measurable
    speed-up: x0.98 (...)`` when the interval contains 1.0."""
    if med is None:
        return "no speed-up measured"
    if ci is None:
        return f"no measurable speed-up: x{med:.2f} from fewer than {MIN_PROMPTS_FOR_INTERVAL} prompts, too few for an interval"
    span = f"x{med:.2f} (95% CI {ci[0]:.2f}-{ci[1]:.2f})"
    if ci[0] <= 1.0 <= ci[1]:
        return f"no measurable speed-up: {span}"
    return f"speed-up {span}" if ci[0] > 1.0 else f"slower: {span}"


def benchmark_warnings(name: str, b: dict) -> list[str]:
    """The report's warnings for one benchmark's summary (``b`` from :func:`pair_summary`).

    Two kinds: prompts whose speculative greedy output differs from the baseline server's (how
    many of them only at rounding ties), and a speed-up that cannot be claimed (its 95% interval
    contains 1.0, or too few prompts for one) or a slow-down. A speed-up whose interval lies
    above 1.0 is a result, reported in the table, not a warning.
    """
    out = []
    if b["lossless_matches"] < b["lossless_checked"]:
        ties = b.get("lossless_near_ties")
        out.append(f"{name}: {b['lossless_checked'] - b['lossless_matches']} of {b['lossless_checked']} prompts "
                   f"differ from the baseline's greedy output"
                   + (f" ({ties} only at rounding ties of the baseline's two best logits)" if ties else "")
                   + f"; first mismatch {b['lossless_first_mismatch']}")
    ci = b.get("speedup_ci95")
    if not (ci and ci[0] > 1.0):  # no interval, one containing 1.0, or a slow-down
        out.append(f"{name}: {b['speedup_statement']} at batch 1 over {len(b['speedup_per_prompt'])} prompts")
    return out


def _per_prompt(pairs: list[Pair]) -> dict[str, dict[str, list]]:
    by: dict[str, dict[str, list]] = {}
    for p in pairs:
        d = by.setdefault(p.sample_id, {"base": [], "spec": []})
        d["base"].append(p.base)
        d["spec"].append(p.spec)
    return by


def _tps(cs) -> Optional[float]:
    lat = sum(c.latency_s for c in cs)
    return sum(c.completion_tokens for c in cs) / lat if lat > 0 else None


def _decode_tps(cs) -> Optional[float]:
    dec = sum(c.latency_s - c.ttft_s for c in cs)
    return sum(max(c.completion_tokens - 1, 0) for c in cs) / dec if dec > 0 else None


def _turns(pairs: list[Pair], diagnosis: Optional[dict] = None) -> list[DecodedTurn]:
    """The pairs as the shared measures read them (:class:`eagle3.evaluate.turns.DecodedTurn`:
    tau = ``drafts + accepted`` / ``drafts`` of each request's ``/metrics`` delta; ``tie`` and
    ``diagnosis`` from ``diagnosis``, keyed by ``(benchmark, sample_id, turn)``)."""
    out = []
    for p in pairs:
        d = (diagnosis or {}).get((p.benchmark, p.sample_id, p.turn)) or {}
        out.append(DecodedTurn(p.benchmark, p.sample_id, p.turn, p.spec.output_ids, p.base.output_ids,
                               p.spec.completion_tokens, p.base.completion_tokens, p.spec.latency_s, p.base.latency_s,
                               p.counters.drafts + p.counters.accepted, p.counters.drafts, bool(d.get("tie")), d or None))
    return out


def lossless(pairs: list[Pair], diagnosis: Optional[dict] = None) -> tuple[int, int, Optional[dict], int]:
    """``(prompts whose every turn matches, prompts, first mismatch or None, near ties)``
    (:func:`eagle3.evaluate.turns.lossless_turns`).

    A mismatch is ``{sample_id, turn, position, baseline_token, speculative_token,
    baseline_len, speculative_len}``, with ``logit_gap`` and ``tie`` where ``diagnosis``
    (:func:`eagle3.evaluate.vllm.measure.diagnose_mismatches`, keyed by
    ``(benchmark, sample_id, turn)``) has it; ``near ties`` counts the mismatching prompts
    whose every differing turn first differs at a rounding tie (as the in-process check).
    """
    ll = lossless_turns(_turns(pairs, diagnosis))
    first = None
    if ll.mismatched:
        t = ll.mismatched[0]
        a, b, pos = t.base_ids, t.spec_ids, t.first_diff
        d = t.diagnosis or {}
        first = {"sample_id": t.sample_id, "turn": t.turn, "position": pos,
                 "baseline_token": a[pos] if pos < len(a) else None,
                 "speculative_token": b[pos] if pos < len(b) else None,
                 "baseline_len": len(a), "speculative_len": len(b),
                 **({"logit_gap": d.get("logit_gap"), "tie": bool(d.get("tie"))} if d else {})}
    return ll.matches, ll.checked, first, ll.near_ties


def _counters(pairs: list[Pair]) -> SpecCounters:
    total = SpecCounters()
    for p in pairs:
        total = total + p.counters
    return total


def pair_summary(pairs: list[Pair], depth: int, seed: int, diagnosis: Optional[dict] = None) -> dict:
    """One benchmark's batch-1 entry of the report (see the module docstring); ``diagnosis``
    as :func:`lossless` reads it."""
    by = _per_prompt(pairs)
    ratios = [r for d in by.values() if (r := ratio(_tps(d["spec"]), _tps(d["base"]))) is not None]
    med = median(ratios) if ratios else None
    ci = bootstrap_median_ci(ratios, seed)
    cnt = _counters(pairs)
    spec, base = [p.spec for p in pairs], [p.base for p in pairs]
    matches, checked, first, ties = lossless(pairs, diagnosis)
    # each request: 1 prefill token + (1 + accepted) per verify pass; differs when max_tokens cut a pass short
    counted = sum(1 for p in pairs if p.counters.drafts + p.counters.accepted + 1 != p.spec.completion_tokens)
    return {
        "num_prompts": len(by), "num_turns": len(pairs), "requests": len(pairs),
        "acceptance_length": cnt.tau, "acceptance_rate": cnt.acceptance_rate,
        "acceptance_length_interval": tau_interval(_turns(pairs)),
        "verify_passes": int(cnt.drafts), "accepted_drafts": int(cnt.accepted), "proposed_drafts": int(cnt.draft_tokens),
        "per_position_acceptance": cnt.per_position_acceptance(depth),
        "accepted_per_position": [int(v) for v in cnt.per_position],
        "generated_tokens": sum(c.completion_tokens for c in spec),
        "output_tokens_spec": sum(c.completion_tokens for c in spec),
        "output_tokens_base": sum(c.completion_tokens for c in base),
        "requests_where_counters_differ_from_tokens": counted,
        "tokens_per_s_spec": _tps(spec), "tokens_per_s_base": _tps(base),
        "speedup": med, "speedup_ci95": list(ci) if ci else None, "speedup_per_prompt": ratios,
        "speedup_interval": list(ci) if ci else None,  # the key the report renders as [lo, hi]
        "speedup_definition": "median over prompts of (spec tokens/s) / (baseline tokens/s), batch 1",
        "speedup_statement": speedup_statement(med, ci),
        "decode_speedup": ratio(_decode_tps(spec), _decode_tps(base)),
        "lossless_matches": matches, "lossless_checked": checked, "lossless_first_mismatch": first,
        "lossless_near_ties": ties if diagnosis is not None else None,
        "diversity": diversity([c.output_ids for c in spec]),
        "ttft_ms_spec": percentiles_ms([c.ttft_s for c in spec]), "ttft_ms_base": percentiles_ms([c.ttft_s for c in base]),
        "tpot_ms_spec": percentiles_ms([(c.latency_s - c.ttft_s) / (c.completion_tokens - 1) for c in spec
                                        if c.completion_tokens > 1]),
        "tpot_ms_base": percentiles_ms([(c.latency_s - c.ttft_s) / (c.completion_tokens - 1) for c in base
                                        if c.completion_tokens > 1]),
        "measured_at_concurrency": 1,
    }


def _run_summary(run: SweepRun, depth: int) -> dict:
    out: dict[str, Any] = {"requests": len(run.completions), "duration_s": run.duration_s,
                           "output_tokens": run.output_tokens,
                           "output_tokens_per_s": run.output_tokens / run.duration_s if run.duration_s > 0 else None,
                           "ran_first": run.ran_first}
    if run.counters is not None:
        out.update(acceptance_length=run.counters.tau, acceptance_rate=run.counters.acceptance_rate,
                   verify_passes=int(run.counters.drafts), per_position_acceptance=run.counters.per_position_acceptance(depth))
    return out


def concurrency_table(sweep: dict, names: list[str], concurrency: list[int], depth: int) -> tuple[dict, list[dict]]:
    """``({benchmark: rows}, pooled rows)``; a row is ``{concurrency, effective_concurrency,
    baseline, speculative, speedup}`` (pooled: runs of all benchmarks summed)."""
    per: dict[str, list[dict]] = {n: [] for n in names}
    pooled = []
    for c in concurrency:
        agg = {}
        for n in names:
            row = {r: _run_summary(sweep[r][c][n], depth) for r in ROLES}
            per[n].append({"concurrency": c, "effective_concurrency": min(c, row["speculative"]["requests"]), **row,
                           "speedup": ratio(row["speculative"]["output_tokens_per_s"], row["baseline"]["output_tokens_per_s"])})
        for r in ROLES:
            runs = [sweep[r][c][n] for n in names]
            cnt = None
            if r == "speculative":
                cnt = SpecCounters()
                for x in runs:
                    cnt = cnt + (x.counters or SpecCounters())
            agg[r] = _run_summary(SweepRun([x for run in runs for x in run.completions],
                                           sum(run.duration_s for run in runs), cnt, 1), depth)
            agg[r].pop("ran_first")
        pooled.append({"concurrency": c, **agg,
                       "speedup": ratio(agg["speculative"]["output_tokens_per_s"], agg["baseline"]["output_tokens_per_s"])})
    return per, pooled


def benchmark_verdict(b: dict, cap: Optional[int]) -> tuple[str, list[str]]:
    """:func:`eagle3.evaluate.metrics.verdict`, except that a batch-1 speed-up whose 95%
    interval contains 1.0 (or that has too few prompts for one) is "no measurable
    speed-up" (the code ``no-speedup``), not "slower"."""
    ci = b.get("speedup_ci95")
    if b.get("speedup") is None or (ci and not ci[0] <= 1.0 <= ci[1]):
        return verdict(b, spec_cap=cap)
    code, notes = verdict({**b, "speedup": None}, spec_cap=cap)
    codes = [c for c in code.split(", ") if c != "OK"] + ["no-speedup"]
    return ", ".join(codes), notes + [b.get("speedup_statement", "no measurable speed-up") + " at batch 1 over prompts"]
