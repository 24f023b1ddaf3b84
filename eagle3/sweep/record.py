"""One job's flat summary for a Hydra multirun's table (``summary.json`` in the job folder).

Kept apart from :mod:`eagle3.sweep.summary` (which reads every job's file when the sweep
ends) so that the stages that write a summary, train and evaluate, import nothing that
reads training runs back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

SUMMARY_FILE = "summary.json"


def _job_context() -> Optional[tuple[Path, list[str]]]:
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        return Path(hc.runtime.output_dir), list(hc.overrides.task)
    except Exception:  # noqa: BLE001  (not running under Hydra)
        return None


def record_job_summary(summary: dict, metrics_path: Optional[str] = None) -> Optional[Path]:
    """Write ``summary.json`` into the current Hydra job folder (no-op outside Hydra).

    Args:
        summary: flat ``{column: number or str}`` for the sweep table.
        metrics_path: where the job's full metrics/report lives.

    Returns:
        The file written, or None outside Hydra.
    """
    ctx = _job_context()
    if ctx is None:
        return None
    job_dir, overrides = ctx
    job_dir.mkdir(parents=True, exist_ok=True)
    path = job_dir / SUMMARY_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"overrides": overrides, "metrics_path": metrics_path, "summary": summary}, indent=1))
    tmp.replace(path)
    return path
