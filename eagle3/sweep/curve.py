"""A learning curve from finished training runs: validation figures against training samples.

Runs trained with the same recipe and step count on nested subsets of one training split
(``loop.train_fraction``, :func:`eagle3.train.data.train_subset`) answer what more data of the
same kind would buy. Each run's ``metrics.json`` (written by ``train.py``) gives the x value
(``train_samples``) and the y values (``validation.step_acc``, top-1 agreement per TTT step,
and ``validation.replay_tau``, the serving-replay tau). Between consecutive points the gain is
reported per doubling of the samples, ``(y2 - y1) / log2(n2 / n1)``; when the gains shrink
geometrically, the next doubling is worth about the last gain times their ratio.

    python -m eagle3.sweep.curve runs/a/metrics.json runs/b/metrics.json --plot curve.png

A run written before ``train_samples`` was recorded takes its count after a colon:
``runs/old/metrics.json:16423``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from eagle3.errors import Eagle3Error


def read_run(arg: str) -> dict:
    """``metrics.json`` of a run named by ``PATH`` or ``PATH:SAMPLES`` (the latter sets
    ``train_samples`` for a run that did not record it); ``_source`` records the path.

    Raises:
        Eagle3Error: a missing or unreadable file, not a JSON object, a count that is not a
            positive whole number, or a count that contradicts the one the run recorded.
    """
    path, n = arg, None
    if not Path(arg).is_file() and ":" in arg:
        head, _, tail = arg.rpartition(":")
        if Path(head).is_file():
            if not tail.isdigit() or int(tail) <= 0:
                raise Eagle3Error(f"{arg}: the count after the colon must be a positive whole number, e.g. {head}:16423")
            path, n = head, int(tail)
    try:
        m = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise Eagle3Error(f"cannot read the run metrics {path}: {e}") from e
    if not isinstance(m, dict):
        raise Eagle3Error(f"{path} is not a train.py metrics.json (a JSON object)")
    if n is not None:
        if m.get("train_samples") not in (None, n):
            raise Eagle3Error(f"{path} records train_samples {m['train_samples']}, not {n}; drop ':{n}'")
        m["train_samples"] = n
    m["_source"] = str(path)
    return m


def _number(v, what: str, lo: float, hi: float) -> float:
    """``v`` as a finite float in ``[lo, hi]``, or an :class:`Eagle3Error` naming ``what``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise Eagle3Error(f"{what} is {v!r}, not a number in [{lo}, {hi}]")
    return float(v)


def _accs(v, what: str) -> list[float]:
    if not isinstance(v, list) or not v:
        raise Eagle3Error(f"{what} is {v!r}, not a list of agreements per TTT step")
    return [_number(a, what, 0.0, 1.0) for a in v]


def curve_points(metrics: list[dict]) -> list[dict]:
    """One point per run, sorted by training samples.

    Args:
        metrics: ``metrics.json`` dicts of finished runs (``train_samples``,
            ``validation.step_acc``, ``validation.replay_tau``; optional ``step``, ``train.step_acc``).

    Returns:
        ``[{samples, steps, val_acc: [K], replay_tau, train_acc: [K] | None}]``, fewest samples first.

    Raises:
        Eagle3Error: a run without those fields or with values out of range (naming the file and
            the field; a run written before ``train_samples`` existed is passed as ``PATH:SAMPLES``),
            runs with different numbers of TTT steps, or two runs with the same number of samples.
    """
    pts = []
    for i, m in enumerate(metrics):
        src = m.get("_source", f"run {i}")
        n = m.get("train_samples")
        if n is None:
            raise Eagle3Error(f"{src} has no train_samples (written before it was recorded, or not a train.py "
                              f"metrics.json); pass it as {src}:SAMPLES")
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise Eagle3Error(f"{src}: train_samples is {n!r}, not a positive whole number")
        val = m.get("validation")
        if not isinstance(val, dict) or "step_acc" not in val or val.get("replay_tau") is None:
            raise Eagle3Error(f"{src} has no validation.step_acc / validation.replay_tau: pass the metrics.json of "
                              "a finished train.py run with a validation split")
        train = m.get("train") if isinstance(m.get("train"), dict) else {}
        pts.append({"samples": n, "steps": m.get("step"), "source": src,
                    "val_acc": _accs(val["step_acc"], f"{src}: validation.step_acc"),
                    "replay_tau": _number(val["replay_tau"], f"{src}: validation.replay_tau", 1.0, 1e6),
                    "train_acc": _accs(train["step_acc"], f"{src}: train.step_acc") if train.get("step_acc") else None})
    pts.sort(key=lambda p: p["samples"])
    if len({len(p["val_acc"]) for p in pts}) > 1:
        raise Eagle3Error("the runs validate different numbers of TTT steps ("
                          + ", ".join(f"{p['source']}: {len(p['val_acc'])}" for p in pts) + "); compare runs of one recipe")
    seen = [p["samples"] for p in pts]
    if len(set(seen)) != len(seen):
        raise Eagle3Error(f"two runs share a training-sample count ({seen}): a curve needs distinct subsets")
    return pts


