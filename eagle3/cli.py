"""Glue shared by the thin Hydra entry points."""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from eagle3.errors import Eagle3Error

log = logging.getLogger("eagle3")


def to_typed(cfg: DictConfig) -> Any:
    """Hydra's composed config -> the typed dataclass tree of :mod:`eagle3.config`."""
    return OmegaConf.to_object(cfg)


def run_stage(fn: Callable[[Any], Any], cfg: DictConfig) -> Any:
    """Run one stage; an :class:`Eagle3Error` becomes one line on stderr and exit code 2."""
    try:
        return fn(to_typed(cfg))
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
