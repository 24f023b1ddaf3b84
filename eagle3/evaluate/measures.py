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

import contextlib
import gc
from dataclasses import dataclass
from typing import Any, Iterator, Optional

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


def prompt_limit(context_lengths: list[Optional[int]], max_new_tokens: int, max_prompt_tokens: Optional[int],
                 setting: str = "max_model_len") -> tuple[Optional[int], str]:
    """The longest prompt (tokens) both servers take with room for ``max_new_tokens``, and why.

    vLLM refuses a request whose prompt plus ``max_tokens`` exceeds its ``max_model_len``
    (HTTP 400); SGLang refuses a prompt that reaches its ``context_length`` and silently
    shortens ``max_new_tokens`` when prompt plus reply would pass it. Either way a turn
    longer than ``min(context lengths) - max_new_tokens`` is skipped rather than sent, so
    every measured reply may run to ``max_new_tokens``; ``max_prompt_tokens`` (the
    in-process engine's limit) applies too, so both evaluations measure the same turns.

    Args:
        context_lengths: each server's effective limit (None where unknown).
        setting: its name in the message (``max_model_len`` for vLLM, ``context_length``
            for SGLang).

    Returns:
        ``(limit or None, the setting it comes from)``, e.g. ``(1920, "the servers'
        max_model_len 2048 less max_new_tokens 128")``.
    """
    lens = [int(n) for n in context_lengths if n]
    cands: list[tuple[int, str]] = []
    if lens:
        cands.append((min(lens) - int(max_new_tokens),
                      f"the servers' {setting} {min(lens)} less max_new_tokens {int(max_new_tokens)}"))
    if max_prompt_tokens:
        cands.append((int(max_prompt_tokens), f"max_prompt_tokens={int(max_prompt_tokens)}"))
    if not cands:
        return None, ""
    return min(cands)


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


#: ``[(baseline records, speculative records)]``: one entry per prompt (its turns in order)
Pairs = list[tuple[list[RequestRecord], list[RequestRecord]]]


def pooled_speedup(a, resamples: int = 2000, level: float = 0.95, seed: int = 0) -> dict:
    """The pooled-rate speed-up of :func:`eagle3.evaluate.turns.paired_speedup` and its percentile bootstrap interval
    from a ``[n, 4]`` array of per-prompt baseline tokens, baseline seconds, speculative tokens,
    speculative seconds (served requests, or in-process decodings of the same prompts).

    Returns:
        The dict of :func:`eagle3.evaluate.turns.paired_speedup`.
    """
    import numpy as np

    a = np.asarray(a, dtype=np.float64).reshape(-1, 4)
    out: dict[str, Any] = {"prompts": int(a.shape[0]), "level": level, "resamples": int(resamples),
                           "speedup": None, "interval": None, "significant": None,
                           "tokens_per_s_base": None, "tokens_per_s_spec": None}
    if not a.shape[0] or a[:, 1].sum() <= 0 or a[:, 3].sum() <= 0 or a[:, 0].sum() <= 0:
        return out
    out["tokens_per_s_base"] = float(a[:, 0].sum() / a[:, 1].sum())
    out["tokens_per_s_spec"] = float(a[:, 2].sum() / a[:, 3].sum())
    out["speedup"] = out["tokens_per_s_spec"] / out["tokens_per_s_base"]
    if a.shape[0] < 2:
        return out
    idx = np.random.default_rng(seed).integers(0, a.shape[0], size=(int(resamples), a.shape[0]))
    s = a[idx].sum(axis=1)  # [resamples, 4]
    ok = (s[:, 0] > 0) & (s[:, 1] > 0) & (s[:, 3] > 0)
    ratios = (s[ok, 2] / s[ok, 3]) / (s[ok, 0] / s[ok, 1])
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    out["interval"] = [float(lo), float(hi)]
    out["significant"] = bool(lo > 1.0 or hi < 1.0)
    return out


def pooled_ratio_interval(rows, resamples: int = 2000, level: float = 0.95,
                          seed: int = 0) -> Optional[list[float]]:
    """Percentile bootstrap interval over prompts of a pooled ratio ``sum(num) / sum(den)``.

    Used for tau (acceptance length): each row is one prompt's emitted tokens and verify
    passes (in-process, SGLang's ``completion_tokens`` / ``spec_verify_ct``) or its
    ``drafts + accepted`` and ``drafts`` (vLLM's counters), summed over the prompt's turns,
    so a multi-turn prompt is one draw. Prompts are resampled with replacement
    (numpy generator seeded with ``seed``), as :func:`pooled_speedup` does.

    Args:
        rows: ``[n, 2]`` per-prompt (numerator, denominator), non-negative.
        resamples: bootstrap draws; level: two-sided coverage (0.95 = 95%).

    Returns:
        ``[lo, hi]``, or None with fewer than 2 prompts or a zero total denominator.
    """
    import numpy as np

    a = np.asarray(rows, dtype=np.float64).reshape(-1, 2)
    if a.shape[0] < 2 or a[:, 1].sum() <= 0:
        return None
    idx = np.random.default_rng(seed).integers(0, a.shape[0], size=(int(resamples), a.shape[0]))
    s = a[idx].sum(axis=1)  # [resamples, 2]
    ok = s[:, 1] > 0
    lo, hi = np.quantile(s[ok, 0] / s[ok, 1], [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


@contextlib.contextmanager
def gc_held() -> Iterator[None]:
    """Python's cyclic garbage collector held off while requests are timed.

    A collection with a large heap (torch, transformers and datasets imported) stops the
    client's threads for tens to hundreds of milliseconds; landing inside one request's
    latency it skews that prompt's tokens/s. Measured with the loopback SGLang fake
    (``tests/test_sglang_eval.py``, 6 prompts of 16 tokens at 40 ms a step): one prompt's
    speed-up fell from about 1.3 to 0.93, pulling the interval's lower end below 1, in 5 of
    7 runs with the collector on, in none of 6 with it off (3 runs off throughout, 3 held
    per prompt as here). Reference counting still
    frees everything acyclic while they run; the collections the held allocations call for
    run after the block, outside the timing (a full ``gc.collect()`` at every entry cost
    about 0.2 s each there).
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


#: a served greedy mismatch counts as a rounding near-tie when the baseline server's
#: log-probs of the two tokens differ by at most this (nats = logit units): two bf16 ulps
#: of logits in [16, 32), the magnitude SmolLM2's logits have (its returned log-probs
#: step by 0.125)
SERVED_TIE_GAP = 0.25


def served_tie(gap: Optional[float]) -> bool:
    """Whether a served greedy mismatch is a rounding near-tie: the baseline server's log-probs
    of the two tokens (nats) differ by at most :data:`SERVED_TIE_GAP` (False for None: the gap
    could not be read). The one rule of both served diagnoses
    (:func:`eagle3.evaluate.sglang.sweeps.diagnose_mismatches`,
    :func:`eagle3.evaluate.vllm.measure.diagnose_mismatches`)."""
    return gap is not None and gap <= SERVED_TIE_GAP


def system_messages(sample: dict) -> list[dict]:
    """The sample's system messages, which lead every turn's prompt (as in process:
    :func:`eagle3.evaluate.inprocess.decode._user_turns`)."""
    return [{"role": "system", "content": m["content"]} for m in sample["messages"] if m.get("role") == "system"]


def first_difference(a: list[int], b: list[int]) -> Optional[int]:
    """The first position where two id lists differ (the shorter length when one is a
    prefix of the other), or None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
