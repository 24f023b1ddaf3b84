"""Measures of a speculative-decoding run and the verdict drawn from them.

Acceptance (SGLang's definitions, per-request ``meta_info`` fields in brackets):

* acceptance length ``tau`` = tokens emitted by verify passes / verify passes, bonus
  token included (``completion_tokens / spec_verify_ct``; see
  :mod:`eagle3.spec.decoder` for the prefill token, which the hf engine leaves out);
* acceptance rate = accepted drafts / (verify passes x ``num_steps``)
  (``spec_num_correct_drafts / spec_num_proposed_drafts``);
* accept histogram ``h[j]`` = verify passes that accepted exactly ``j`` drafts
  (``spec_correct_drafts_histogram``) and the per-position acceptance
  ``P(accepted >= i)`` for draft position ``i = 1 .. num_steps``.

Diversity, because repetitive outputs inflate tau: distinct-n (unique n-grams / n-grams
within one output, averaged over outputs) and the longest *loop*: the longest span of
an output that repeats one pattern of at most ``max_period`` tokens at least twice in
a row. An output loops when that span covers at least ``LOOP_MIN_TOKENS`` tokens and
a quarter of the output.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

import numpy as np

#: tau below this: the drafter accepts (almost) nothing.
TAU_ACCEPTS_NOTHING = 1.1
#: a looping output repeats a pattern over at least this many tokens ...
LOOP_MIN_TOKENS = 32
#: ... and over at least this fraction of the output.
LOOP_MIN_FRACTION = 0.25
#: a benchmark is flagged for loops when at least this fraction of outputs loop.
LOOP_FLAG_FRACTION = 0.2


# ----------------------------------------------------------------------------- acceptance
def accept_histogram(accept_counts: Iterable[int], num_steps: int) -> list[int]:
    """``h[j]`` = passes that accepted exactly ``j`` drafts, ``j = 0 .. num_steps``.

    Raises:
        ValueError: a count outside ``0 .. num_steps``.
    """
    h = [0] * (num_steps + 1)
    for a in accept_counts:
        if not 0 <= a <= num_steps:
            raise ValueError(f"a verify pass accepted {a} drafts; expected 0..{num_steps}")
        h[a] += 1
    return h


def per_position_acceptance(histogram: Sequence[int]) -> list[float]:
    """Fraction of verify passes whose draft position ``i`` was accepted (``i = 1 .. len-1``).

    Position ``i`` is accepted iff the pass accepted at least ``i`` drafts, so the
    list is non-increasing. Empty when there was no pass.
    """
    total = sum(histogram)
    if not total:
        return []
    return [sum(histogram[i:]) / total for i in range(1, len(histogram))]


def conditional_acceptance(histogram: Sequence[int]) -> list[Optional[float]]:
    """``P(position i accepted | position i-1 accepted)`` for ``i = 1 .. len-1``
    (``None`` where the previous position was never accepted)."""
    reach = [sum(histogram[i:]) for i in range(len(histogram))]
    return [reach[i] / reach[i - 1] if reach[i - 1] else None for i in range(1, len(histogram))]


def acceptance_summary(
    verify_passes: int, emitted: int, accept_counts: Sequence[int], num_steps: int
) -> dict:
    """Acceptance measures of a set of generations.

    Args:
        verify_passes: total verify passes.
        emitted: total tokens emitted by verify passes (bonus included).
        accept_counts: drafts accepted by every pass (any order).
        num_steps: draft depth (``speculative.num_steps``).

    Returns:
        ``{acceptance_length, acceptance_rate, verify_passes, generated_tokens,
        accepted_drafts, proposed_drafts, accept_histogram, per_position_acceptance,
        conditional_acceptance}``; rates are ``None`` without a pass.
    """
    hist = accept_histogram(accept_counts, num_steps)
    accepted = int(sum(accept_counts))
    proposed = verify_passes * num_steps
    return {
        "acceptance_length": emitted / verify_passes if verify_passes else None,
        "acceptance_rate": accepted / proposed if proposed else None,
        "verify_passes": int(verify_passes),
        "generated_tokens": int(emitted),
        "accepted_drafts": accepted,
        "proposed_drafts": int(proposed),
        "accept_histogram": hist,
        "per_position_acceptance": per_position_acceptance(hist),
        "conditional_acceptance": conditional_acceptance(hist),
    }


# ----------------------------------------------------------------------------- diversity
def distinct_n(tokens: Sequence[int], n: int) -> Optional[float]:
    """Unique n-grams / n-grams of one sequence (``None`` if shorter than ``n``)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def longest_loop(tokens: Sequence[int], max_period: int = 64) -> tuple[int, int]:
    """Longest span that repeats one pattern at least twice in a row.

    A span ``tokens[i : i + s]`` loops with period ``p`` when ``tokens[j] ==
    tokens[j + p]`` for all ``i <= j < i + s - p`` and ``s >= 2p``.

    Args:
        tokens: one output.
        max_period: longest pattern considered.

    Returns:
        ``(span, period)``; ``(0, 0)`` when nothing repeats.
    """
    a = np.asarray(tokens, dtype=np.int64)
    n = a.size
    best = (0, 0)
    for p in range(1, min(max_period, n // 2) + 1):
        eq = a[p:] == a[:-p]  # [n - p]
        if not eq.any():
            continue
        # longest run of True
        padded = np.concatenate([[False], eq, [False]])
        edges = np.flatnonzero(padded[1:] != padded[:-1])
        runs = edges[1::2] - edges[::2]
        r = int(runs.max())
        if r >= p and r + p > best[0]:
            best = (r + p, p)
    return best


def is_loop(tokens: Sequence[int], span: int) -> bool:
    """The loop rule of this module for an output with longest loop ``span``."""
    return span >= LOOP_MIN_TOKENS and span >= LOOP_MIN_FRACTION * len(tokens)


def diversity(outputs: Sequence[Sequence[int]]) -> dict:
    """Diversity of a benchmark's outputs (token ids).

    Returns:
        ``{distinct_1, distinct_2 (means over outputs), longest_loop_mean,
        longest_loop_max (tokens), looping_outputs, loop_fraction, loops (bool flag)}``.
    """
    d1 = [v for v in (distinct_n(o, 1) for o in outputs) if v is not None]
    d2 = [v for v in (distinct_n(o, 2) for o in outputs) if v is not None]
    loops = [longest_loop(o)[0] for o in outputs]
    looping = sum(is_loop(o, s) for o, s in zip(outputs, loops))
    frac = looping / len(outputs) if outputs else 0.0
    return {
        "distinct_1": float(np.mean(d1)) if d1 else None,
        "distinct_2": float(np.mean(d2)) if d2 else None,
        "longest_loop_mean": float(np.mean(loops)) if loops else None,
        "longest_loop_max": int(max(loops)) if loops else None,
        "looping_outputs": int(looping),
        "loop_fraction": frac,
        "loops": bool(outputs) and frac >= LOOP_FLAG_FRACTION,
    }


# ----------------------------------------------------------------------------- throughput
def tokens_per_second(tokens: int, seconds: float) -> Optional[float]:
    """``tokens / seconds`` (None without measured time)."""
    return tokens / seconds if seconds > 0 else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a / b`` (None when either is missing or ``b`` is 0), e.g. a speed-up."""
    return a / b if a is not None and b else None


# ----------------------------------------------------------------------------- verdict
def _finite(x: Any) -> Optional[float]:
    """``x`` as a float, or None when it is missing or not a finite number (a failed timing)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def verdict(bench: dict, spec_cap: Optional[int] = None) -> tuple[str, list[str]]:
    """Short verdict and explanations for one benchmark's results.

    Reads ``acceptance_length``, ``speedup`` and ``speedup_interval`` (a missing or
    non-finite value, a failed timing, is treated as not measured), ``diversity.loops``,
    ``lossless_matches``/``lossless_checked``/``lossless_near_ties`` and, from a served run, the
    ``concurrency`` table (``speedup`` per ``concurrency``). ``spec_cap`` is the
    speculative server's effective ``max_running_requests`` when known.

    Returns:
        ``(verdict, notes)``: ``verdict`` is ``"OK"`` or the comma-joined codes
        ``accepts-nothing``, ``slower`` (below 1, and the interval too when there is one),
        ``no-speedup`` (the speed-up's 95% interval contains 1.0: neither a gain nor a loss can
        be claimed, so the drafter is not worth serving at this setting),
        ``timing-noise`` (a speed-up above tau: impossible, so the timings are wrong), ``throttled`` (losses above the server's running-request cap,
        or at high load with the cap unknown), ``compute-bound`` (losses at high load under a known cap
        that was not reached), ``loops``, ``not-lossless``
        (mismatches with the target's greedy output beyond ``lossless_near_ties``);
        ``notes`` says what each means and what to check.
    """
    codes, notes = [], []
    tau = bench.get("acceptance_length")
    sp = _finite(bench.get("speedup"))
    if tau is not None and not math.isnan(tau) and tau < TAU_ACCEPTS_NOTHING:
        codes.append("accepts-nothing")
        notes.append(
            f"tau {tau:.2f} means the drafter accepts nothing: check the aux layer ids, d2t and the feature "
            "source (were features extracted from the served target and quantization?)"
        )
    if bench.get("speedup") is not None and sp is None:
        codes.append("no-speedup")
        notes.append(f"the speed-up {bench.get('speedup')!r} is not a number: a timing failed, so nothing is claimed; "
                     "rerun the evaluation")
    iv = bench.get("speedup_interval")
    iv = list(iv) if iv is not None and len(iv) == 2 and all(_finite(x) is not None for x in iv) else None
    if sp is not None and sp < 1.0 and not (iv and iv[1] >= 1.0):
        codes.append("slower")
        notes.append(f"speed-up {sp:.2f} < 1: speculation costs more than it saves here")
    elif sp is not None and iv and iv[0] <= 1.0 <= iv[1]:
        codes.append("no-speedup")
        notes.append(f"speed-up {sp:.2f} has the 95% interval [{iv[0]:.2f}, {iv[1]:.2f}], which contains 1.0: "
                     "no speed-up (or slow-down) can be claimed")
    if sp is not None and tau is not None and not math.isnan(tau) and sp > tau:
        # a round emits tau tokens on average and costs at least one target step (its verify pass)
        codes.append("timing-noise")
        notes.append(f"speed-up {sp:.2f} exceeds tau {tau:.2f}, which no speculative decoder can do (each verify "
                     "pass emits tau tokens and costs at least one target step): the timings are noise (the load "
                     "on the machine changed between the two decodings); rerun on an idle machine")
    _load_verdict(bench, tau, spec_cap, codes, notes)
    div = bench.get("diversity") or {}
    if div.get("loops"):
        codes.append("loops")
        notes.append(
            f"{div.get('looping_outputs')} outputs loop (longest repeated span up to "
            f"{div.get('longest_loop_max')} tokens): repetition inflates tau"
            + (
                f"; tau without them {bench['acceptance_length_non_looping']:.2f}"
                if bench.get("acceptance_length_non_looping") is not None
                else ""
            )
        )
    matches, n = bench.get("lossless_matches"), bench.get("lossless_checked")
    ties = min(bench.get("lossless_near_ties") or 0, (n or 0) - (matches or 0))  # ties are among the mismatches
    if matches is not None and n and matches < n:
        if matches + ties < n:
            codes.append("not-lossless")
            notes.append(
                f"only {matches}/{n} prompts decode to the target's own greedy tokens and {n - matches - ties} of "
                "the differences are not rounding ties: speculative decoding changed the output (a bug)"
            )
        else:
            notes.append(
                f"{matches}/{n} prompts decode exactly to the target's own greedy tokens; the other {ties} first "
                "differ where the target's two best logits tie within rounding or within their drift between a "
                "prefill and verify passes of the target (a batched verify pass rounds differently from a "
                "one-token step), which is not a loss"
            )
    return (", ".join(codes) if codes else "OK"), notes


def _load_verdict(bench: dict, tau: Optional[float], spec_cap: Optional[int], codes: list[str], notes: list[str]) -> None:
    """The served-load part of :func:`verdict`: ``throttled`` or ``compute-bound`` (appended in place)."""
    rows = sorted(
        (r for r in (bench.get("concurrency") or []) if r.get("speedup") is not None),
        key=lambda r: int(r["concurrency"]),
    )
    good_tau = tau is not None and not math.isnan(tau) and tau >= 1.5
    if good_tau and rows:
        slow = [int(r["concurrency"]) for r in rows if r["speedup"] < 1.0]
        over_cap = [c for c in slow if spec_cap is not None and c > spec_cap]
        drops = rows[0]["speedup"] >= 1.0 and slow  # gains at low load, losses at high load
        if over_cap or (drops and spec_cap is None):
            codes.append("throttled")
            notes.append(
                f"tau {tau:.2f} is fine but throughput falls below the baseline at concurrency {slow}"
                + (f", above the {spec_cap} running requests the speculative server admits" if over_cap else
                   " (the speculative server's running-request cap is unknown)")
                + ": a throttled server, not a bad drafter (set --max-running-requests and --cuda-graph-max-bs "
                "explicitly and compare with /server_info)"
            )
        elif drops:  # the cap is known and not reached: the device, not the server, sets the limit
            codes.append("compute-bound")
            notes.append(
                f"tau {tau:.2f} pays at low load but throughput falls below the baseline at concurrency {slow}, "
                f"although the speculative server admits {spec_cap} running requests: not a throttled server; at "
                "that batch the verify passes' extra work costs more than the accepted drafts save (expected on a "
                "compute-bound device)"
            )
