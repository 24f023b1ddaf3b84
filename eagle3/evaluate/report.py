"""The evaluation report: ``report.json``, ``report.md``, PNG plots, ``metrics.json``
and the tau table on the console.

:func:`write_report` takes the results of either engine (``eagle3.evaluate.run`` for
``hf``, ``eagle3.evaluate.sglang.evaluation`` for ``sglang``): ``{"engine", "benchmarks": {name:
{acceptance_length, acceptance_rate, verify_passes, generated_tokens,
per_position_acceptance, tokens_per_s_spec, tokens_per_s_base, speedup,
lossless_matches, diversity, ...}}, "speculative": {num_steps, topk,
num_draft_tokens}, "sampling": {...}, "warnings": [...], ...}`` and completes every
benchmark with ``verdict``/``verdict_notes`` (:func:`eagle3.evaluate.metrics.verdict`),
``num_prompts``, ``settings`` and ``max_running_requests`` where missing.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Optional

from eagle3.evaluate.metrics import verdict

log = logging.getLogger("eagle3")

PLOT_POSITIONS = "per_position_acceptance.png"
PLOT_TAU = "acceptance_length.png"


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _json_safe(obj: Any) -> Any:
    """NaN/inf -> None so report.json is strict JSON."""
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _f(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _spec_cap(results: dict) -> Optional[int]:
    eff = ((results.get("servers") or {}).get("speculative") or {}).get("effective") or {}
    for key in ("effective_max_running_requests", "max_running_requests"):
        if isinstance(eff.get(key), int):
            return int(eff[key])
    return None


def complete(results: dict) -> dict:
    """Fill the per-benchmark fields every report carries (in place; returns ``results``)."""
    settings = {**(results.get("speculative") or {}), **(results.get("sampling") or {})}
    cap = _spec_cap(results)
    for b in (results.get("benchmarks") or {}).values():
        b.setdefault("num_prompts", b.get("prompts"))
        b.setdefault("settings", settings)
        b.setdefault("max_running_requests", cap)
        if "verdict" not in b:
            b["verdict"], b["verdict_notes"] = verdict(b, spec_cap=cap)
    return results


def headline(results: dict) -> dict:
    """Flat numbers for ``metrics.json`` and the sweep table (``eagle3.sweep.summary``)."""
    spec = results.get("speculative") or {}
    out: dict[str, Any] = {
        "steps/topk/draft": f"{spec.get('num_steps')}/{spec.get('topk')}/{spec.get('num_draft_tokens')}",
        "temperature": (results.get("sampling") or {}).get("temperature"),
    }
    taus, speedups = [], []
    for name, b in (results.get("benchmarks") or {}).items():
        out[f"tau {name}"] = b.get("acceptance_length")
        out[f"accept_rate {name}"] = b.get("acceptance_rate")
        out[f"speedup {name}"] = b.get("speedup")
        if b.get("acceptance_length") is not None:
            taus.append(b["acceptance_length"])
        if b.get("speedup") is not None:
            speedups.append(b["speedup"])
    out["tau mean"] = sum(taus) / len(taus) if taus else None
    out["speedup mean"] = sum(speedups) / len(speedups) if speedups else None
    lm = [(b.get("lossless_matches"), b.get("lossless_checked")) for b in (results.get("benchmarks") or {}).values()]
    if lm and all(m is not None and n is not None for m, n in lm):
        out["lossless"] = f"{sum(m for m, _ in lm)}/{sum(n for _, n in lm)}"
    return out


def _lossless(b: dict) -> str:
    if b.get("lossless_matches") is None:
        return "-"
    out = f"{b['lossless_matches']}/{b.get('lossless_checked', b.get('num_prompts'))}"
    return out + (f" +{b['lossless_near_ties']} ties" if b.get("lossless_near_ties") else "")


def _speedup(b: dict) -> str:
    """``1.23 [1.05, 1.41]``: the speed-up and, from a served run's interleaved batch-1
    pairs, its bootstrap interval; ``~`` marks a ratio whose interval contains 1.0 (no
    speed-up or slow-down can be claimed)."""
    iv = b.get("speedup_interval")
    if b.get("speedup") is None or not iv:
        return _f(b.get("speedup"))
    mark = "~" if iv[0] <= 1.0 <= iv[1] else ""
    return f"{mark}{b['speedup']:.2f} [{iv[0]:.2f}, {iv[1]:.2f}]"


def _tau(b: dict) -> str:
    """``2.42 [2.31, 2.56]``: tau and its bootstrap 95% interval over prompts, where known."""
    iv = b.get("acceptance_length_interval")
    if b.get("acceptance_length") is None or not iv:
        return _f(b.get("acceptance_length"))
    return f"{b['acceptance_length']:.2f} [{iv[0]:.2f}, {iv[1]:.2f}]"


def tau_table(results: dict) -> str:
    """The console table: one row per benchmark."""
    head = ["benchmark", "prompts", "tau", "accept", "tok/s spec", "tok/s base", "speed-up", "lossless", "verdict"]
    rows = []
    for name, b in (results.get("benchmarks") or {}).items():
        lossless = _lossless(b)
        rows.append([
            name, _f(b.get("num_prompts")), _tau(b), _f(b.get("acceptance_rate")),
            _f(b.get("tokens_per_s_spec"), 1), _f(b.get("tokens_per_s_base"), 1), _speedup(b),
            lossless, b.get("verdict", "-"),
        ])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]) + "\n"


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _teacher_forced_section(benches: dict) -> list[str]:
    """The report's "Where tau is lost" section (empty when no benchmark has teacher-forced figures)."""
    out: list[str] = []
    tf = {n: b["teacher_forced"] for n, b in benches.items() if b.get("teacher_forced")}
    if tf:
        out.append("\n## Where tau is lost (teacher-forced replay)\n")
        out.append("Each decoded turn replayed with features from one full forward of the target and the training-time "
                   "test's unroll of the drafter (labels: the reply's own tokens). replay: chains where the decoder "
                   "started them, so it differs from decoded tau only through numerics (features from prefill and "
                   "verify passes over a KV cache, incremental drafting); every position: a chain at every reply "
                   "token, as training validation measures it, so it differs from replay by where chains start. "
                   "identical: turns whose replayed chains equal the decoder's (the last chain left out). tau "
                   "decoded here is 1 + the mean accepted drafts per verify pass; the headline tau counts emitted "
                   "tokens, which a last pass cut at max_new_tokens lowers slightly.\n")
        out.append(_md_table(
            ["benchmark", "tau decoded", "tau replay", "tau every position", "every position: pos 1 / 2 / 3",
             "identical turns"],
            [[n, _f(t.get("served_tau")), _f(t.get("replay_tau")), _f(t.get("every_tau")),
              " / ".join(_f(v) for v in (t.get("every_per_position") or [])),
              f"{t.get('identical_turns')} of {t.get('turns')}"] for n, t in tf.items()],
        ))
    return out


