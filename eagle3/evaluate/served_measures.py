"""Measures of one served run: the per-request record and what is computed from it.

A :class:`RequestRecord` is one streamed ``/generate`` request (one turn of one
prompt) with its timings and SGLang's speculative counters from ``meta_info``.
:func:`summarize` computes what ``sglang.bench_serving`` reports
(``python/sglang/benchmark/serving.py``) for a set of them: output tokens/s over the
run's wall time, TTFT / TPOT percentiles in ms, and the acceptance length, acceptance
rate and per-position acceptance from the summed counters (definitions of
:mod:`eagle3.evaluate.metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from eagle3.evaluate.metrics import conditional_acceptance, is_loop, longest_loop, per_position_acceptance


@dataclass
class RequestRecord:
    """One streamed request (one turn of one prompt).

    ``ttft_s`` / ``latency_s``: seconds from sending to the first chunk with output /
    to the last chunk; ``output_ids``: the generated target ids; the ``spec_*`` fields
    are SGLang's ``meta_info`` counters (None from a server that does not report them).
    """

    benchmark: str
    sample_id: str
    turn: int
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    latency_s: float
    output_ids: list[int]
    spec_verify_ct: Optional[int] = None
    spec_num_correct_drafts: Optional[int] = None
    spec_num_proposed_drafts: Optional[int] = None
    spec_correct_drafts_histogram: Optional[list[int]] = None

    @property
    def tpot_s(self) -> Optional[float]:
        """Seconds per output token after the first (None for a one-token answer)."""
        n = self.completion_tokens
        return (self.latency_s - self.ttft_s) / (n - 1) if n > 1 else None


def percentiles_ms(values: list[float]) -> dict[str, Optional[float]]:
    """mean / p50 / p90 / p99 of seconds, in ms (numpy's linear percentiles, as
    ``bench_serving``); ``None`` for an empty list."""
    import numpy as np

    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64) * 1000.0
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def padded_histogram(histogram: list[int], num_steps: int | None) -> list[int]:
    """SGLang's ``spec_correct_drafts_histogram`` only grows to the largest count seen;
    pad it to ``num_steps + 1`` entries (``h[j]``, ``j = 0 .. num_steps``)."""
    h = [int(v) for v in histogram]
    if num_steps is not None and len(h) < num_steps + 1:
        h += [0] * (num_steps + 1 - len(h))
    return h


def summarize(records: list[RequestRecord], duration_s: float, positions: int | None = None) -> dict:
    """Throughput, latency percentiles and speculative counters of one run
    (``positions``: draft depth for the per-position acceptance)."""
    n_tok = sum(r.completion_tokens for r in records)
    out: dict[str, Any] = {
        "requests": len(records),
        "duration_s": duration_s,
        "output_tokens": n_tok,
        "output_tokens_per_s": n_tok / duration_s if duration_s > 0 else None,
        "request_throughput": len(records) / duration_s if duration_s > 0 else None,
        "ttft_ms": percentiles_ms([r.ttft_s for r in records]),
        "tpot_ms": percentiles_ms([r.tpot_s for r in records if r.tpot_s is not None]),
    }
    with_ct = [r for r in records if r.spec_verify_ct]
    out["requests_with_spec_verify_ct"] = len(with_ct)
    if with_ct:
        passes = sum(r.spec_verify_ct for r in with_ct)
        toks = sum(r.completion_tokens for r in with_ct)
        out["verify_passes"] = passes
        out["acceptance_length"] = toks / passes
        out["acceptance_length_verify_only"] = (toks - len(with_ct)) / passes
        prop = sum(r.spec_num_proposed_drafts or 0 for r in with_ct)
        corr = sum(r.spec_num_correct_drafts or 0 for r in with_ct)
        out["acceptance_rate"] = corr / prop if prop else None
        out["accepted_drafts"] = corr
        out["proposed_drafts"] = prop
        hist: list[int] = []
        for r in with_ct:
            for j, c in enumerate(r.spec_correct_drafts_histogram or []):
                if j >= len(hist):
                    hist.extend([0] * (j + 1 - len(hist)))
                hist[j] += int(c)
        if hist:
            hist = padded_histogram(hist, positions)
            out["accept_histogram"] = hist
            out["per_position_acceptance"] = per_position_acceptance(hist)
            out["conditional_acceptance"] = conditional_acceptance(hist)
        else:
            out["accept_histogram"] = out["per_position_acceptance"] = out["conditional_acceptance"] = None
        clean = [r for r in with_ct if not is_loop(r.output_ids, longest_loop(r.output_ids)[0])]
        cp = sum(r.spec_verify_ct for r in clean)
        out["acceptance_length_non_looping"] = sum(r.completion_tokens for r in clean) / cp if cp else None
    return out
