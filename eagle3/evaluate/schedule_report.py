"""The results and report of a served schedule sweep (``mode=schedule``,
:mod:`eagle3.evaluate.vllm.schedule`).

Per phase (``derive``: off and the static chains; ``check``: those and the schedule, swept
again interleaved), concurrency and server: output tokens/s pooled over rounds (tokens /
seconds), each round's, TTFT and inter-token latency (ITL: (latency - TTFT) / (tokens - 1)
per request) p50/p99 in ms, tau from the server's counters. The comparison of the check
phase: the schedule against the better of speculation off and the best static chain (by
pooled tokens/s) and against off, each a pooled ratio with a percentile bootstrap 95%
interval over rounds (:func:`eagle3.evaluate.measures.pooled_speedup`); the acceptance bars
are the schedule at >= 0.97x the better at every concurrency and >= 1.2x off at
concurrency 1. The measured crossover: the lowest concurrency from which the best static
chain no longer beats off at any higher one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

SCHEDULE_REPORT = "schedule.md"
SCHEDULE_JSON = "schedule.json"
SCHEDULE_PLOT = "throughput_schedule.png"
SGLANG_CONFIG = "sglang_adaptive_config.json"
BAR_VS_BEST, BAR_VS_OFF_AT_1 = 0.97, 1.2


def _latencies(run) -> tuple[list[float], list[float]]:
    ttft = [c.ttft_s for c in run.completions]
    itl = [(c.latency_s - c.ttft_s) / (c.completion_tokens - 1) for c in run.completions if c.completion_tokens > 1]
    return ttft, itl


def table(records: list[dict], phase: str) -> dict[int, dict[str, dict]]:
    """``{concurrency: {role: {tokens_per_s, per_round, tau, draft_tokens_per_draft, ttft_ms, itl_ms,
    matches_off, rows}}}`` of ``phase`` (``draft_tokens_per_draft``: the ``k`` a server ran, on
    average over its verify passes); ``rows``: ``[tokens, seconds]`` per round (for the intervals); ``matches_off``:
    ``[answers whose token ids equal off's answer to the same prompt in the same round, answers]``
    (at temperature 0 the lossless check; batched verify passes may flip near-tied logits)."""
    from eagle3.engines.vllm import SpecCounters
    from eagle3.evaluate.measures import percentiles_ms

    out: dict[int, dict[str, dict]] = {}
    off = {(r["round"], r["concurrency"]): r["run"] for r in records if r["phase"] == phase and r["role"] == "off"}
    for r in records:
        if r["phase"] != phase:
            continue
        cell = out.setdefault(r["concurrency"], {}).setdefault(r["role"], {"rows": [], "ttft": [], "itl": [],
                                                                            "counters": SpecCounters(),
                                                                            "matches_off": [0, 0]})
        run = r["run"]
        base = off.get((r["round"], r["concurrency"]))
        if base is not None:  # the same prompts in the same order: greedy answers should agree
            cell["matches_off"][0] += sum(a.output_ids == b.output_ids for a, b in zip(run.completions, base.completions))
            cell["matches_off"][1] += min(len(run.completions), len(base.completions))
        cell["rows"].append([run.output_tokens, run.duration_s])
        t, i = _latencies(run)
        cell["ttft"] += t
        cell["itl"] += i
        if run.counters is not None:
            cell["counters"] = cell["counters"] + run.counters
    for by_role in out.values():
        for cell in by_role.values():
            tok, sec = (sum(x[i] for x in cell["rows"]) for i in (0, 1))
            cell["tokens_per_s"] = tok / sec if sec > 0 else None
            cell["per_round"] = [t / s for t, s in cell["rows"] if s > 0]
            cnt = cell.pop("counters")
            cell["tau"] = cnt.tau
            cell["draft_tokens_per_draft"] = cnt.draft_tokens / cnt.drafts if cnt.drafts else None  # the k run
            t, i = percentiles_ms(cell.pop("ttft")), percentiles_ms(cell.pop("itl"))
            cell["ttft_ms"] = {"p50": t["p50"], "p99": t["p99"]}
            cell["itl_ms"] = {"p50": i["p50"], "p99": i["p99"]}
    return out


def compare(tab: dict[int, dict[str, dict]], seed: int = 0) -> list[dict]:
    """Per concurrency: the schedule against the better static server and against off (pooled
    ratios, 95% intervals over rounds), and whether the bars hold."""
    from eagle3.evaluate.measures import pooled_speedup

    out = []
    for c in sorted(tab):
        cells = tab[c]
        if "schedule" not in cells:
            continue
        static = {r: v for r, v in cells.items() if r != "schedule" and v["tokens_per_s"]}
        best = max(static, key=lambda r: static[r]["tokens_per_s"])

        def vs(role):
            rows = [a + b for a, b in zip(cells[role]["rows"], cells["schedule"]["rows"])]
            return pooled_speedup(rows, seed=seed)

        b, o = vs(best), vs("off")
        row = {"concurrency": c, "best_static": best, "vs_best": b["speedup"], "vs_best_ci95": b["interval"],
               "vs_off": o["speedup"], "vs_off_ci95": o["interval"]}
        row["meets_vs_best"] = b["speedup"] is not None and b["speedup"] >= BAR_VS_BEST
        row["meets_vs_off"] = None if c != 1 else (o["speedup"] is not None and o["speedup"] >= BAR_VS_OFF_AT_1)
        out.append(row)
    return out


def measured_crossover(tab: dict[int, dict[str, dict]]) -> Optional[int]:
    """The lowest concurrency from which no static chain beats off at any higher one (None: a
    chain wins at the highest concurrency measured)."""
    wins = [c for c in sorted(tab) if any(r.startswith("chain-") and (v["tokens_per_s"] or 0) > (tab[c]["off"]["tokens_per_s"] or 0)
                                          for r, v in tab[c].items())]
    later = [c for c in sorted(tab) if not wins or c > wins[-1]]
    return min(later) if later else None


def schedule_results(cfg: Any, records: list[dict], choices, schedule, desc: dict, warnings: list[str], draft: str,
             model_path: str, n_prompts: int) -> dict:
    """The schedule results dict (written by :func:`write_schedule_report`)."""
    from eagle3.schedule.bands import (off_above, sglang_adaptive_config, sglang_serve_command, vllm_serve_command,
                                       vllm_speculative_config)
    from eagle3.schedule.derive import crossover

    cap = int(cfg.engine.max_num_seqs)
    phase = "check" if any(r["phase"] == "check" for r in records) else "derive"
    tab = table(records, phase)
    comparison = compare(tab, int(cfg.seed))
    measured = measured_crossover(tab)
    served = {r: d["effective"].get("max_num_seqs") for r, d in desc.items()}
    return {
        "engine": "vllm", "mode": "schedule", "phase_reported": phase, "prompts": n_prompts,
        "rounds": int(cfg.schedule.rounds), "chains": [int(k) for k in cfg.schedule.chains],
        "max_running_requests": {"requested": cap, "served": served},
        "derived": [{"concurrency": ch.concurrency, "num_steps": ch.num_steps,
                     "predicted_tokens_per_s": ch.predicted, "expected_tau": ch.tau} for ch in choices],
        "schedule": [[b.start, b.end, b.num_steps] for b in schedule],
        "off_above": off_above(schedule), "derived_crossover": crossover(choices),
        "measured_crossover": measured,
        "vllm_speculative_config": vllm_speculative_config(draft, schedule),
        "vllm_serve_command": vllm_serve_command(model_path, draft, schedule, cap),
        "sglang_adaptive_config": sglang_adaptive_config(schedule),
        "sglang_serve_command": sglang_serve_command(model_path, draft, schedule, SGLANG_CONFIG, cap),
        "table": {c: {r: {k: v for k, v in cell.items() if k != "rows"} for r, cell in by.items()}
                  for c, by in tab.items()},
        "comparison": comparison,
        "meets_bars": bool(comparison) and all(r["meets_vs_best"] and r["meets_vs_off"] is not False
                                               for r in comparison),
        "warnings": warnings, "drafter_dir": draft,
    }


def _fmt(x: Optional[float], ci: Optional[list] = None, d: int = 2) -> str:
    if x is None:
        return "-"
    return f"{x:.{d}f}" + (f" [{ci[0]:.{d}f}, {ci[1]:.{d}f}]" if ci else "")


def markdown(res: dict) -> str:
    """The report text: the schedule, the serve commands, the comparison, the table, warnings."""
    lines = ["# Speculation schedule (vLLM, served)", "",
             f"{res['prompts']} prompts, {res['rounds']} interleaved rounds, static chains {res['chains']}, "
             f"max_num_seqs requested {res['max_running_requests']['requested']}, served "
             f"{res['max_running_requests']['served']}.", "", "## Schedule", "",
             "| batch sizes | speculative tokens |", "|---|---|"]
    lines += [f"| {a}-{b} | {k or 'off'} |" for a, b, k in res["schedule"]]
    if res["off_above"] is not None:
        lines += ["", f"Without a per-batch setting: serve without speculation above {res['off_above']} running "
                      "requests." if res["off_above"] else "Speculation loses at every concurrency measured."]
    lines += ["", "vLLM:", "", "```", res["vllm_serve_command"], "```", "", f"SGLang (`{SGLANG_CONFIG}` beside this "
              "report):", "", "```", res["sglang_serve_command"], "```", "", "## Verdict", ""]
    lines.append(verdict(res))
    if res["comparison"]:
        lines += ["", "| concurrency | best static | schedule / best [95% CI] | schedule / off [95% CI] | bars |",
                  "|---|---|---|---|---|"]
        for r in res["comparison"]:
            ok = r["meets_vs_best"] and r["meets_vs_off"] is not False
            lines.append(f"| {r['concurrency']} | {r['best_static']} | {_fmt(r['vs_best'], r['vs_best_ci95'])} | "
                         f"{_fmt(r['vs_off'], r['vs_off_ci95'])} | {'met' if ok else 'missed'} |")
    lines += ["", f"## Throughput ({res['phase_reported']} phase)", "",
              "| concurrency | server | output tok/s | tau | TTFT p50/p99 ms | ITL p50/p99 ms | same as off |",
              "|---|---|---|---|---|---|---|"]
    for c, by in sorted(res["table"].items()):
        for role, v in by.items():
            lines.append(f"| {c} | {role} | {_fmt(v['tokens_per_s'], d=1)} | {_fmt(v['tau'])} | "
                         f"{_fmt(v['ttft_ms']['p50'], d=0)} / {_fmt(v['ttft_ms']['p99'], d=0)} | "
                         f"{_fmt(v['itl_ms']['p50'], d=1)} / {_fmt(v['itl_ms']['p99'], d=1)} | "
                         f"{v['matches_off'][0]}/{v['matches_off'][1]} |")
    if res["warnings"]:
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in res["warnings"]]
    lines += ["", f"![throughput]({SCHEDULE_PLOT})", ""]
    return "\n".join(lines)


def verdict(res: dict) -> str:
    """One paragraph: whether the schedule met its bars, and the crossover concurrency."""
    cross = res["measured_crossover"]
    where = (f"speculation (best static chain) stops beating off from concurrency {cross}" if cross
             else "a static chain beats off at every concurrency measured")
    if not res["comparison"]:
        return f"The schedule was not served (it never speculates, or schedule.check=false); measured: {where}."
    missed = [r["concurrency"] for r in res["comparison"] if not (r["meets_vs_best"] and r["meets_vs_off"] is not False)]
    head = ("The schedule met both bars" if not missed
            else f"The schedule missed its bars at concurrency {missed}")
    return f"{head} (>= {BAR_VS_BEST}x the better of off and the best chain; >= {BAR_VS_OFF_AT_1}x off at 1); {where}."


def write_schedule_report(output_dir: str | os.PathLike, res: dict, export_dir: Optional[str] = None) -> None:
    """``schedule.json``, ``schedule.md``, the plot and SGLang's adaptive config under ``output_dir``
    (atomic); with ``export_dir`` the same report as the export's deployment notes
    (``<export_dir>/deployment_schedule.md``, ``.json``)."""
    from eagle3.evaluate.plots import plot_schedule
    from eagle3.io import write_json_atomic

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(res)
    plot_schedule(res, out / SCHEDULE_PLOT)
    write_json_atomic(out / SCHEDULE_JSON, res)
    write_json_atomic(out / SGLANG_CONFIG, res["sglang_adaptive_config"])
    for path in [out / SCHEDULE_REPORT] + ([Path(export_dir) / "deployment_schedule.md"] if export_dir else []):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    if export_dir:
        write_json_atomic(Path(export_dir) / "deployment_schedule.json", {
            k: res[k] for k in ("schedule", "vllm_speculative_config", "sglang_adaptive_config", "off_above",
                                "max_running_requests", "meets_bars")})
    print(json.dumps({"schedule": res["schedule"], "vllm_serve_command": res["vllm_serve_command"]}, indent=1))
