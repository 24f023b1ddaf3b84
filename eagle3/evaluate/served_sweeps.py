"""Sending the benchmark prompts to one SGLang server, swept over request concurrency.

:func:`run_conversation` sends the user turns of one prompt in order as streamed
``/generate`` requests (a later turn carries the decoded earlier answers, as MT-Bench
wants); :func:`sweep_server` runs every benchmark at every concurrency on one server
with at most ``c`` prompts in flight, the cache flushed before each run.
"""

from __future__ import annotations

import logging
import time

from eagle3.engines import sglang as sg
from eagle3.evaluate.served_measures import RequestRecord, summarize

log = logging.getLogger(__name__)


def _messages(sample: dict) -> list[dict]:
    msgs = sample["messages"]
    return [dict(m) for m in msgs]


def run_conversation(client: sg.SGLangClient, tokenizer, sample: dict, benchmark: str, sampling: dict) -> list[RequestRecord]:
    """Send every user turn of ``sample`` in order (later turns carry the decoded
    earlier answers); one :class:`RequestRecord` per turn.

    Raises:
        eagle3.engines.sglang.ServerUnavailable: (an ``Eagle3Error``) a request that keeps
            failing after the client's retries.
    """
    from eagle3.target import render_prompt

    history: list[dict] = []
    records = []
    turns = [m for m in _messages(sample) if m.get("role") == "user"]
    for i, user in enumerate(turns):
        history.append({"role": "user", "content": user["content"]})
        prompt = render_prompt(tokenizer, history)
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


def sweep_server(
    client: sg.SGLangClient,
    tokenizer,
    benchmarks: dict[str, list[dict]],
    concurrency: list[int],
    sampling: dict,
    warmup: int,
    role: str,
) -> dict[int, dict[str, tuple[list[RequestRecord], float]]]:
    """All benchmarks at every concurrency on one server: ``{c: {bench: (records, s)}}``.

    The cache is flushed before each run (prefix reuse and the server's acceptance
    counters start from zero); ``warmup`` prompts are sent first, unmeasured.
    """
    first = next((s for rows in benchmarks.values() for s in rows), None)
    if warmup and first is not None:
        warm = [first] * int(warmup)
        sg.run_parallel([client], warm, lambda c, s: run_conversation(c, tokenizer, s, "warmup", sampling),
                        concurrency=min(len(warm), 4), desc=f"{role} warm-up", progress=False)
    out: dict[int, dict[str, tuple[list[RequestRecord], float]]] = {}
    for c in concurrency:
        out[c] = {}
        for name, rows in benchmarks.items():
            client.flush_cache()
            t0 = time.perf_counter()
            per_sample = sg.run_parallel(
                [client], rows, lambda cl, s, name=name: run_conversation(cl, tokenizer, s, name, sampling),
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
