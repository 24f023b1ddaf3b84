"""Evaluation through SGLang: a baseline server and a speculative server, swept over
request concurrency.

Both servers are up at once (connected through ``engine.baseline_url`` /
``engine.speculative_url`` or launched here on ``engine.port`` and ``engine.port + 1``;
``engine.url`` / ``engine.urls`` are refused). First every prompt is sent to both at
batch 1, prompt by prompt, alternating which server goes first
(:func:`eagle3.evaluate.sglang.sweeps.interleave_batch1`): the headline tau, acceptance,
tokens/s, the speed-up with a bootstrap 95% interval over prompts and, at temperature
0, the lossless check (the speculative server's output ids equal the baseline's per
prompt) come from these pairs. Then, for each server, each concurrency ``c`` of
``cfg.concurrency`` and each benchmark, the benchmark's prompts are sent as streamed
``/generate`` requests with at most ``c`` in flight (multi-turn prompts such as MT-Bench
send their turns in order, the second turn carrying the first answer). Measured as
``sglang.bench_serving`` does (``python/sglang/benchmark/serving.py``):

* output tokens/s = sum of ``completion_tokens`` / wall time of the run;
* TTFT = time to the first streamed chunk with output; TPOT = (latency - TTFT) /
  (completion_tokens - 1) per request; both as mean / p50 / p90 / p99 in ms;
* acceptance length tau = sum(``completion_tokens``) / sum(``spec_verify_ct``) over the
  speculative server's answers (SGLang's convention: the prefill token counts, so a
  drafter that never hits gives ``n / (n - 1)``, not exactly 1; ``acceptance_length_
  verify_only`` drops that token, the hf engine's convention); acceptance rate = sum
  ``spec_num_correct_drafts`` / sum ``spec_num_proposed_drafts``; per-position
  acceptance from the summed ``spec_correct_drafts_histogram`` (definitions of
  :mod:`eagle3.evaluate.metrics`, shared with the hf engine, as is the output diversity);
* speed-up = speculative output tokens/s / baseline output tokens/s at the same
  concurrency; at batch 1 from the interleaved pairs, with its interval (a ratio whose
  interval contains 1.0 is reported as no measurable speed-up).

The speculative server silently caps running requests at 48 unless
``--max-running-requests`` is given (``srt/arg_groups/speculative_hook.py``); the
effective cap is read back from ``/server_info`` and every tested concurrency above it
gets a warning, since its throughput then measures the cap rather than the drafter.

The parts, in the order the data flows: :mod:`eagle3.evaluate.sglang.servers` (opening and
checking the servers), :mod:`eagle3.evaluate.sglang.sweeps` (the requests),
:mod:`eagle3.evaluate.measures` (records and their measures),
:mod:`eagle3.evaluate.sglang.results` (the results, the plot, the request log).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

from eagle3.engines import sglang as sg
from eagle3.errors import Eagle3Error
from eagle3.evaluate.plots import PLOT_NAME, plot_throughput
from eagle3.evaluate.sglang.results import REQUESTS_NAME, build_results, write_request_log
from eagle3.evaluate.measures import prompt_limit
from eagle3.evaluate.sglang.sweeps import diagnose_mismatches, interleave_batch1, sweep_server
from eagle3.evaluate.turns import lossless_check
from eagle3.evaluate.sglang.servers import (
    ROLES,
    Server,
    cap_warnings,
    check_served_urls,
    check_speculative_server,
    open_server,
)

log = logging.getLogger(__name__)


def run_sglang_evaluation(cfg: Any, benchmarks: dict, export_meta: dict, output_dir: str | os.PathLike) -> dict:
    """Evaluate the drafter served by SGLang against a baseline server.

    Args:
        cfg: ``EvaluateConfig`` with ``engine`` an ``SGLangEngineConfig``.
        benchmarks: name -> ``datasets.Dataset`` with ``id`` and ``messages`` (user
            turns; several for multi-turn benchmarks).
        export_meta: the evaluated export's ``eagle3_meta.json`` (aux ids, hashes).
        output_dir: where the plot, the request log and the server logs go.

    Returns:
        ``{"engine": "sglang", "benchmarks": {name: {acceptance_length,
        acceptance_rate, verify_passes, generated_tokens, per_position_acceptance,
        tokens_per_s_spec, tokens_per_s_base, speedup, speedup_interval,
        speedup_significant, lossless_matches, lossless_checked, diversity,
        concurrency: [...]}}, "concurrency": [...], "servers": {...},
        "speculative": {...}, "warnings": [...], "plots": {...}}``.

    Raises:
        Eagle3Error: ``engine.url`` / ``engine.urls`` set (:func:`eagle3.evaluate.sglang.servers.check_served_urls`),
            servers missing / unreachable / misconfigured, or a request that keeps failing.
    """
    from eagle3.target import load_tokenizer

    check_served_urls(cfg.engine)
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    concurrency = sorted({int(c) for c in cfg.concurrency})
    if not concurrency or min(concurrency) < 1:
        raise Eagle3Error(f"concurrency {list(cfg.concurrency)} must list positive request counts, e.g. [1, 8, 32, 64, 128]")
    tokenizer = load_tokenizer(cfg.model, cfg.cache_dir)
    rows = {name: [dict(id=r["id"], messages=r["messages"]) for r in ds] for name, ds in benchmarks.items()}
    if not rows or not any(rows.values()):
        raise Eagle3Error("no benchmark prompts to evaluate; check data.names and data.limit")
    sampling = {"max_new_tokens": int(cfg.max_new_tokens), "temperature": float(cfg.temperature), "top_p": float(cfg.top_p)}
    if float(cfg.temperature) > 0:
        sampling["sampling_seed"] = int(cfg.seed)
    runs: dict[str, Any] = {}
    descs: dict[str, dict] = {}
    warnings: list[str] = []
    together = _together(cfg.engine)
    measure = _measure_together if together else _measure_in_turn
    paired = measure(cfg, export_meta, out_dir, tokenizer, rows, concurrency, sampling, runs, descs, warnings)
    results = build_results(runs, descs, cfg, warnings, paired=paired, interleaved=together)
    for w in results["warnings"]:
        log.warning(w)
    plot_throughput(results, out_dir / PLOT_NAME)
    write_request_log(runs, out_dir / REQUESTS_NAME, paired=paired if together else None)
    return results


def _together(engine_cfg: Any) -> bool:
    """Whether both servers are up at once: ``engine.launch_together``, else yes when
    both URLs are given or the servers launched here are CPU servers."""
    if getattr(engine_cfg, "launch_together", None) is not None:
        return bool(engine_cfg.launch_together)
    if engine_cfg.baseline_url and engine_cfg.speculative_url:
        return True
    return sg.server_device(engine_cfg) == "cpu"


def _open_checked(role: str, cfg: Any, out_dir: Path, export_meta: dict, concurrency: list[int], descs: dict,
                  warnings: list[str]) -> Server:
    """Open one server, check it, record its description and cap warnings."""
    server = open_server(role, cfg, out_dir)
    try:
        if role == "speculative":
            warnings += check_speculative_server(server, cfg, export_meta)
        descs[role] = server.describe()
        warnings += cap_warnings(role, descs[role]["effective"], concurrency)
    except BaseException:
        server.stop()
        raise
    return server


def _limit(cfg: Any, descs: list[dict]) -> tuple[Optional[int], str]:
    """The longest prompt the servers in ``descs`` take with room for the reply
    (:func:`eagle3.evaluate.measures.prompt_limit` over their ``context_length``)."""
    return prompt_limit([d.get("effective", {}).get("context_length") for d in descs], int(cfg.max_new_tokens),
                        getattr(cfg, "max_prompt_tokens", None), setting="context_length")


def fitting_rows(rows: dict[str, list[dict]], tokenizer, limit: Optional[int], why: str,
                 warnings: list[str]) -> dict[str, list[dict]]:
    """``rows`` without the prompts whose first turn is longer than ``limit`` tokens (each
    benchmark's count goes to ``warnings``; a benchmark left empty is dropped). Later turns
    that grow past the limit are cut when they are sent (:func:`_cut_warnings`).

    Raises:
        Eagle3Error: no prompt's first turn fits.
    """
    from eagle3.evaluate.sglang.sweeps import first_turn_fits

    out = {}
    for name, rs in rows.items():
        keep = [r for r in rs if first_turn_fits(tokenizer, r, limit)]
        if len(keep) < len(rs):
            msg = f"{name}: {len(rs) - len(keep)} prompts longer than {limit} tokens ({why}) were skipped"
            log.warning(msg)
            warnings.append(msg)
        if keep:
            out[name] = keep
    if not out:
        raise Eagle3Error(f"no benchmark prompt is {limit} tokens or shorter ({why}); raise the servers' "
                          "engine.context_length or lower max_new_tokens / max_prompt_tokens")
    return out


def _cut_warnings(cuts: dict[str, set], limit: Optional[int], why: str) -> list[str]:
    """One warning per benchmark whose conversations were cut at a later turn longer than ``limit``."""
    return [f"{name}: {len(ids)} conversations reached a turn longer than {limit} tokens ({why}) and were cut "
            "there (earlier turns kept)" for name, ids in sorted(cuts.items())]


def _measure_together(cfg, export_meta, out_dir, tokenizer, rows, concurrency, sampling, runs, descs, warnings) -> dict:
    """Both servers up: the interleaved batch-1 pairs (their mismatches diagnosed at
    temperature 0), then each server's concurrency sweep; returns the pairs.

    The pairs are the sweep's concurrency-1 row (:func:`pairs_as_sweep`): sending every
    prompt at batch 1 again would only repeat them. The request log is rewritten after
    the pairs and after each server's sweep, so a run stopped part-way keeps what it
    measured."""
    opened: dict[str, Server] = {}
    try:
        for role in ROLES:  # both up at once: the batch-1 requests alternate between them
            opened[role] = _open_checked(role, cfg, out_dir, export_meta, concurrency, descs, warnings)
        limit, why = _limit(cfg, [descs[r] for r in ROLES])
        rows = fitting_rows(rows, tokenizer, limit, why, warnings)
        cuts: dict[str, set] = {}
        paired = interleave_batch1({r: opened[r].client for r in ROLES}, tokenizer, rows, sampling,
                                   int(cfg.warmup_prompts), limit, cuts)
        warnings += _cut_warnings(cuts, limit, why)
        if float(cfg.temperature) == 0.0:
            warnings += _diagnose(opened["baseline"].client, tokenizer, rows, paired)
        write_request_log({}, out_dir / REQUESTS_NAME, paired=paired)  # kept if the sweep is cut short
        log.info("batch-1 pairs written to %s", out_dir / REQUESTS_NAME)
        rest = [c for c in concurrency if c != 1]  # concurrency 1 is what the pairs measured
        for role in ROLES:
            runs[role] = (sweep_server(opened[role].client, tokenizer, rows, rest, sampling, 0, role, limit)
                          if rest else {})
            if 1 in concurrency:
                runs[role] = {1: pairs_as_sweep(paired, ROLES.index(role)), **runs[role]}
            write_request_log(runs, out_dir / REQUESTS_NAME, paired=paired)
        warnings += _missing_counters(runs["speculative"], opened["speculative"], descs["speculative"])
    finally:
        for server in opened.values():
            server.stop()
    return paired


def _measure_in_turn(cfg, export_meta, out_dir, tokenizer, rows, concurrency, sampling, runs, descs, warnings) -> dict:
    """One server after the other (they share the GPUs): each one's sweep; the pairs are
    the prompts of the concurrency-1 runs when 1 was swept (not interleaved), else none."""
    for role in ROLES:
        server = _open_checked(role, cfg, out_dir, export_meta, concurrency, descs, warnings)
        try:
            limit, why = _limit(cfg, [descs[role]])
            own: list[str] = []
            role_rows = fitting_rows(rows, tokenizer, limit, why, own)
            cuts: dict[str, set] = {}
            runs[role] = sweep_server(server.client, tokenizer, role_rows, concurrency, sampling,
                                      int(cfg.warmup_prompts), role, limit, cuts)
            warnings += [f"{role} server: {w}" for w in own + _cut_warnings(cuts, limit, why)]
            if role == "speculative":
                warnings += _missing_counters(runs[role], server, descs[role])
        finally:
            server.stop()
    if 1 not in concurrency:
        return {}
    paired = {}
    for name in rows:
        if any(name not in runs[role][1] for role in ROLES):  # every prompt too long for a server
            continue
        by_id = {role: {} for role in ROLES}
        for role in ROLES:
            for r in runs[role][1][name][0]:
                by_id[role].setdefault(r.sample_id, []).append(r)
        paired[name] = [(by_id["baseline"][i], by_id["speculative"][i]) for i in by_id["baseline"] if i in by_id["speculative"]]
    return paired


def pairs_as_sweep(paired: dict, side: int) -> dict:
    """One side of the interleaved pairs (0 baseline, 1 speculative) in the shape of a
    sweep's concurrency-1 row: ``{benchmark: (records, seconds)}``, where the seconds
    are the requests' summed latencies (one request in flight at a time, so the summed
    latencies are the time that side's requests took)."""
    out = {}
    for name, pairs in paired.items():
        recs = [r for pair in pairs for r in pair[side]]
        out[name] = (recs, sum(r.latency_s for r in recs))
    return out


def _diagnose(client: sg.SGLangClient, tokenizer, rows: dict, paired: dict) -> list[str]:
    """Classify the greedy mismatches of the interleaved pairs (near-tie or not) while
    the baseline server is up; stored on the pairs' first records for the results.
    Returns a warning when some of the near-tie requests failed (those count as changed
    outputs)."""
    found = {name: lossless_check(pairs)["mismatches"] for name, pairs in paired.items()}
    diagnose_mismatches(client, tokenizer, rows, paired, found)
    failed = []
    for name, ms in found.items():
        for m in ms:
            pair = next(p for p in paired[name] if p[0] and p[0][0].sample_id == m["sample_id"])
            pair[0][m["turn"]].diagnosis = {k: m[k] for k in ("logit_gap", "tie")}
            failed += [m["error"]] if m.get("error") else []
    return [f"the near-tie test of {len(failed)} greedy mismatches failed, so they count as changed outputs: "
            f"{failed[0]}"] if failed else []


def _missing_counters(sweep: dict, server: Server, desc: dict) -> list[str]:
    """A warning when speculative answers carry no ``spec_verify_ct`` (tau cannot be
    computed from them); then the server's own ``avg_spec_accept_length`` is read back
    into ``desc``."""
    missing = sum(1 for by_b in sweep.values() for recs, _ in by_b.values() for r in recs if not r.spec_verify_ct)
    if not missing:
        return []
    after = server.client.server_info()
    acc = sg.effective_settings(after).get("avg_spec_accept_length")
    desc["avg_spec_accept_length_after_run"] = acc
    return [
        f"{missing} answers of the speculative server carry no spec_verify_ct in meta_info, so tau "
        "cannot be computed from them; is speculative decoding on, and does this sglang version report it?"
    ]
