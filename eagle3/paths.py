"""Where each stage writes, and the Hydra job folder it runs in.

The defaults live once, in the typed schema (:mod:`eagle3.config`), as interpolations:
``extract`` writes ``data/features/<model>/<data>``, ``train`` reads that and writes
``data/drafters/<model>/<data>``, ``evaluate`` reads the export its engine serves under
``data/drafters/<model>/sharegpt`` (:func:`eagle3.export.export_dir`) and writes ``data/eval/<model>``.
Each stage's YAML sets ``hydra.run.dir: ${output_dir}`` and
``hydra.sweep.dir: ${output_dir}``, so Hydra's ``.hydra/config.yaml`` and log sit beside
the artifacts they produced, and a multirun puts job ``n`` in ``<output_dir>/<n>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


@dataclass(frozen=True)
class HydraJob:
    """The Hydra job this process runs (``hydra.runtime.output_dir``, mode, ``hydra.job.num``)."""

    dir: Path
    multirun: bool
    num: str


def hydra_job() -> Optional[HydraJob]:
    """The current Hydra job, or None outside ``@hydra.main`` (tests, spawned workers)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except Exception:  # noqa: BLE001  (ValueError when Hydra is not initialised)
        return None
    from omegaconf import OmegaConf

    multirun = hc.mode == RunMode.MULTIRUN
    num = OmegaConf.select(hc, "job.num", default=None, throw_on_missing=False)  # ??? in a single run
    return HydraJob(Path(hc.runtime.output_dir), multirun, str(num) if multirun else "")


def stage_output_dir(cfg: Any) -> Path:
    """The folder a stage writes: ``cfg.output_dir``, or job ``n``'s ``<output_dir>/<n>``
    in a Hydra multirun (so the jobs of a sweep never share a folder).

    Raises:
        Eagle3Error: ``output_dir`` is unset (a config built by hand without it).
    """
    from eagle3.errors import Eagle3Error

    job = hydra_job()
    if job is not None and job.multirun:
        return job.dir
    if not cfg.output_dir:
        raise Eagle3Error("output_dir is not set; pass output_dir=PATH")
    return Path(cfg.output_dir)


def features_dirs(cfg: Any) -> list[Path]:
    """Train's ``features_dir`` as a list: comma-separated for several folders."""
    return [Path(p.strip()) for p in str(cfg.features_dir).split(",") if p.strip()]
