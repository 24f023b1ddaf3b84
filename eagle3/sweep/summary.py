"""Summaries of Hydra multirun sweeps (``python train.py -m drafter.ttt_steps=1,3,7``).

Each job of a sweep records a flat summary of its results with
:func:`record_job_summary` (``summary.json`` in the Hydra job folder: the job's
overrides, the path of its full metrics file and a few numbers). When the sweep ends,
:class:`SummaryCallback` (listed under ``hydra.callbacks`` in ``conf/train.yaml`` and
``conf/evaluate.yaml``) collects them into one markdown table, printed and written to
``<sweep dir>/summary.md`` (and ``summary.json``).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback

from eagle3.sweep.record import SUMMARY_FILE

log = logging.getLogger("eagle3")

def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def collect(sweep_dir: str | Path) -> list[dict]:
    """The ``summary.json`` of every job under ``sweep_dir`` (job number order)."""
    rows = []
    for p in Path(sweep_dir).glob(f"*/{SUMMARY_FILE}"):
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        d["job"] = p.parent.name
        rows.append(d)

    def key(d):
        return (0, int(d["job"])) if d["job"].isdigit() else (1, d["job"])

    return sorted(rows, key=key)


def summary_table(rows: list[dict]) -> str:
    """Markdown table: one row per job, its overrides then its summary columns."""
    if not rows:
        return "(no job recorded a summary)\n"
    cols: list[str] = []
    for r in rows:
        for k in r.get("summary", {}):
            if k not in cols:
                cols.append(k)
    head = "| job | overrides | " + " | ".join(cols) + " |"
    sep = "|---|---|" + "---|" * len(cols)
    lines = [head, sep]
    for r in rows:
        s = r.get("summary", {})
        lines.append(
            f"| {r['job']} | {' '.join(r.get('overrides', [])) or '-'} | "
            + " | ".join(_fmt(s.get(c)) for c in cols) + " |"
        )
    return "\n".join(lines) + "\n"


def write_learning_curve(sweep_dir: str | Path, rows: list[dict]) -> Optional[Path]:
    """For a training sweep over ``loop.train_fraction`` (every job sets it): the learning curve
    of :mod:`eagle3.sweep.curve` as ``learning_curve.md`` and ``learning_curve.png``; returns the
    .md path, or None for any other sweep. A curve that cannot be drawn (a job without
    validation, two equal subsets) is logged, and the sweep's table stands."""
    from eagle3.errors import Eagle3Error

    if len(rows) < 2 or not all(any(o.startswith("loop.train_fraction=") for o in r.get("overrides", []))
                                and str(r.get("metrics_path") or "").endswith("metrics.json") for r in rows):
        return None
    from eagle3.sweep.curve import curve_points, format_curve, plot_curve, read_run

    sweep_dir = Path(sweep_dir)
    try:
        points = curve_points([read_run(r["metrics_path"]) for r in rows])
        plot_curve(points, sweep_dir / "learning_curve.png")
    except Eagle3Error as e:
        log.warning("no learning curve for this sweep: %s", e)
        return None
    path = sweep_dir / "learning_curve.md"
    path.write_text(format_curve(points) + "\n")
    return path


def write_summary(sweep_dir: str | Path) -> Path:
    """Write ``summary.md``/``summary.json`` for a finished sweep (and, over
    ``loop.train_fraction``, :func:`write_learning_curve`); returns the .md path."""
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    table = summary_table(rows)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "summary.md").write_text(table)
    (sweep_dir / "summary.json").write_text(json.dumps(rows, indent=1))
    write_learning_curve(sweep_dir, rows)
    return sweep_dir / "summary.md"


class SummaryCallback(Callback):
    """Hydra callback: at the end of a multirun, print and save the sweep's table."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        path = write_summary(sweep_dir)
        print(f"\nsweep summary ({path}):\n{path.read_text()}")
        curve = sweep_dir / "learning_curve.md"
        if curve.exists():
            print(f"learning curve ({curve}, {curve.with_suffix('.png')}):\n{curve.read_text()}")