def gains_per_doubling(points: list[dict]) -> list[dict]:
    """Gain of validation top-1 (first TTT step) and replay tau per doubling of the samples
    between consecutive points of :func:`curve_points`.

    Returns:
        ``[{from, to, acc0, replay_tau}]``: ``to`` samples against ``from``, gains per doubling.
    """
    out = []
    for a, b in zip(points, points[1:]):
        d = math.log2(b["samples"] / a["samples"])
        out.append({"from": a["samples"], "to": b["samples"], "acc0": (b["val_acc"][0] - a["val_acc"][0]) / d,
                    "replay_tau": (b["replay_tau"] - a["replay_tau"]) / d})
    return out


def format_curve(points: list[dict]) -> str:
    """A markdown table of the points and, below it, the gains per doubling."""
    lines = ["| training samples | steps | validation top-1 per TTT step | replay tau | training top-1 (last batches) |",
             "|---:|---:|---|---:|---|"]
    for p in points:
        tr = " / ".join(f"{a:.3f}" for a in p["train_acc"]) if p["train_acc"] else "-"
        lines.append(f"| {p['samples']:,} | {p['steps'] or '-'} | {' / '.join(f'{a:.3f}' for a in p['val_acc'])} "
                     f"| {p['replay_tau']:.3f} | {tr} |")
    if len({p["steps"] for p in points}) > 1:
        lines.append("\nnote: the runs trained for different step counts "
                     f"({', '.join(str(p['steps']) for p in points)}): the curve mixes data and training length")
    for g in gains_per_doubling(points):
        lines.append(f"\n{g['from']:,} -> {g['to']:,} samples: per doubling, top-1 (step 0) {g['acc0']:+.4f}, "
                     f"replay tau {g['replay_tau']:+.4f}")
    return "\n".join(lines)


def plot_curve(points: list[dict], path) -> Path:
    """Write a PNG: validation top-1 per TTT step (left) and replay tau (right) against training
    samples on a log-2 axis; returns the path.

    Raises:
        Eagle3Error: a path not ending in ``.png``, or one that cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p["samples"] for p in points]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    for k in range(len(points[0]["val_acc"])):
        ax1.plot(xs, [p["val_acc"][k] for p in points], "o-", label=f"TTT step {k}")
    ax2.plot(xs, [p["replay_tau"] for p in points], "o-", color="black")
    for ax, title in ((ax1, "validation top-1 agreement"), (ax2, "serving-replay tau (validation)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("training samples")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax1.legend()
    fig.tight_layout()
    path = Path(path)
    try:
        if path.suffix.lower() != ".png":
            raise ValueError("the name does not end in .png")
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, format="png")
    except (OSError, ValueError) as e:
        raise Eagle3Error(f"cannot write the plot to {path} ({e}); pass --plot a writable .png path") from e
    finally:
        plt.close(fig)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("metrics", nargs="+", help="metrics.json of each run (PATH or PATH:SAMPLES)")
    ap.add_argument("--plot", help="write the PNG here")
    a = ap.parse_args(argv)
    points = curve_points([read_run(p) for p in a.metrics])
    print(format_curve(points))
    if a.plot is not None:
        print(f"plot: {plot_curve(points, a.plot)}")


if __name__ == "__main__":
    from eagle3.cli import run_tool

    run_tool(main)
