"""The requests of a vLLM served evaluation: batch-1 pairs and the concurrency sweep.

:func:`measure_pairs` sends every user turn of every benchmark prompt (its system messages
first) to the baseline and the speculative server one request at a time, the two in alternating order from
prompt to prompt (so drift of a shared machine hits both alike), with the same
rendered prompt ids (a later turn carries the *baseline's* decoded answer, so both
servers see identical prompts and the greedy outputs can be compared); the speculative
server's ``/metrics`` counters are read before and after each of its requests, which
makes the delta that request's own (nothing else runs on it). The pairs are also the
sweep's concurrency-1 row (:func:`pairs_as_sweep`).

:func:`sweep_concurrency` runs each benchmark's turn prompts on both servers with at most
``c`` requests in flight, baseline and speculative alternating which goes first, the
prefix cache reset before each run where the server allows it; the speculative server's
counter delta over the run gives its tau under load.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from eagle3.engines.vllm import Completion, SpecCounters, VLLMClient, spec_counters
from eagle3.evaluate.measures import first_difference, gc_held, served_tie, system_messages

log = logging.getLogger("eagle3")

ROLES = ("baseline", "speculative")


@dataclass
class Pair:
    """One turn sent to both servers at batch 1.

    ``prompt_ids``: the rendered prompt; ``base`` / ``spec``: the two answers;
    ``counters``: the speculative server's counter delta over its request; ``order``:
    which role went first.
    """

    benchmark: str
    sample_id: str
    turn: int
    prompt_ids: list[int]
    base: Completion
    spec: Completion
    counters: SpecCounters
    order: tuple[str, str] = ROLES


@dataclass
class SweepRun:
    """One server's run of one benchmark at one concurrency: answers, wall seconds, counter delta."""

    completions: list[Completion]
    duration_s: float
    counters: Optional[SpecCounters] = None
    order_index: int = 0  # 0 ran first, 1 second; -1 interleaved prompt by prompt (:func:`pairs_as_sweep`)

    @property
    def ran_first(self) -> Optional[bool]:
        """Whether this server's run went before the other's (None: interleaved, the pairs)."""
        return self.order_index == 0 if self.order_index >= 0 else None

    @property
    def output_tokens(self) -> int:
        """Completion tokens of the run."""
        return sum(c.completion_tokens for c in self.completions)


@dataclass
class Servers:
    """The two clients and the request body every completion shares."""

    baseline: VLLMClient
    speculative: VLLMClient
    body: dict = field(default_factory=dict)

    def client(self, role: str) -> VLLMClient:
        """The client of ``role`` (``baseline`` | ``speculative``)."""
        return self.baseline if role == "baseline" else self.speculative


def _user_turns(sample: dict) -> list[str]:
    return [m["content"] for m in sample["messages"] if m.get("role") == "user"]


def settled_counters(client: VLLMClient, tries: int = 10, pause_s: float = 0.05) -> SpecCounters:
    """The server's counters once two reads ``pause_s`` apart agree (the last engine step's
    stats may land just after the answer), at most ``tries`` reads."""
    last = spec_counters(client.metrics_text())
    for _ in range(tries - 1):
        time.sleep(pause_s)
        now = spec_counters(client.metrics_text())
        if now == last:
            return now
        last = now
    return last


def _one(servers: Servers, role: str, prompt: list[int]) -> tuple[Completion, Optional[SpecCounters]]:
    """One request; the speculative one between two ``/metrics`` reads."""
    client = servers.client(role)
    body = dict(servers.body, prompt=list(prompt))
    if role != "speculative":
        return client.complete(body), None
    before = settled_counters(client)
    res = client.complete(body)
    return res, settled_counters(client) - before


def warm_up(servers: Servers, prompt: list[int], n: int) -> None:
    """``n`` unmeasured requests of ``prompt`` to each server."""
    for _ in range(int(n)):
        for role in ROLES:
            servers.client(role).complete(dict(servers.body, prompt=list(prompt)))


