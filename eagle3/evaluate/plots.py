"""The served engines' throughput plot: output tokens/s versus request concurrency."""

from __future__ import annotations

import os
from pathlib import Path

PLOT_NAME = "throughput_vs_concurrency.png"


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
    _concurrency_axes(ax, xs)
    spec = results["speculative"]
    engine = {"vllm": "vLLM"}.get(results.get("engine"), "SGLang")
    ax.set_title(f"{engine} throughput (EAGLE-3 {spec['num_steps']}/{spec['topk']}/{spec['num_draft_tokens']})")
    ax.margins(y=0.15)
    return _save(fig, ax, path)


def plot_schedule(res: dict, path: Path) -> Path:
    """Output tokens/s versus concurrency for speculation off, each static chain and the schedule
    (a schedule sweep's reported phase, :mod:`eagle3.evaluate.schedule_report`), the servers'
    running-request cap and the measured crossover marked; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tab = {int(c): by for c, by in res["table"].items()}
    xs = sorted(tab)
    roles = sorted({r for by in tab.values() for r in by}, key=lambda r: (r != "off", r == "schedule", r))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for role in roles:
        pts = [(c, tab[c][role]["tokens_per_s"]) for c in xs if role in tab[c] and tab[c][role]["tokens_per_s"]]
        style = {"off": "o-", "schedule": "D-"}.get(role, "s--")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=role, lw=2.2 if role == "schedule" else 1.2)
    cap = res["max_running_requests"]["requested"]
    if cap < max(xs):
        ax.axvline(cap, ls=":", color="grey", lw=1)
        ax.text(cap, ax.get_ylim()[1] * 0.95, f" cap {cap}", color="grey", fontsize=8, va="top")
    if res.get("measured_crossover"):
        ax.axvline(res["measured_crossover"], ls="--", color="tab:red", lw=1)
        ax.text(res["measured_crossover"], ax.get_ylim()[0], f" crossover {res['measured_crossover']}",
                color="tab:red", fontsize=8, va="bottom")
    _concurrency_axes(ax, xs)
    ax.set_title("vLLM throughput: off, static chains, schedule")
    return _save(fig, ax, path)


def _concurrency_axes(ax, xs: list[int]) -> None:
    """Concurrency on a log2 axis (ticks at the measured points), tokens/s up."""
    if len(xs) > 1 and min(xs) > 0:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")


def _save(fig, ax, path: Path) -> Path:
    """Grid, legend, tight layout; the PNG written atomically (a temporary file, then a rename)."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return path