def _diversity_section(benches: dict) -> list[str]:
    """The report's "Diversity" section: distinct n-grams, loops, tau without looping outputs."""
    out: list[str] = []
    out.append("\n## Diversity\n")
    out.append(_md_table(
        ["benchmark", "distinct-1", "distinct-2", "longest loop (mean / max tokens)", "looping outputs", "tau w/o loops"],
        [[n, _f((b.get("diversity") or {}).get("distinct_1")), _f((b.get("diversity") or {}).get("distinct_2")),
          f"{_f((b.get('diversity') or {}).get('longest_loop_mean'), 1)} / {_f((b.get('diversity') or {}).get('longest_loop_max'))}",
          _f((b.get("diversity") or {}).get("looping_outputs")), _f(b.get("acceptance_length_non_looping"))]
         for n, b in benches.items()],
    ))
    return out


def render_markdown(results: dict, plots: dict[str, str]) -> str:
    """``report.md`` text."""
    spec, samp = results.get("speculative") or {}, results.get("sampling") or {}
    benches = results.get("benchmarks") or {}
    out = ["# Speculative decoding evaluation\n"]
    out.append(
        f"Engine `{results.get('engine')}`; steps/topk/draft tokens "
        f"{spec.get('num_steps')}/{spec.get('topk')}/{spec.get('num_draft_tokens')}; temperature "
        f"{samp.get('temperature')}, top_p {samp.get('top_p')}, max_new_tokens {samp.get('max_new_tokens')}.\n"
    )
    settings = results.get("settings") or {}
    if settings:
        out.append(_md_table(["setting", "value"], [[k, f"`{v}`"] for k, v in settings.items()]))
    if results.get("warnings"):
        out.append("\n## Warnings\n")
        out += [f"- {w}" for w in results["warnings"]]
        out.append("")
    out.append("\n## Acceptance and speed\n")
    rows = []
    for name, b in benches.items():
        d = b.get("diversity") or {}
        lossless = _lossless(b)
        rows.append([
            name, _f(b.get("num_prompts")), _tau(b), _f(b.get("acceptance_rate")),
            _f(b.get("verify_passes")), _f(b.get("generated_tokens")), _f(b.get("tokens_per_s_spec"), 1),
            _f(b.get("tokens_per_s_base"), 1), _speedup(b), _f(b.get("decode_speedup")), lossless,
            b.get("verdict", "-"),
        ])
    out.append(_md_table(
        ["benchmark", "prompts", "tau", "acceptance rate", "verify passes", "generated tokens",
         "tok/s spec", "tok/s base", "speed-up", "decode speed-up", "lossless", "verdict"], rows))
    out.append("tau [lo, hi]: the bootstrap 95% interval over prompts (a prompt's turns resampled together). "
               "tok/s and speed-up: generated tokens over wall time including the prefill, batch 1; "
               "decode speed-up leaves the prefill out. lossless: prompts whose speculative tokens equal the "
               "target's own greedy tokens (+ prompts that first differ at a rounding tie of the top two logits: a gap within "
               "a few units of the dtype's epsilon, or within twice the two logits' drift between a prefill and verify "
               "passes of the target).\n")
    if any(b.get("speedup_interval") for b in benches.values()):
        out.append("Served runs: tok/s, speed-up and lossless come from batch-1 requests sent to both servers prompt "
                   "by prompt (baseline and speculative interleaved); [lo, hi] is the bootstrap 95% interval of the "
                   "speed-up over prompts, and ~ marks one that contains 1.0 (no speed-up can be claimed). lossless: "
                   "prompts whose speculative greedy output ids equal the baseline server's.\n")
    depth = max((len(b.get("per_position_acceptance") or []) for b in benches.values()), default=0)
    if depth:
        out.append("\n## Per-position acceptance\n")
        out.append("Fraction of verify passes whose draft position i was accepted.\n")
        out.append(_md_table(
            ["benchmark"] + [f"pos {i}" for i in range(1, depth + 1)],
            [[n] + [_f(v) for v in (b.get("per_position_acceptance") or [])] + ["-"] * (
                depth - len(b.get("per_position_acceptance") or [])) for n, b in benches.items()],
        ))
    out += _teacher_forced_section(benches)
    out += _diversity_section(benches)
    notes = [(n, m) for n, b in benches.items() for m in (b.get("verdict_notes") or [])]
    out.append("\n## Verdict\n")
    if notes:
        out += [f"- **{n}**: {m}" for n, m in notes]
    else:
        out.append("All benchmarks OK.")
    out.append("")
    conc = [(n, b["concurrency"]) for n, b in benches.items() if b.get("concurrency")]
    if conc:
        out.append("\n## Throughput versus concurrency\n")
        for n, table in conc:
            out.append(f"\n### {n}\n")
            out.append(_md_table(
                ["concurrency", "tok/s base", "tok/s spec", "speed-up", "tau"],
                [[str(r.get("concurrency")), _f((r.get("baseline") or {}).get("output_tokens_per_s"), 1),
                  _f((r.get("speculative") or {}).get("output_tokens_per_s"), 1), _f(r.get("speedup")),
                  _f((r.get("speculative") or {}).get("acceptance_length"))] for r in table],
            ))
    all_plots = {**(results.get("plots") or {}), **plots}
    if all_plots:
        out.append("\n## Plots\n")
        out += [f"![{k}]({v})" for k, v in all_plots.items()]
        out.append("")
    return "\n".join(out) + "\n"