def measure_pairs(servers: Servers, benchmarks: dict[str, list[dict]], render: Callable[[list[dict]], list[int]],
                  decode: Callable[[list[int]], str], max_prompt_tokens: Optional[int] = None,
                  why: str = "", warnings: Optional[list[str]] = None) -> dict[str, list[Pair]]:
    """Every turn of every prompt on both servers at batch 1, interleaved (see the module docstring).

    A turn whose rendered prompt is longer than ``max_prompt_tokens`` is not sent and ends
    its row (earlier turns are kept), as the in-process evaluation does; the count per
    benchmark goes to ``warnings`` with ``why`` (the limit's source,
    :func:`eagle3.evaluate.measures.prompt_limit`).

    Args:
        benchmarks: name -> rows with ``id`` and ``messages``.
        render: messages -> prompt ids (the target's chat template). decode: ids -> text.
        max_prompt_tokens: the longest prompt sent (tokens); None = no limit.

    Returns:
        ``{benchmark: [Pair, ...]}`` in prompt order; a benchmark none of whose prompts
        fits is left out.

    Raises:
        eagle3.errors.Eagle3Error: a request that keeps failing, or no prompt that fits.
    """
    from eagle3.errors import Eagle3Error
    from tqdm.auto import tqdm

    out: dict[str, list[Pair]] = {}
    total = sum(len(rows) for rows in benchmarks.values())
    bar = tqdm(total=total, desc="batch-1 pairs (baseline / speculative)", leave=False)
    k = 0
    for name, rows in benchmarks.items():
        out[name] = []
        skipped = 0
        for sample in rows:
            order = ROLES if k % 2 == 0 else ROLES[::-1]
            history: list[dict] = system_messages(sample)  # leading every turn, as in process
            for turn, text in enumerate(_user_turns(sample)):
                history.append({"role": "user", "content": text})
                prompt = render(history)
                if max_prompt_tokens is not None and len(prompt) > max_prompt_tokens:
                    skipped += 1
                    break
                with gc_held():  # no collector pause inside a timed request
                    got = {role: _one(servers, role, prompt) for role in order}
                out[name].append(Pair(name, str(sample["id"]), turn, prompt, got["baseline"][0], got["speculative"][0],
                                      got["speculative"][1], order))
                history.append({"role": "assistant", "content": decode(got["baseline"][0].output_ids)})
            k += 1
            bar.update(1)
        log.info("%s: %d turns measured at batch 1", name, len(out[name]))
        if skipped:
            msg = (f"{name}: {skipped} prompts longer than {max_prompt_tokens} tokens ({why}) were skipped"
                   + (" (a later turn ends its conversation there)" if any(len(_user_turns(r)) > 1 for r in rows) else ""))
            log.warning(msg)
            if warnings is not None:
                warnings.append(msg)
        if not out[name]:
            del out[name]
    bar.close()
    if not out:
        raise Eagle3Error(f"no benchmark prompt is {max_prompt_tokens} tokens or shorter ({why}); raise the servers' "
                          "engine.max_model_len or lower max_new_tokens")
    return out


def pairs_as_sweep(pairs: dict[str, list[Pair]]) -> dict[str, dict[str, SweepRun]]:
    """The batch-1 pairs in the shape of a concurrency-1 sweep row: ``{role: {benchmark: SweepRun}}``.

    Each role's run holds its answers of the pairs; its ``duration_s`` is the sum of their
    latencies (seconds; the requests ran one at a time, so this is the run's wall time less
    the other server's requests and the ``/metrics`` reads between them), and the
    speculative run's counters are the sum of the per-request deltas. A concurrency-1 run
    would send every turn again, one at a time, and measure the same thing a second time;
    the SGLang path does the same (:func:`eagle3.evaluate.sglang.evaluation.pairs_as_sweep`).
    ``order_index`` is -1: the two servers alternated which went first, prompt by prompt.
    """
    out: dict[str, dict[str, SweepRun]] = {r: {} for r in ROLES}
    for name, ps in pairs.items():
        counters = SpecCounters()
        for p in ps:
            counters = counters + p.counters
        out["baseline"][name] = SweepRun([p.base for p in ps], sum(p.base.latency_s for p in ps), None, -1)
        out["speculative"][name] = SweepRun([p.spec for p in ps], sum(p.spec.latency_s for p in ps), counters, -1)
    return out


def run_prompts(client: VLLMClient, body: dict, prompts: list[list[int]], c: int, counters: bool) -> SweepRun:
    """Every prompt in ``prompts`` on one server with at most ``c`` requests in flight, the prefix
    cache reset first where the server allows it; with ``counters`` the server's speculative
    counter delta over the run (nothing else may run on it meanwhile)."""
    client.reset_prefix_cache()
    before = settled_counters(client) if counters else None
    with gc_held(), ThreadPoolExecutor(max_workers=max(1, min(c, len(prompts)))) as pool:
        t0 = time.perf_counter()
        done = list(pool.map(lambda p: client.complete(dict(body, prompt=list(p))), prompts))
        dur = time.perf_counter() - t0
    delta = settled_counters(client) - before if before is not None else None
    return SweepRun(done, dur, delta)


def _run(servers: Servers, role: str, prompts: list[list[int]], c: int) -> SweepRun:
    return run_prompts(servers.client(role), servers.body, prompts, c, role == "speculative")


