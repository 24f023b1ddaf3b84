"""The number of speculative tokens to run at each batch size, derived from served measurements.

A served run of a chain of ``k`` speculative tokens (``k = 0``: speculation off) at
concurrency ``B`` measures its output tokens/s ``T(B, k)`` and, from the server's own
counters, its tau (tokens per verify pass, ``1 + accepted / drafts``; 1 with speculation
off) and per-position acceptance ``a_i`` (accepted at draft position ``i`` / drafts, vLLM's
``spec_decode_num_accepted_tokens_per_pos``). Every verify pass of every running request
yields tau tokens, so ``T / tau`` is the rate of request-steps, and its inverse

    c(B, k) = tau(B, k) / T(B, k)     (seconds per request-step)

is what one verify pass of ``k`` drafted tokens (the ``k`` draft forwards included) costs a
request at batch ``B``: read from the runs, not assumed. The expected throughput of any ``k``
up to the longest chain measured is then

    T*(B, k) = tau*(k) / c*(B, k),    tau*(k) = 1 + sum_{i < k} a_i,

with ``c*`` interpolated linearly in ``k`` between the measured chains (a verify pass scores
``B (1 + k)`` tokens and the drafter runs ``k`` times, both linear in ``k``) and ``a_i`` from
the longest chain measured at ``B``: a chain's first ``k`` positions are proposed and
accepted exactly as a shorter chain's are (greedy verification; the EAGLE papers' chain
acceptance), so ``tau*(k)`` of a measured ``k`` equals its measured tau up to noise, and at a
measured ``k`` the prediction is the measurement itself. No ``k`` beyond the longest measured
chain is predicted (nothing measured bounds its cost).

The best ``k`` per measured concurrency becomes a schedule of batch-size bands
(:mod:`eagle3.schedule.bands`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass(frozen=True)
class ChainPoint:
    """One served measurement: ``num_steps`` speculative tokens (0 = off) at ``concurrency``.

    ``tokens_per_s``: output tokens / wall seconds of the run; ``tau``: 1 + accepted / drafts
    from the server's counters (1.0 with speculation off); ``per_position``: accepted at
    draft position ``i`` / drafts, ``num_steps`` entries (empty with speculation off).
    """

    concurrency: int
    num_steps: int
    tokens_per_s: float
    tau: float = 1.0
    per_position: tuple[float, ...] = ()

    @property
    def step_cost_s(self) -> float:
        """Seconds per request-step, ``tau / tokens_per_s`` (see the module docstring)."""
        return float(self.tau) / float(self.tokens_per_s)


@dataclass
class Choice:
    """The schedule's pick at one concurrency: ``num_steps`` and every candidate's prediction
    (``predicted``: ``{k: tokens/s}``, ``tau``: ``{k: tau*(k)}``)."""

    concurrency: int
    num_steps: int
    predicted: dict[int, float] = field(default_factory=dict)
    tau: dict[int, float] = field(default_factory=dict)


def check_points(points: Sequence[ChainPoint]) -> None:
    """Refuse measurements the derivation cannot use.

    Raises:
        ValueError: a non-positive throughput or concurrency, a negative ``num_steps``, a tau
            below 1, per-position acceptance of the wrong length or outside [0, 1], or a
            concurrency without a speculation-off point.
    """
    for p in points:
        if p.concurrency < 1 or p.num_steps < 0:
            raise ValueError(f"{p}: concurrency must be >= 1 and num_steps >= 0")
        if not p.tokens_per_s > 0:
            raise ValueError(f"{p}: tokens_per_s must be positive (a run that produced no tokens cannot be used)")
        if p.tau < 1.0:
            raise ValueError(f"{p}: tau is at least 1 (the verify pass's own token)")
        if p.num_steps and len(p.per_position) != p.num_steps:
            raise ValueError(f"{p}: per_position needs one acceptance per speculative token ({p.num_steps})")
        if any(not 0.0 <= a <= 1.0 for a in p.per_position):
            raise ValueError(f"{p}: per-position acceptance lies in [0, 1]")
    offs = {p.concurrency for p in points if p.num_steps == 0}
    missing = sorted({p.concurrency for p in points} - offs)
    if missing:
        raise ValueError(f"concurrency {missing} has no speculation-off run: the schedule compares against it")


def expected_tau(per_position: Sequence[float], k: int) -> float:
    """``1 + sum_{i < k} a_i``: tokens per verify pass of a chain of ``k`` (greedy chain acceptance).

    Raises:
        ValueError: ``k`` longer than ``per_position``.
    """
    if k > len(per_position):
        raise ValueError(f"per-position acceptance is known for {len(per_position)} positions, not {k}")
    return 1.0 + float(sum(per_position[:k]))


def _interpolated_cost(measured: dict[int, float], k: int) -> float:
    """``c*(B, k)``: linear in ``k`` between the nearest measured chains around it."""
    if k in measured:
        return measured[k]
    lo = max(m for m in measured if m < k)
    hi = min(m for m in measured if m > k)
    w = (k - lo) / (hi - lo)
    return (1.0 - w) * measured[lo] + w * measured[hi]


def predict(points: Sequence[ChainPoint], concurrency: int) -> Choice:
    """Predicted tokens/s of every ``k`` from 0 to the longest chain measured at ``concurrency``.

    Returns:
        a :class:`Choice` whose ``num_steps`` is the best ``k`` (ties go to the shorter chain).

    Raises:
        ValueError: as :func:`check_points`, or nothing measured at ``concurrency``.
    """
    at = [p for p in points if p.concurrency == concurrency]
    if not at:
        raise ValueError(f"nothing was measured at concurrency {concurrency}")
    check_points(at)
    cost: dict[int, float] = {}
    for k in sorted({p.num_steps for p in at}):  # repeated runs of one chain: their pooled cost
        same = [p for p in at if p.num_steps == k]
        cost[k] = sum(p.step_cost_s for p in same) / len(same)
    longest = max(cost)
    acc = [p for p in at if p.num_steps == longest][0].per_position if longest else ()
    choice = Choice(concurrency, 0)
    for k in range(longest + 1):
        tau = expected_tau(acc, k)
        choice.tau[k] = tau
        choice.predicted[k] = tau / _interpolated_cost(cost, k)
    choice.num_steps = max(choice.predicted, key=lambda k: (choice.predicted[k], -k))
    return choice


def derive(points: Sequence[ChainPoint], min_gain: float = 1.0) -> list[Choice]:
    """The best ``k`` at every measured concurrency, ascending.

    ``min_gain``: a ``k > 0`` is chosen only where its prediction is at least ``min_gain`` times
    speculation off's (1.0: whichever is faster; above 1, a margin against measurement noise).

    Raises:
        ValueError: as :func:`predict`, or ``min_gain`` below 1.
    """
    if min_gain < 1.0:
        raise ValueError(f"min_gain={min_gain}: a margin below 1 would speculate where off is faster")
    out = []
    for c in sorted({p.concurrency for p in points}):
        ch = predict(points, c)
        if ch.num_steps and ch.predicted[ch.num_steps] < min_gain * ch.predicted[0]:
            ch.num_steps = 0
        out.append(ch)
    return out


def crossover(choices: Sequence[Choice]) -> Optional[int]:
    """The lowest measured concurrency from which speculation is off at every higher one
    (None: the schedule speculates at the highest concurrency measured)."""
    last_on = max((c.concurrency for c in choices if c.num_steps > 0), default=None)
    later = [c.concurrency for c in choices if last_on is None or c.concurrency > last_on]
    return min(later) if later else None