def plot(results: dict, output_dir: Path) -> dict[str, str]:
    """Per-position acceptance and tau-per-benchmark PNGs; returns ``{name: file}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (MaxNLocator)

    benches = results.get("benchmarks") or {}
    spec = results.get("speculative") or {}
    made: dict[str, str] = {}

    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for name, b in benches.items():
        pp = b.get("per_position_acceptance") or []
        if pp:
            ax.plot(range(1, len(pp) + 1), pp, marker="o", label=name)
            drawn = True
    if drawn:
        ax.set_xlabel("draft position")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # positions are whole numbers
        ax.set_ylabel("fraction of verify passes accepting it")
        ax.set_ylim(0, 1.02)
        ax.set_title("Per-position acceptance")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(output_dir / PLOT_POSITIONS, dpi=110)
        made["per_position_acceptance"] = PLOT_POSITIONS
    plt.close(fig)

    names = [n for n, b in benches.items() if b.get("acceptance_length") is not None]
    if names:
        fig, ax = plt.subplots(figsize=(6, 4))
        taus = [benches[n]["acceptance_length"] for n in names]
        bars = ax.bar(names, taus, color="tab:blue")
        for bar, t in zip(bars, taus):
            ax.text(bar.get_x() + bar.get_width() / 2, t, f"{t:.2f}", ha="center", va="bottom")
        top = spec.get("num_steps")
        if top:
            ax.axhline(top + 1, color="gray", ls="--", lw=1, label=f"max (num_steps+1 = {top + 1})")
        ax.axhline(1.0, color="red", ls=":", lw=1, label="nothing accepted")
        ax.set_ylabel("acceptance length tau")
        ax.set_title(f"tau per benchmark ({spec.get('num_steps')}/{spec.get('topk')}/{spec.get('num_draft_tokens')})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(output_dir / PLOT_TAU, dpi=110)
        made["acceptance_length"] = PLOT_TAU
        plt.close(fig)
    return made


def write_report(output_dir: str | os.PathLike, results: dict) -> None:
    """Write the report of an evaluation and print its tau table.

    Writes (atomically) ``report.json`` (``results`` completed by :func:`complete`, NaN
    as null), ``report.md``, ``per_position_acceptance.png``, ``acceptance_length.png``
    and ``metrics.json`` (:func:`headline`); under a Hydra multirun also the job's
    sweep summary (:func:`eagle3.sweep.record.record_job_summary`).
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    complete(results)
    plots = plot(results, out)
    results.setdefault("plots", {}).update(plots)
    _write_text(out / "report.json", json.dumps(_json_safe(results), indent=1) + "\n")
    _write_text(out / "report.md", render_markdown(results, plots))
    head = headline(results)
    _write_text(out / "metrics.json", json.dumps(_json_safe(head), indent=1) + "\n")
    try:
        from eagle3.sweep.record import record_job_summary

        record_job_summary(_json_safe(head), metrics_path=str(out / "report.json"))
    except ImportError:  # pragma: no cover - sweep summaries are optional
        pass
    for w in results.get("warnings") or []:
        print(f"warning: {w}")
    print(f"\nacceptance length (tau) per benchmark; report in {out}/report.md\n")
    print(tau_table(results))