def sweep_concurrency(servers: Servers, prompts: dict[str, list[list[int]]],
                      concurrency: list[int]) -> dict[str, dict[int, dict[str, SweepRun]]]:
    """Both servers, every benchmark, every concurrency in ``concurrency`` (see the module
    docstring; concurrency 1 comes from the pairs instead, :func:`pairs_as_sweep`).

    Returns:
        ``{role: {c: {benchmark: SweepRun}}}``.
    """
    out: dict[str, dict[int, dict[str, SweepRun]]] = {r: {} for r in ROLES}
    k = 0
    for c in concurrency:
        for r in ROLES:
            out[r][c] = {}
        for name, ps in prompts.items():
            order = ROLES if k % 2 == 0 else ROLES[::-1]
            for i, role in enumerate(order):
                run = _run(servers, role, ps, c)
                run.order_index = i
                out[role][c][name] = run
                log.info("%s %s c=%d: %.1f output tok/s%s", role, name, c, run.output_tokens / run.duration_s,
                         f", tau {run.counters.tau:.2f}" if run.counters and run.counters.tau else "")
            k += 1
    return out


def _gap(entry: Any, a: int, b: int) -> Optional[float]:
    """``|logprob(a) - logprob(b)|`` from one ``prompt_logprobs`` entry (``{token id: {"logprob",
    ...}}``), or None when either token is not listed or a log-prob is not finite."""
    lp: dict[int, float] = {}
    for t, v in (entry or {}).items():
        try:
            lp[int(t)] = float(v["logprob"] if isinstance(v, dict) else v)
        except (TypeError, ValueError, KeyError):
            continue
    if a not in lp or b not in lp or not all(math.isfinite(lp[t]) for t in (a, b)):
        return None
    return abs(lp[a] - lp[b])


def diagnose_mismatches(client: VLLMClient, model: str, pairs: dict[str, list[Pair]],
                        top: int = 20) -> dict[tuple[str, str, int], dict]:
    """The baseline server's logit gap at the first greedy mismatch of every mismatching turn.

    For a turn whose speculative output ids first differ from the baseline's at a position
    ``i`` where both have a token: one request to the baseline server with
    ``prompt_logprobs`` (``top`` alternatives; vLLM also lists the prompt's own token) on the
    turn's prompt ids plus the baseline's output up to and including ``i``; its last entry
    is the server's distribution of that position. The gap is ``|logprob(baseline token) -
    logprob(speculative token)|`` (nats; equal to the logit gap, one softmax). Within
    :data:`eagle3.evaluate.measures.SERVED_TIE_GAP` the two tokens tie within
    rounding: a batched verify pass and a one-token decode step round differently
    (batch-variant kernels), which flips the argmax of near-equal logits without
    speculation changing anything. Every turn is asked (later turns carry the baseline's
    answers, so each turn is its own comparison), as the in-process check counts a prompt
    a tie only when all its differing turns are. The served analogue of the SGLang path's
    :func:`eagle3.evaluate.sglang.sweeps.diagnose_mismatches`.

    Returns:
        ``{(benchmark, sample_id, turn): {"position", "logit_gap", "tie"[, "error"]}}``;
        ``logit_gap`` None (and ``tie`` False) when one output ended first (a length
        difference is not a tie), when a token is not among the listed alternatives, or when
        the request failed (``error`` says why: the diagnosis never ends an evaluation).
    """
    from eagle3.engines.http import ServerUnavailable
    from eagle3.errors import Eagle3Error

    out: dict[tuple[str, str, int], dict] = {}
    for name, ps in pairs.items():
        for p in ps:
            b, s = p.base.output_ids, p.spec.output_ids
            i = first_difference(b, s)
            if i is None:
                continue
            row: dict[str, Any] = {"position": i, "logit_gap": None, "tie": False}
            out[(name, p.sample_id, p.turn)] = row
            if i >= len(b) or i >= len(s):
                continue
            try:
                ans = client.request("POST", "/v1/completions", {
                    "model": model, "prompt": list(p.prompt_ids) + list(b[: i + 1]), "max_tokens": 1,
                    "temperature": 0.0, "prompt_logprobs": int(top)})
            except (Eagle3Error, ServerUnavailable) as e:
                row["error"] = (f"the request for prompt_logprobs={top} failed ({e}); a server that refuses it "
                                f"needs --max-logprobs {top} or more")
                continue
            entries = ((ans.get("choices") or [{}])[0]).get("prompt_logprobs") or []
            if not entries or not entries[-1]:
                row["error"] = "the baseline server answered no prompt_logprobs at that position"
                continue
            row["logit_gap"] = _gap(entries[-1], b[i], s[i])
            row["tie"] = served_tie(row["logit_gap"])
    return out
