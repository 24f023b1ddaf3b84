"""Evaluation through SGLang: a baseline server and a speculative server, swept over
request concurrency.

For each server (connected through ``engine.baseline_url`` / ``engine.speculative_url``
or launched in turn on the same GPUs), each concurrency ``c`` of ``cfg.concurrency`` and
each benchmark, the benchmark's prompts are sent as streamed ``/generate`` requests with
at most ``c`` in flight (multi-turn prompts such as MT-Bench send their turns in order,
the second turn carrying the first answer). Measured as ``sglang.bench_serving`` does
(``python/sglang/benchmark/serving.py``):

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
  concurrency.

The speculative server silently caps running requests at 48 unless
``--max-running-requests`` is given (``srt/arg_groups/speculative_hook.py``); the
effective cap is read back from ``/server_info`` and every tested concurrency above it
gets a warning, since its throughput then measures the cap rather than the drafter.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from eagle3.evaluate import metrics
from eagle3.engines import sglang as sg
from eagle3.errors import Eagle3Error

log = logging.getLogger(__name__)

ROLES = ("baseline", "speculative")
PLOT_NAME = "throughput_vs_concurrency.png"
REQUESTS_NAME = "sglang_requests.jsonl"


# =============================================================================== measures
@dataclass
class RequestRecord:
    """One streamed request (one turn of one prompt)."""

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
            out["per_position_acceptance"] = metrics.per_position_acceptance(hist)
            out["conditional_acceptance"] = metrics.conditional_acceptance(hist)
        else:
            out["accept_histogram"] = out["per_position_acceptance"] = out["conditional_acceptance"] = None
        clean = [r for r in with_ct if not metrics.is_loop(r.output_ids, metrics.longest_loop(r.output_ids)[0])]
        cp = sum(r.spec_verify_ct for r in clean)
        out["acceptance_length_non_looping"] = sum(r.completion_tokens for r in clean) / cp if cp else None
    return out


# =============================================================================== requests
def _messages(sample: dict) -> list[dict]:
    msgs = sample["messages"]
    return [dict(m) for m in msgs]


def run_conversation(client: sg.SGLangClient, tokenizer, sample: dict, benchmark: str, sampling: dict) -> list[RequestRecord]:
    """Send every user turn of ``sample`` in order (later turns carry the decoded
    earlier answers); one :class:`RequestRecord` per turn."""
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


# =============================================================================== servers
@dataclass
class Server:
    role: str
    client: sg.SGLangClient
    info: dict
    launched: Optional[sg.LaunchedServer] = None
    launch_command: Optional[list[str]] = None

    def describe(self) -> dict:
        cmd = self.launch_command or self.info.get("launch_command")
        return {
            "url": self.client.url,
            "version": sg.server_version(self.info),
            "launch_command": cmd if isinstance(cmd, (str, type(None))) else " ".join(map(str, cmd)),
            "effective": sg.effective_settings(self.info),
        }

    def stop(self) -> None:
        if self.launched is not None:
            self.launched.stop()
            self.launched = None


def open_server(role: str, cfg: Any, run_dir: Path) -> Server:
    """Connect to ``engine.<role>_url`` or launch the server for ``role``.

    Raises:
        Eagle3Error: not reachable; neither URL nor sglang to launch with; a speculative
            server that does not run EAGLE3 or a baseline that runs a drafter.
    """
    e = cfg.engine
    url = getattr(e, f"{role}_url", None)
    if url:
        client, info = sg.connect(url, e)
        server = Server(role, client, info)
    else:
        if not sg.sglang_available(e.python):
            raise Eagle3Error(
                f"no {role} SGLang server is configured (engine.{role}_url) and the sglang package is not installed "
                f"here: start both servers where the GPUs are (docs/sglang.md) and pass "
                f"engine.baseline_url=http://HOST:PORT engine.speculative_url=http://HOST:PORT"
            )
        spec = None
        if role == "speculative":
            d = Path(cfg.drafter_dir)
            if not (d / "config.json").is_file():
                raise Eagle3Error(f"no SGLang drafter export at {d}; train one first or set drafter_dir=<export/sglang folder>")
            spec = {"draft_model_path": str(d.resolve()), "num_steps": cfg.speculative.num_steps,
                    "topk": cfg.speculative.topk, "num_draft_tokens": cfg.speculative.num_draft_tokens}
        from eagle3.target import resolve_target

        model_path = sg.resolve_model_path(cfg.model, {"path": resolve_target(cfg.model, cfg.cache_dir).path})
        launched, cmd = sg.launch_server(cfg.model, e, model_path=model_path, run_dir=run_dir, name=role, speculative=spec)
        try:
            client = sg.SGLangClient(launched.url, e.request_timeout_s, e.max_retries, e.backoff_s)
            info = client.server_info()
        except BaseException:
            launched.stop()
            raise
        server = Server(role, client, info, launched, cmd)
    algo = server.info.get("speculative_algorithm")
    if role == "speculative" and "speculative_algorithm" in server.info and str(algo).upper() != "EAGLE3":
        server.stop()
        raise Eagle3Error(
            f"the speculative server at {server.client.url} runs speculative_algorithm={algo}; start it with "
            "--speculative-algorithm EAGLE3 --speculative-draft-model-path <the drafter's export/sglang folder>"
        )
    if role == "baseline" and algo:
        server.stop()
        raise Eagle3Error(
            f"the baseline server at {server.client.url} runs speculative decoding ({algo}); start it without "
            "--speculative-algorithm so the speed-up has a plain reference"
        )
    return server


def check_speculative_server(server: Server, cfg: Any, export_meta: dict) -> list[str]:
    """Warnings (and errors) about what the speculative server serves.

    Raises:
        Eagle3Error: its drafter (when readable here) captures other aux layers than the
            ones the drafter was trained on.
    """
    warnings = []
    info = server.info
    want = {"speculative_num_steps": cfg.speculative.num_steps, "speculative_eagle_topk": cfg.speculative.topk,
            "speculative_num_draft_tokens": cfg.speculative.num_draft_tokens}
    diff = {k: (info.get(k), v) for k, v in want.items() if k in info and info.get(k) != v}
    if diff:
        warnings.append(
            "the speculative server runs " + ", ".join(f"{k}={a} (configured {b})" for k, (a, b) in diff.items())
            + "; results are reported for the server's settings"
        )
    draft = info.get("speculative_draft_model_path")
    served = sg.read_draft_aux_ids(draft, cfg.model.architecture)
    trained = export_meta.get("aux_layer_ids") if export_meta else None
    if served is not None and trained is not None and list(served) != list(trained):
        raise Eagle3Error(
            f"the speculative server's drafter ({draft}) makes the target capture aux layers {served} but the "
            f"drafter under evaluation was trained on {list(trained)}; serve the evaluated export"
        )
    if draft and os.path.isfile(os.path.join(draft, "eagle3_meta.json")) and export_meta:
        served_meta = json.loads(Path(draft, "eagle3_meta.json").read_text())
        for key in ("features_manifest_sha256", "chat_template_hash"):
            if key in served_meta and key in export_meta and served_meta[key] != export_meta[key]:
                warnings.append(f"the served drafter's {key} differs from the evaluated export's: is it the same drafter?")
    elif draft is None and "speculative_draft_model_path" in info:
        warnings.append("the speculative server reports no draft model path")
    return warnings


def cap_warnings(role: str, eff: dict, concurrency: list[int]) -> list[str]:
    """A warning when a tested concurrency exceeds what the server admits or graphs."""
    out = []
    caps = [v for v in (eff.get("max_running_requests"), eff.get("effective_max_running_requests")) if isinstance(v, int)]
    if caps:
        cap = min(caps)
        over = [c for c in concurrency if c > cap]
        if over:
            out.append(
                f"the {role} server admits at most {cap} running requests (effective max_running_requests) but "
                f"concurrency {over} was tested: requests beyond {cap} wait in its queue, so those throughputs "
                "measure the cap, not the drafter; set engine.max_running_requests (--max-running-requests) above "
                "the largest concurrency"
            )
    cg = eff.get("cuda_graph_max_bs")
    if isinstance(cg, int) and any(c > cg for c in concurrency):
        out.append(
            f"the {role} server captures CUDA graphs up to batch {cg}; decode batches above it run without "
            "graphs (set engine.cuda_graph_max_bs)"
        )
    return out


# =============================================================================== results
def _headline(concurrency: list[int]) -> int:
    return min(concurrency)


def build_results(
    runs: dict[str, dict[int, dict[str, tuple[list[RequestRecord], float]]]],
    servers: dict[str, dict],
    cfg: Any,
    warnings: list[str],
) -> dict:
    """Per-benchmark results (the hf report's keys, from the lowest concurrency) plus
    a ``concurrency`` table per benchmark and aggregated over benchmarks."""
    conc = sorted(int(c) for c in cfg.concurrency)
    head = _headline(conc)
    eff_spec = servers["speculative"]["effective"]
    depth = eff_spec.get("speculative_num_steps") or cfg.speculative.num_steps
    names = list(next(iter(runs["speculative"].values())).keys())
    benchmarks: dict[str, Any] = {}
    for name in names:
        table = []
        for c in conc:
            base = summarize(*runs["baseline"][c][name])
            spec = summarize(*runs["speculative"][c][name], positions=depth)
            n_jobs = len({r.sample_id for r in runs["speculative"][c][name][0]})
            table.append({
                "concurrency": c,
                "effective_concurrency": min(c, n_jobs),
                "baseline": base,
                "speculative": spec,
                "speedup": metrics.ratio(spec["output_tokens_per_s"], base["output_tokens_per_s"]),
            })
        row = table[conc.index(head)]
        spec, base = row["speculative"], row["baseline"]
        recs = runs["speculative"][head][name][0]
        benchmarks[name] = {
            "num_prompts": len({r.sample_id for r in recs}),
            "num_turns": spec["requests"],
            "requests": spec["requests"],
            "acceptance_length": spec.get("acceptance_length"),
            "acceptance_length_verify_only": spec.get("acceptance_length_verify_only"),
            "acceptance_length_non_looping": spec.get("acceptance_length_non_looping"),
            "acceptance_rate": spec.get("acceptance_rate"),
            "verify_passes": spec.get("verify_passes"),
            "generated_tokens": spec["output_tokens"],
            "accepted_drafts": spec.get("accepted_drafts"),
            "proposed_drafts": spec.get("proposed_drafts"),
            "accept_histogram": spec.get("accept_histogram"),
            "per_position_acceptance": spec.get("per_position_acceptance"),
            "conditional_acceptance": spec.get("conditional_acceptance"),
            "tokens_per_s_spec": spec["output_tokens_per_s"],
            "tokens_per_s_base": base["output_tokens_per_s"],
            "speedup": row["speedup"],
            "lossless_matches": None,
            "lossless_checked": None,
            "diversity": metrics.diversity([r.output_ids for r in recs]),
            "output_tokens_spec": spec["output_tokens"],
            "output_tokens_base": base["output_tokens"],
            "ttft_ms_spec": spec["ttft_ms"],
            "tpot_ms_spec": spec["tpot_ms"],
            "ttft_ms_base": base["ttft_ms"],
            "tpot_ms_base": base["tpot_ms"],
            "measured_at_concurrency": head,
            "concurrency": table,
        }
    overall = []
    for c in conc:
        agg = {}
        for role in ROLES:
            recs = [r for name in names for r in runs[role][c][name][0]]
            dur = sum(runs[role][c][name][1] for name in names)
            agg[role] = summarize(recs, dur, positions=depth)
        overall.append({"concurrency": c, "baseline": agg["baseline"], "speculative": agg["speculative"],
                        "speedup": metrics.ratio(agg["speculative"]["output_tokens_per_s"], agg["baseline"]["output_tokens_per_s"])})
    return {
        "engine": "sglang",
        "benchmarks": benchmarks,
        "concurrency": overall,
        "servers": servers,
        "speculative": {
            "num_steps": eff_spec.get("speculative_num_steps", cfg.speculative.num_steps),
            "topk": eff_spec.get("speculative_eagle_topk", cfg.speculative.topk),
            "num_draft_tokens": eff_spec.get("speculative_num_draft_tokens", cfg.speculative.num_draft_tokens),
        },
        "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens},
        "warnings": warnings,
        "plots": {"throughput_vs_concurrency": PLOT_NAME},
    }


def plot_throughput(results: dict, path: Path) -> Path:
    """Output tokens/s versus concurrency for both servers (all benchmarks pooled), with
    the speculative server's effective running-request cap marked; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["concurrency"]
    xs = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for role, style in (("baseline", "o-"), ("speculative", "s-")):
        ys = [r[role]["output_tokens_per_s"] or 0.0 for r in rows]
        ax.plot(xs, ys, style, label=f"{role}")
    for r in rows:
        if r["speedup"] is not None:
            ax.annotate(f"x{r['speedup']:.2f}", (r["concurrency"], r["speculative"]["output_tokens_per_s"] or 0.0),
                        textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    eff = results["servers"]["speculative"]["effective"]
    caps = [v for v in (eff.get("max_running_requests"), eff.get("effective_max_running_requests")) if isinstance(v, int)]
    if caps and min(caps) < max(xs):
        ax.axvline(min(caps), ls="--", color="grey", lw=1)
        ax.text(min(caps), ax.get_ylim()[1] * 0.95, f" cap {min(caps)}", color="grey", fontsize=8, va="top")
    if len(xs) > 1 and min(xs) > 0:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    spec = results["speculative"]
    ax.set_title(f"SGLang throughput (EAGLE-3 {spec['num_steps']}/{spec['topk']}/{spec['num_draft_tokens']})")
    ax.margins(y=0.15)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def write_request_log(runs: dict, path: Path) -> None:
    """Every measured request as one JSON line (role, concurrency, timings, counters)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for role, by_c in runs.items():
            for c, by_b in by_c.items():
                for recs, _ in by_b.values():
                    for r in recs:
                        d = dict(r.__dict__, role=role, concurrency=c, tpot_s=r.tpot_s)
                        d.pop("output_ids")
                        f.write(json.dumps(d) + "\n")
    os.replace(tmp, path)


# =============================================================================== entry
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
        tokens_per_s_spec, tokens_per_s_base, speedup, lossless_matches: None,
        diversity, concurrency: [...]}}, "concurrency": [...], "servers": {...},
        "speculative": {...}, "warnings": [...], "plots": {...}}``.

    Raises:
        Eagle3Error: servers missing / unreachable / misconfigured, or a request that
            keeps failing.
    """
    from eagle3.target import load_tokenizer

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
    servers: dict[str, dict] = {}
    warnings: list[str] = []
    for role in ROLES:
        server = open_server(role, cfg, out_dir)
        try:
            if role == "speculative":
                warnings += check_speculative_server(server, cfg, export_meta)
            desc = server.describe()
            warnings += cap_warnings(role, desc["effective"], concurrency)
            runs[role] = sweep_server(server.client, tokenizer, rows, concurrency, sampling, int(cfg.warmup_prompts), role)
            if role == "speculative":
                missing = sum(1 for by_b in runs[role].values() for recs, _ in by_b.values() for r in recs if not r.spec_verify_ct)
                if missing:
                    warnings.append(
                        f"{missing} answers of the speculative server carry no spec_verify_ct in meta_info, so tau "
                        "cannot be computed from them; is speculative decoding on, and does this sglang version report it?"
                    )
                    after = server.client.server_info()
                    acc = sg.effective_settings(after).get("avg_spec_accept_length")
                    desc["avg_spec_accept_length_after_run"] = acc
            servers[role] = desc
        finally:
            server.stop()
    for w in warnings:
        log.warning(w)
    results = build_results(runs, servers, cfg, warnings)
    plot_throughput(results, out_dir / PLOT_NAME)
    write_request_log(runs, out_dir / REQUESTS_NAME)
    return results
