"""Per-turn records of the in-process (hf) evaluation and what is computed from them.

A :class:`TurnRecord` holds one evaluated turn: the speculative and the baseline token
sequences of one rendered prompt, their timings and the verify passes' accept counts.
:func:`summarize_benchmark` turns a benchmark's records into the report fields
(acceptance measures of :mod:`eagle3.evaluate.metrics`, tokens/s, speed-up, lossless
matches, diversity); :func:`overall_summary` does the same over all benchmarks;
:func:`write_samples` writes one JSON line per turn (``samples.jsonl``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from eagle3.evaluate.inprocess.teacher_forced import summarize_teacher_forced
from eagle3.evaluate.turns import DecodedTurn, lossless_turns, pooled_turn_speedup, tau_interval
from eagle3.evaluate.metrics import acceptance_summary, diversity, is_loop, longest_loop, ratio, tokens_per_second
from eagle3.spec import SpecSettings

SAMPLES_FILE = "samples.jsonl"


@dataclass
class TurnRecord:
    """One evaluated turn: speculative and baseline generation of one rendered prompt.

    Token lists are target ids, the first one from the prefill; seconds are wall-clock
    with device synchronisation (``*_prefill_seconds``: up to the first token).
    ``verify_passes`` and ``emitted`` (tokens emitted by verify passes, bonus included,
    so ``len(spec_tokens) = 1 + emitted``) and ``accept_counts`` (drafts accepted by
    each pass) come from :class:`eagle3.spec.GenerationResult`.
    """

    benchmark: str
    sample_id: str
    turn: int
    prompt_tokens: int
    spec_tokens: list[int]
    base_tokens: list[int]
    spec_seconds: float
    base_seconds: float
    spec_prefill_seconds: float
    base_prefill_seconds: float
    verify_passes: int
    emitted: int
    accept_counts: list[int] = field(default_factory=list)
    mismatch: Optional[dict] = None  # see diagnose_mismatch (temperature 0 only)
    teacher_forced: Optional[dict] = None  # see eagle3.evaluate.inprocess.teacher_forced.teacher_forced_turn

    @property
    def match(self) -> bool:
        """Whether both decodings produced the same tokens (the lossless check)."""
        return self.spec_tokens == self.base_tokens

    def decoded(self) -> DecodedTurn:
        """This turn as the shared measures read it (:class:`eagle3.evaluate.turns.DecodedTurn`:
        tau = emitted tokens / verify passes; the mismatch diagnosis as ``diagnosis``)."""
        return DecodedTurn(self.benchmark, self.sample_id, self.turn, self.spec_tokens, self.base_tokens,
                           len(self.spec_tokens), len(self.base_tokens), self.spec_seconds, self.base_seconds,
                           self.emitted, self.verify_passes, bool(self.mismatch and self.mismatch.get("tie")),
                           self.mismatch)


def summarize_benchmark(recs: Sequence[TurnRecord], settings: SpecSettings) -> dict:
    """Report fields of one benchmark from its turn records.

    Args:
        recs: the benchmark's turn records (any order).
        settings: the decoder's settings (``num_steps`` for the acceptance measures,
            ``greedy`` for the lossless check).

    Returns:
        :func:`eagle3.evaluate.metrics.acceptance_summary`'s keys plus tokens/s of both
        decodings (all tokens / all seconds) and their ``speedup``, the decode-only
        ``decode_tokens_per_s_*`` / ``decode_speedup`` (tokens after the first / seconds
        after the prefill), ``lossless_matches`` / ``lossless_checked`` /
        ``lossless_near_ties`` (prompts whose every turn matched; None unless greedy),
        ``first_mismatches``, ``diversity``, ``acceptance_length_non_looping``,
        ``teacher_forced`` (:func:`eagle3.evaluate.inprocess.teacher_forced.summarize_teacher_forced`),
        ``num_prompts``, ``num_turns``, ``output_tokens_spec`` / ``output_tokens_base``.

    Raises:
        ValueError: an accept count outside ``0 .. num_steps``.
    """
    passes = sum(r.verify_passes for r in recs)
    emitted = sum(r.emitted for r in recs)
    out = acceptance_summary(passes, emitted, [a for r in recs for a in r.accept_counts], settings.num_steps)
    spec_tok, base_tok = sum(len(r.spec_tokens) for r in recs), sum(len(r.base_tokens) for r in recs)
    out["tokens_per_s_spec"] = tokens_per_second(spec_tok, sum(r.spec_seconds for r in recs))
    out["tokens_per_s_base"] = tokens_per_second(base_tok, sum(r.base_seconds for r in recs))
    out["speedup"] = ratio(out["tokens_per_s_spec"], out["tokens_per_s_base"])
    turns = [r.decoded() for r in recs]
    out["speedup_interval"] = pooled_turn_speedup(turns)["interval"]
    out["acceptance_length_interval"] = tau_interval(turns)
    # decode only: tokens after the first / time after the prefill (the prefill is the same work in both)
    out["decode_tokens_per_s_spec"] = tokens_per_second(
        spec_tok - len(recs), sum(r.spec_seconds - r.spec_prefill_seconds for r in recs))
    out["decode_tokens_per_s_base"] = tokens_per_second(
        base_tok - len(recs), sum(r.base_seconds - r.base_prefill_seconds for r in recs))
    out["decode_speedup"] = ratio(out["decode_tokens_per_s_spec"], out["decode_tokens_per_s_base"])
    prompts = {r.sample_id for r in recs}
    out.update(_lossless(turns, settings.greedy))
    outputs = [r.spec_tokens for r in recs]
    out["diversity"] = diversity(outputs)
    clean = [r for r in recs if not is_loop(r.spec_tokens, longest_loop(r.spec_tokens)[0])]
    cp = sum(r.verify_passes for r in clean)
    out["acceptance_length_non_looping"] = sum(r.emitted for r in clean) / cp if cp else None
    out["teacher_forced"] = summarize_teacher_forced(recs)
    out["num_prompts"] = len(prompts)
    out["num_turns"] = len(recs)
    out["output_tokens_spec"] = spec_tok
    out["output_tokens_base"] = base_tok
    return out


def _lossless(turns: Sequence[DecodedTurn], greedy: bool) -> dict:
    """The lossless-check fields of :func:`summarize_benchmark` (None unless greedy;
    :func:`eagle3.evaluate.turns.lossless_turns`)."""
    if not greedy:
        return {"lossless_matches": None, "lossless_checked": None, "lossless_near_ties": None}
    ll = lossless_turns(turns)
    # up to 10 turns' first mismatches, those that are not ties first (the ones to look at)
    mism = [{"id": t.sample_id, "turn": t.turn, **(t.diagnosis or {})} for t in ll.mismatched]
    # near ties: prompts that differ only where the target's top two logits tie within rounding
    return {"lossless_matches": ll.matches, "lossless_checked": ll.checked, "lossless_near_ties": ll.near_ties,
            "first_mismatches": sorted(mism, key=lambda m: bool(m.get("tie")))[:10]}


def overall_summary(records: Sequence[TurnRecord], settings: SpecSettings) -> dict:
    """The report's ``overall`` entry: :func:`summarize_benchmark` over every
    benchmark's records, restricted to the headline keys."""
    s = summarize_benchmark(records, settings)
    keep = ("acceptance_length", "acceptance_rate", "verify_passes", "generated_tokens", "per_position_acceptance",
            "tokens_per_s_spec", "tokens_per_s_base", "speedup", "decode_speedup", "lossless_matches",
            "lossless_checked", "num_turns")
    return {k: s.get(k) for k in keep}


def write_samples(path: Path, records: Sequence[TurnRecord], decode: Callable[[list[int]], str]) -> None:
    """One JSON line per evaluated turn (atomic)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for r in records:
            span, period = longest_loop(r.spec_tokens)
            f.write(json.dumps({
                "benchmark": r.benchmark, "id": r.sample_id, "turn": r.turn, "prompt_tokens": r.prompt_tokens,
                "tokens_spec": len(r.spec_tokens), "tokens_base": len(r.base_tokens), "match": r.match,
                "verify_passes": r.verify_passes, "acceptance_length": r.emitted / r.verify_passes if r.verify_passes else None,
                "accept_counts": r.accept_counts, "seconds_spec": r.spec_seconds, "seconds_base": r.base_seconds,
                "prefill_seconds_spec": r.spec_prefill_seconds, "prefill_seconds_base": r.base_prefill_seconds,
                "mismatch": r.mismatch,
                "longest_loop": span, "loop_period": period, "text": decode(r.spec_tokens),
            }) + "\n")
    os.replace(tmp, path)
