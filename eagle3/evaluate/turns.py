"""One decoded turn as every backend's measures see it, and the measures written once over it.

Each backend keeps its own raw record for its logs (in process
:class:`eagle3.evaluate.inprocess.records.TurnRecord`, SGLang
:class:`eagle3.evaluate.measures.RequestRecord` pairs, vLLM
:class:`eagle3.evaluate.vllm.measure.Pair`) and turns it into :class:`DecodedTurn` s for the
measures shared by all three: tau's bootstrap interval over prompts (:func:`tau_interval`),
the pooled speed-up with its interval (:func:`pooled_turn_speedup`) and the lossless check
with its near-tie count (:func:`lossless_turns`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from eagle3.evaluate.measures import Pairs, first_difference, pooled_ratio_interval, pooled_speedup


@dataclass
class DecodedTurn:
    """One turn of one prompt, decoded speculatively and by the baseline.

    Attributes:
        benchmark, sample_id, turn: which turn (``turn`` 0-based).
        spec_ids, base_ids: the two outputs' target ids (None: that side has no such turn,
            e.g. a conversation one server cut short).
        spec_tokens, base_tokens: output token counts (a server's ``completion_tokens``).
        spec_seconds, base_seconds: wall seconds of the two decodings / requests.
        tau_num, tau_den: this turn's share of tau = sum(num) / sum(den): emitted tokens and
            verify passes (in process; SGLang ``completion_tokens`` / ``spec_verify_ct``) or
            ``drafts + accepted`` / ``drafts`` (vLLM counters); ``tau_den`` None where the
            backend reported nothing for the turn (it is then left out of tau's interval).
        tie: a greedy mismatch diagnosed as a rounding near-tie of the target's top two
            tokens (False when undiagnosed).
        diagnosis: the backend's own mismatch fields (e.g. in-process ``diagnose_mismatch``), or None.
    """

    benchmark: str
    sample_id: str
    turn: int
    spec_ids: Optional[list[int]]
    base_ids: Optional[list[int]]
    spec_tokens: int = 0
    base_tokens: int = 0
    spec_seconds: float = 0.0
    base_seconds: float = 0.0
    tau_num: Optional[float] = None
    tau_den: Optional[float] = None
    tie: bool = False
    diagnosis: Optional[dict] = None

    @property
    def first_diff(self) -> Optional[int]:
        """The first output position whose ids differ (0 when a side is missing), None when equal."""
        if self.spec_ids is None or self.base_ids is None:
            return 0
        return first_difference(self.base_ids, self.spec_ids)

    @property
    def match(self) -> bool:
        """Whether both outputs are the same ids (the lossless check of one turn)."""
        return self.first_diff is None


def _by_prompt(turns: Sequence[DecodedTurn]) -> dict[str, list[DecodedTurn]]:
    out: dict[str, list[DecodedTurn]] = {}
    for t in turns:
        out.setdefault(t.sample_id, []).append(t)
    return out


def tau_interval(turns: Sequence[DecodedTurn], seed: int = 0) -> Optional[list[float]]:
    """Bootstrap 95% interval over prompts of tau (each prompt's ``tau_num`` / ``tau_den``
    summed over its turns that report them; :func:`eagle3.evaluate.measures.pooled_ratio_interval`);
    None below 2 such prompts."""
    rows: dict[str, list[float]] = {}
    for t in turns:
        if t.tau_den is not None:
            row = rows.setdefault(t.sample_id, [0.0, 0.0])
            row[0] += t.tau_num or 0
            row[1] += t.tau_den
    return pooled_ratio_interval(list(rows.values()), seed=seed)


def pooled_turn_speedup(turns: Sequence[DecodedTurn], resamples: int = 2000, level: float = 0.95,
                        seed: int = 0) -> dict:
    """The pooled-rate speed-up and its bootstrap interval over prompts
    (:func:`eagle3.evaluate.measures.pooled_speedup` of each prompt's tokens and seconds
    of both sides, summed over its turns)."""
    rows = [[sum(t.base_tokens for t in ts), sum(t.base_seconds for t in ts),
             sum(t.spec_tokens for t in ts), sum(t.spec_seconds for t in ts)] for ts in _by_prompt(turns).values()]
    return pooled_speedup(rows, resamples, level, seed)


@dataclass
class Lossless:
    """The lossless check over prompts: ``matches`` of ``checked`` prompts had every turn
    equal; ``near_ties`` of the others differ only at diagnosed near-ties; ``mismatched``:
    every differing turn, in the turns' order."""

    matches: int
    checked: int
    near_ties: int
    mismatched: list[DecodedTurn]


def lossless_turns(turns: Sequence[DecodedTurn]) -> Lossless:
    """A prompt matches when every one of its turns does (later turns carry earlier answers,
    so each turn is a comparison of its own); a mismatching prompt is a near tie when every
    differing turn is (``tie``)."""
    matches = near = 0
    prompts = _by_prompt(turns)
    for ts in prompts.values():
        diff = [t for t in ts if not t.match]
        matches += not diff
        near += bool(diff) and all(t.tie for t in diff)
    return Lossless(matches, len(prompts), near, [t for t in turns if not t.match])


def served_turn(b: Any, s: Any, missing: bool = False) -> DecodedTurn:
    """One SGLang turn from its baseline record ``b`` and speculative record ``s`` (either
    None where that side has no such turn: both outputs then read ``[]``, or None when
    ``missing`` marks the turn as the prompt's mismatch)."""
    r = b if b is not None else s
    gone: Optional[list[int]] = None if missing else []
    diag = getattr(b, "diagnosis", None) if b is not None else None
    return DecodedTurn(
        r.benchmark, r.sample_id, r.turn,
        s.output_ids if b is not None and s is not None else gone,
        b.output_ids if b is not None and s is not None else gone,
        s.completion_tokens if s is not None else 0, b.completion_tokens if b is not None else 0,
        s.latency_s if s is not None else 0.0, b.latency_s if b is not None else 0.0,
        s.completion_tokens if s is not None and s.spec_verify_ct else None,
        s.spec_verify_ct if s is not None and s.spec_verify_ct else None,
        bool((diag or {}).get("tie")), diag)


def served_pair_turns(pairs: Sequence[tuple[list[Any], list[Any]]]) -> list[DecodedTurn]:
    """SGLang's batch-1 pairs (per prompt, the baseline's and the speculative server's
    :class:`eagle3.evaluate.measures.RequestRecord` s, turn by turn) as decoded turns. The
    turns only one side ran count for that side's tokens and seconds; when the two sides
    agree wherever both ran, the first of them is the prompt's mismatch (no outputs)."""
    out = []
    for base, spec in pairs:
        got = [served_turn(b, s) for b, s in zip(base, spec)]
        ok = all(t.match for t in got)
        extra = [(b, None) for b in base[len(spec):]] + [(None, s) for s in spec[len(base):]]
        out += got + [served_turn(b, s, missing=ok and k == 0) for k, (b, s) in enumerate(extra)]
    return out


def paired_speedup(pairs: Pairs, resamples: int = 2000, level: float = 0.95, seed: int = 0) -> dict:
    """Speed-up of batch-1 requests sent to both servers prompt by prompt, with a
    bootstrap interval over prompts.

    The point estimate is the ratio of the pooled output rates, (sum of speculative
    tokens / sum of speculative request seconds) / (the same for the baseline), request
    seconds measured from sending to the last streamed chunk (prefill included, as
    ``sglang.bench_serving`` times a request). The interval is the percentile bootstrap
    (Efron & Tibshirani 1993, ch. 13): ``resamples`` draws of the prompts with
    replacement (numpy generator seeded with ``seed``), the same ratio on each draw, the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles.

    Returns:
        ``{"speedup", "interval": [lo, hi] | None, "level", "resamples", "prompts",
        "tokens_per_s_base", "tokens_per_s_spec", "significant"}``; ``significant`` is
        True when the interval excludes 1.0 (a speed-up, or a slow-down, beyond the
        prompt-to-prompt noise), None without an interval (fewer than 2 prompts).
    """
    return pooled_turn_speedup(served_pair_turns(pairs), resamples, level, seed)


def lossless_check(pairs: Pairs) -> dict:
    """Whether the speculative server's greedy output equals the baseline's, per prompt.

    A prompt matches when every turn's output ids are equal. Every differing turn is listed:
    later turns carry the baseline's decoded earlier answers, so each turn is a comparison
    of its own, and a prompt counts as a near tie only when all its differing turns are
    (as the in-process check, :func:`eagle3.evaluate.inprocess.records.summarize_benchmark`).

    Returns:
        ``{"matches", "checked", "near_ties", "mismatches": [{"sample_id", "turn",
        "first_diff", "baseline_tokens", "speculative_tokens"[, "logit_gap", "tie"]}]}``;
        ``first_diff`` is the first output position whose ids differ (the shorter length
        when one output is a prefix of the other); ``logit_gap`` / ``tie`` where
        :func:`eagle3.evaluate.sglang.sweeps.diagnose_mismatches` set a ``diagnosis`` on
        the baseline record; ``near_ties`` counts the mismatching prompts whose every
        differing turn is a tie.
    """
    ll = lossless_turns(served_pair_turns(pairs))
    mismatches = [{"sample_id": t.sample_id, "turn": t.turn, "first_diff": 0, "baseline_tokens": None,
                   "speculative_tokens": None} if t.spec_ids is None else
                  {"sample_id": t.sample_id, "turn": t.turn, "first_diff": t.first_diff,
                   "baseline_tokens": len(t.base_ids), "speculative_tokens": len(t.spec_ids), **(t.diagnosis or {})}
                  for t in ll.mismatched]
    return {"matches": ll.matches, "checked": ll.checked, "mismatches": mismatches, "near_ties": ll.near_ties}
