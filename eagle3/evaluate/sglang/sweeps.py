"""Sending the benchmark prompts to the SGLang servers: paired at batch 1, then swept
over request concurrency.

:func:`run_conversation` sends the user turns of one prompt in order as streamed
``/generate`` requests (a later turn carries the decoded earlier answers, as MT-Bench
wants); :func:`interleave_batch1` sends every prompt to both servers one request at a
time, alternating which server goes first, so slow drift of the machine's speed hits
both alike; :func:`sweep_server` runs every benchmark at every concurrency on one server
with at most ``c`` prompts in flight, the cache flushed before each run.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from eagle3.engines import sglang as sg
from eagle3.evaluate.measures import Pairs, RequestRecord, gc_held, served_tie, summarize, system_messages
from eagle3.evaluate.sglang.servers import ROLES

log = logging.getLogger(__name__)


def _messages(sample: dict) -> list[dict]:
    msgs = sample["messages"]
    return [dict(m) for m in msgs]


def run_conversation(client: sg.SGLangClient, tokenizer, sample: dict, benchmark: str, sampling: dict,
                     max_prompt_tokens: Optional[int] = None, cuts: Optional[dict[str, set]] = None
                     ) -> list[RequestRecord]:
    """Send every user turn of ``sample`` in order (its system messages first; later turns
    carry the decoded earlier answers); one :class:`RequestRecord` per turn.

    A turn whose rendered prompt is longer than ``max_prompt_tokens`` (tokens;
    :func:`eagle3.evaluate.measures.prompt_limit`) is not sent and ends the
    conversation there (earlier turns are kept; none when it is the first); the sample id
    is then added to ``cuts[benchmark]``.

    Raises:
        eagle3.engines.sglang.ServerUnavailable: (an ``Eagle3Error``) a request that keeps
            failing after the client's retries.
    """
    from eagle3.target import render_prompt

    history: list[dict] = system_messages(sample)
    records = []
    turns = [m for m in _messages(sample) if m.get("role") == "user"]
    for i, user in enumerate(turns):
        history.append({"role": "user", "content": user["content"]})
        prompt = render_prompt(tokenizer, history)
        if max_prompt_tokens is not None and len(prompt) > max_prompt_tokens:
            if cuts is not None:
                cuts.setdefault(benchmark, set()).add(str(sample["id"]))
            break
        res = client.generate_stream({"input_ids": prompt, "sampling_params": dict(sampling)})
        meta = res.meta_info
        n = int(meta.get("completion_tokens", len(res.output_ids)))
        records.append(RequestRecord(
            benchmark=benchmark, sample_id=str(sample["id"]), turn=i, prompt_tokens=len(prompt),
            completion_tokens=n, ttft_s=res.ttft_s, latency_s=res.latency_s, output_ids=res.output_ids,
            spec_verify_ct=meta.get("spec_verify_ct"),
            spec_num_correct_drafts=meta.get("spec_num_correct_drafts"),
            spec_num_proposed_drafts=meta.get("spec_num_proposed_drafts"),
            spec_correct_drafts_histogram=meta.get("spec_correct_drafts_histogram"),
        ))
        if i + 1 < len(turns):
            history.append({"role": "assistant", "content": tokenizer.decode(res.output_ids, skip_special_tokens=True)})
    return records


def first_turn_fits(tokenizer, sample: dict, max_prompt_tokens: Optional[int]) -> bool:
    """Whether the rendered first user turn of ``sample`` (after its system messages) is at
    most ``max_prompt_tokens`` tokens (always, when None)."""
    from eagle3.target import render_prompt

    if max_prompt_tokens is None:
        return True
    first = [{"role": "user", "content": m["content"]} for m in _messages(sample) if m.get("role") == "user"][:1]
    return len(render_prompt(tokenizer, system_messages(sample) + first)) <= max_prompt_tokens


def _warm_up(client: sg.SGLangClient, tokenizer, benchmarks: dict[str, list[dict]], sampling: dict, warmup: int,
             role: str, max_prompt_tokens: Optional[int] = None) -> None:
    """Send the first prompt whose first turn fits ``max_prompt_tokens`` ``warmup`` times, unmeasured."""
    first = next((s for rows in benchmarks.values() for s in rows if first_turn_fits(tokenizer, s, max_prompt_tokens)),
                 None)
    if warmup and first is not None:
        warm = [first] * int(warmup)
        sg.run_parallel([client], warm,
                        lambda c, s: run_conversation(c, tokenizer, s, "warmup", sampling, max_prompt_tokens),
                        concurrency=min(len(warm), 4), desc=f"{role} warm-up", progress=False)


def interleave_batch1(clients: dict[str, sg.SGLangClient], tokenizer, benchmarks: dict[str, list[dict]],
                      sampling: dict, warmup: int, max_prompt_tokens: Optional[int] = None,
                      cuts: Optional[dict[str, set]] = None) -> dict[str, Pairs]:
    """Every prompt on both servers at batch 1, prompt by prompt: ``{benchmark: pairs}``.

    Both servers are up at once and only one request is in flight on the machine:
    prompt ``k`` (counted over all benchmarks) goes to the baseline first when ``k`` is
    even and to the speculative server first when it is odd. Each server is warmed up
    with ``warmup`` prompts and its cache flushed before the first measured prompt.

    Args:
        clients: ``{"baseline": client, "speculative": client}``.
        max_prompt_tokens, cuts: as for :func:`run_conversation` (a prompt whose first
            turn is too long makes no pair).

    Returns:
        per benchmark, one ``(baseline records, speculative records)`` pair per prompt
        (:data:`eagle3.evaluate.measures.Pairs`), for
        :func:`~eagle3.evaluate.turns.paired_speedup` and
        :func:`~eagle3.evaluate.turns.lossless_check`.

    Raises:
        eagle3.engines.sglang.ServerUnavailable: a request that keeps failing.
    """
    from tqdm.auto import tqdm

    for role in ROLES:
        _warm_up(clients[role], tokenizer, benchmarks, sampling, warmup, role, max_prompt_tokens)
        clients[role].flush_cache()
    out: dict[str, Pairs] = {}
    k = 0
    with tqdm(total=sum(len(r) for r in benchmarks.values()), desc="batch 1, interleaved", leave=False) as bar:
        for name, rows in benchmarks.items():
            out[name] = []
            for sample in rows:
                order = ROLES if k % 2 == 0 else ROLES[::-1]
                with gc_held():
                    recs = {role: run_conversation(clients[role], tokenizer, sample, name, sampling, max_prompt_tokens,
                                                   cuts) for role in order}
                if recs["baseline"] or recs["speculative"]:
                    out[name].append((recs["baseline"], recs["speculative"]))
                k += 1
                bar.update(1)
    return out


def sweep_server(
    client: sg.SGLangClient,
    tokenizer,
    benchmarks: dict[str, list[dict]],
    concurrency: list[int],
    sampling: dict,
    warmup: int,
    role: str,
    max_prompt_tokens: Optional[int] = None,
    cuts: Optional[dict[str, set]] = None,
) -> dict[int, dict[str, tuple[list[RequestRecord], float]]]:
    """All benchmarks at every concurrency on one server: ``{c: {bench: (records, s)}}``.

    The cache is flushed before each run (prefix reuse and the server's acceptance
    counters start from zero); ``warmup`` prompts are sent first, unmeasured. Turns longer
    than ``max_prompt_tokens`` are not sent (:func:`run_conversation`).
    """
    _warm_up(client, tokenizer, benchmarks, sampling, warmup, role, max_prompt_tokens)
    out: dict[int, dict[str, tuple[list[RequestRecord], float]]] = {}
    for c in concurrency:
        out[c] = {}
        for name, rows in benchmarks.items():
            client.flush_cache()
            with gc_held():
                t0 = time.perf_counter()
                per_sample = sg.run_parallel(
                    [client], rows,
                    lambda cl, s, name=name: run_conversation(cl, tokenizer, s, name, sampling, max_prompt_tokens, cuts),
                    concurrency=c, desc=f"{role} {name} c={c}",
                )
                dur = time.perf_counter() - t0
            recs = [r for rs in per_sample for r in rs]
            out[c][name] = (recs, dur)
            s = summarize(recs, dur)
            log.info("%s %s c=%d: %.1f output tok/s, TTFT p50 %.0f ms%s", role, name, c,
                     s["output_tokens_per_s"] or 0, s["ttft_ms"]["p50"] or 0,
                     f", tau {s['acceptance_length']:.2f}" if s.get("acceptance_length") else "")
    return out


def diagnose_mismatches(client: sg.SGLangClient, tokenizer, rows: dict[str, list[dict]], pairs: dict[str, Pairs],
                        mismatches: dict[str, list[dict]]) -> None:
    """Add ``logit_gap`` and ``tie`` to each mismatch (in place): the baseline server is
    asked once for its top-20 log-probs after the prompt and the baseline's output up to
    the first differing position, and the two tokens' log-probs are compared (the
    served analogue of :func:`eagle3.evaluate.inprocess.decode.diagnose_mismatch`). A gap within
    :data:`eagle3.evaluate.measures.SERVED_TIE_GAP` is a flip of two nearly equal logits, not a changed output.
    A request that fails, or an answer without the two tokens' log-probs, leaves the
    mismatch a changed output with ``error`` saying why: the diagnosis never ends an
    evaluation (as :func:`eagle3.evaluate.vllm.measure.diagnose_mismatches`).
    """
    from eagle3.errors import Eagle3Error
    from eagle3.target import render_prompt

    for name, ms in mismatches.items():
        by_id = {str(s["id"]): (s, pair) for s, pair in zip(rows[name], pairs[name])}
        for m in ms:
            sample, (base, spec) = by_id[str(m["sample_id"])]
            b, s, i = base[m["turn"]].output_ids, spec[m["turn"]].output_ids, m["first_diff"]
            m.update(logit_gap=None, tie=False)
            if i >= len(b) or i >= len(s):
                continue
            history = system_messages(sample)  # the prompt the turn was sent with (run_conversation)
            for t, user in enumerate([x for x in sample["messages"] if x.get("role") == "user"][:m["turn"] + 1]):
                history.append({"role": "user", "content": user["content"]})
                if t < m["turn"]:
                    history.append({"role": "assistant", "content": tokenizer.decode(base[t].output_ids, skip_special_tokens=True)})
            ids = render_prompt(tokenizer, history) + list(b[:i])
            try:
                out = client.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                                       "return_logprob": True, "top_logprobs_num": 20})
                top = {int(e[1]): float(e[0]) for e in (out["meta_info"].get("output_top_logprobs") or [[]])[0]}
            except Eagle3Error as e:
                m["error"] = f"the request for top_logprobs_num=20 failed ({e})"
                continue
            except (TypeError, ValueError, IndexError, AttributeError) as e:
                m["error"] = f"the answer's output_top_logprobs cannot be read ({type(e).__name__}: {e})"
                continue
            if b[i] in top and s[i] in top:
                m["logit_gap"] = abs(top[b[i]] - top[s[i]])
                m["tie"] = served_tie(m["logit_gap"])
