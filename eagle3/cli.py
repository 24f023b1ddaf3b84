"""Glue shared by the thin Hydra entry points: the config check before Hydra starts, running a stage."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

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


def config_groups(conf_dir: Path, config_name: str) -> list[str]:
    """The config groups that ``<conf_dir>/<config_name>.yaml`` chooses in its defaults list.

    A group is a ``group: choice`` entry of the defaults list (``experiment: null``
    included) whose folder ``<conf_dir>/<group>/`` exists; the schema and ``_self_``
    entries are not groups. For ``train`` these are model, data, drafter, optim and
    experiment; for ``evaluate`` engine and model.
    """
    defaults = OmegaConf.load(Path(conf_dir) / f"{config_name}.yaml").get("defaults") or []
    groups = []
    for entry in defaults:
        if isinstance(entry, (DictConfig, dict)):
            for key in entry:
                name = str(key).split()[-1]  # "optional model", "override model" -> model
                if (Path(conf_dir) / name).is_dir():
                    groups.append(name)
    return groups


def unknown_group_choice(overrides: list[str], conf_dir: Path, groups: Sequence[str]) -> Optional[str]:
    """One sentence naming an unknown config-group choice on the command line, or None.

    Hydra reports a missing group option with a multi-line message and a traceback
    hint; the entry point checks the overrides first (``model=NAME``, ``+model=NAME``,
    comma lists for ``--multirun``) and lists the available ``conf/<group>/*.yaml``.
    Only the config groups ``groups`` are checked (:func:`config_groups` of the entry
    point's config).
    """
    for ov in overrides:
        key, sep, value = ov.lstrip("+").partition("=")
        if not sep or key not in groups:
            continue
        avail = sorted(p.stem for p in (Path(conf_dir) / key).glob("*.yaml"))
        for choice in value.split(","):
            choice = choice.strip()
            if choice and all(ch.isalnum() or ch in "-_." for ch in choice) and choice not in avail:
                return f"{key} '{choice}' is unknown; available {key} configs: {', '.join(avail)}"
    return None


def exit_on_unknown_choice(conf_dir: Path, config_name: str, argv: Optional[Sequence[str]] = None) -> None:
    """Before Hydra starts: exit with code 2 and one line on stderr when the command line
    (``argv``, default ``sys.argv[1:]``) chooses a config that ``conf_dir`` does not have
    in one of the groups of ``<config_name>.yaml``."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    problem = unknown_group_choice(overrides, conf_dir, config_groups(conf_dir, config_name))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
