"""Glue shared by the thin Hydra entry points: the command-line checks before Hydra starts, running a stage."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from eagle3.errors import Eagle3Error

log = logging.getLogger("eagle3")


def unknown_keys(cfg: DictConfig, prefix: str = "") -> list[tuple[str, list[str]]]:
    """Keys of ``cfg`` that its schema does not have, with the schema's keys at that level.

    A ``+key=value`` override adds a key Hydra's struct mode would otherwise refuse, and
    ``OmegaConf.to_object`` then sets it on the dataclass as a stray attribute that nothing
    reads: a misspelt setting (``+loop.max_step=5``) would be ignored without a word.
    Nodes typed by a dataclass of :mod:`eagle3.config` are checked; plain dicts are free-form.

    Returns:
        ``[(dotted key, [the keys allowed beside it]), ...]`` in the order met.
    """
    import dataclasses

    kind = OmegaConf.get_type(cfg)
    if not dataclasses.is_dataclass(kind):
        return []
    allowed = [f.name for f in dataclasses.fields(kind) if f.name != "defaults"]
    out: list[tuple[str, list[str]]] = []
    for key in cfg.keys():
        if key not in allowed and key != "defaults":
            out.append((f"{prefix}{key}", allowed))
            continue
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
            out += unknown_keys(node, f"{prefix}{key}.")
    return out


def to_typed(cfg: DictConfig) -> Any:
    """Hydra's composed config -> the typed dataclass tree of :mod:`eagle3.config`.

    Raises:
        Eagle3Error: a key the schema does not have (:func:`unknown_keys`), named with the
            nearest allowed one.
    """
    import difflib

    bad = unknown_keys(cfg)
    if bad:
        key, allowed = bad[0]
        leaf, parent = key.rsplit(".", 1)[-1], key.rpartition(".")[0]
        near = difflib.get_close_matches(leaf, allowed, n=1)
        hint = f"did you mean {parent + '.' if parent else ''}{near[0]}?" if near else (
            f"the settings there are {', '.join(allowed)}")
        raise Eagle3Error(f"'{key}' is not a setting of this stage (a '+' override adds keys nothing reads); {hint}")
    return OmegaConf.to_object(cfg)


class Terminated(SystemExit):
    """Raised in the main thread on SIGTERM (``timeout``, a job scheduler, ``kill``), so that
    every ``finally`` runs: the servers a stage launched are stopped, partial files are
    left as their atomic writes left them. Exit code 143 (128 + SIGTERM), as the signal's own."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated(128 + signum)


def run_stage(fn: Callable[[Any], Any], cfg: DictConfig) -> Any:
    """Run one stage; an :class:`Eagle3Error` becomes one line on stderr and exit code 2;
    SIGTERM becomes :class:`Terminated` (clean-up runs, exit code 143)."""
    import signal
    import threading

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return fn(to_typed(cfg))
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Terminated:
        print("terminated (SIGTERM): stopped what this stage started", file=sys.stderr)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def run_tool(main: Callable[[Optional[Sequence[str]]], Any], argv: Optional[Sequence[str]] = None) -> Any:
    """Run a plain argparse tool's ``main(argv)`` (``python -m eagle3.sweep.curve``, the CPU
    diagnostics in ``benchmarks/``): an :class:`Eagle3Error` becomes one line on stderr and exit
    code 2, as in :func:`run_stage`."""
    try:
        return main(argv)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def config_groups(conf_dir: Path, config_name: str) -> list[str]:
    """The config groups that ``<conf_dir>/<config_name>.yaml`` chooses in its defaults list.

    A group is a ``group: choice`` entry of the defaults list (``experiment: null``
    included) whose folder ``<conf_dir>/<group>/`` exists; the schema and ``_self_``
    entries are not groups. For ``train`` these are model, data, drafter, optim and
    experiment; for ``evaluate`` engine, model and data.
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


def _model_engine(conf_dir: Path, model: Optional[str]) -> Optional[str]:
    """The engine ``conf/model/<model>.yaml`` selects (``override /engine@_global_.engine: sglang``
    in its defaults list, as ``kimi-k25-int4`` does), or None."""
    path = Path(conf_dir) / "model" / f"{model}.yaml"
    if not model or not path.is_file():
        return None
    for entry in OmegaConf.load(path).get("defaults") or []:
        if isinstance(entry, (DictConfig, dict)):
            for key, value in entry.items():
                if str(key).startswith("override") and str(key).split("@")[0].split()[-1].strip("/") == "engine":
                    return str(value)
    return None


def unknown_override_key(overrides: Sequence[str], schema: type, groups: Sequence[str] = (),
                         conf_dir: Optional[Path] = None) -> Optional[str]:
    """One sentence naming a plain ``key=value`` override whose key ``schema`` lacks, or None.

    Hydra refuses such a key in several lines and suggests ``+key=value``, which adds a
    key nothing reads (:func:`to_typed` then refuses it). The key is checked along the
    dataclass fields of ``schema``; ``engine.*`` along the schema of the engine chosen
    (``engine=`` on the command line, else the one the chosen model's config selects when
    ``conf_dir`` is given (:func:`_model_engine`), else the stage's default, :data:`ENGINE_SCHEMAS`).
    Below a field that is no dataclass (dicts, lists) it is left to Hydra, as are
    ``+``/``++``/``~`` overrides, ``hydra.*`` and ``group/option`` keys and the config ``groups``.
    """
    import dataclasses
    import difflib
    import typing

    from eagle3.config_engines import ENGINE_SCHEMAS

    defaults = next((f.default_factory() for f in dataclasses.fields(schema)  # type: ignore[misc]
                     if f.name == "defaults" and f.default_factory is not dataclasses.MISSING), [])
    engine = next((d["engine"] for d in defaults if isinstance(d, dict) and "engine" in d), None)
    model = next((d["model"] for d in defaults if isinstance(d, dict) and "model" in d), None)
    chosen = None
    for ov in overrides:
        key, sep, value = ov.partition("=")
        if key.strip() == "engine" and sep:
            chosen = value.strip()
        if key.strip() == "model" and sep:
            model = value.strip()
    engine = chosen or (_model_engine(conf_dir, model) if conf_dir is not None else None) or engine
    for ov in overrides:
        key, sep, _ = ov.partition("=")
        key = key.strip()
        if not sep or not key or key[0] in "+~" or "@" in key or "/" in key or key.split(".")[0] == "hydra" or key in groups:
            continue
        kind, seen = schema, []
        for part in key.split("."):
            fields = {f.name: f for f in dataclasses.fields(kind) if f.name != "defaults"}
            if part not in fields:
                near = difflib.get_close_matches(part, list(fields), n=1)
                where = ".".join(seen)
                hint = (f"did you mean {where + '.' if where else ''}{near[0]}?" if near
                        else f"the settings there are {', '.join(fields)}")
                owner = f"engine={engine}" if seen[:1] == ["engine"] else "this stage"
                return f"'{key}' is not a setting of {owner}; {hint}"
            seen.append(part)
            hint_type = typing.get_type_hints(kind).get(part)
            args = [a for a in typing.get_args(hint_type) if a is not type(None)]  # Optional[X] -> X
            kind = args[0] if len(args) == 1 else hint_type
            if seen == ["engine"] and kind is typing.Any:
                kind = ENGINE_SCHEMAS.get(engine)  # None (an unknown engine): Hydra says so
            if not dataclasses.is_dataclass(kind):
                break
    return None


def exit_on_unknown_key(schema: type, conf_dir: Path, config_name: str, argv: Optional[Sequence[str]] = None) -> None:
    """Before Hydra starts: exit with code 2 and one line on stderr when the command line
    (``argv``, default ``sys.argv[1:]``) sets a key that ``schema`` does not have
    (:func:`unknown_override_key`)."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    problem = unknown_override_key(overrides, schema, config_groups(conf_dir, config_name), conf_dir)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)


def output_dir_problem(path: str | Path) -> Optional[str]:
    """One sentence when the folder ``path`` cannot be created or used because it, or a
    folder above it, is an existing file (not a folder); None otherwise."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        return f"output_dir={p} is an existing file, not a folder; pass output_dir= a folder path, or move that file away"
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                return (f"output_dir={p} lies inside {parent}, which is a file, not a folder; "
                        "pass output_dir= a folder path, or move that file away")
            break
    return None


def output_dir_override_problem(overrides: Sequence[str]) -> Optional[str]:
    """:func:`output_dir_problem` of an ``output_dir=PATH`` override (``+`` / ``++`` prefixed
    too; each path of a ``--multirun`` comma list), or None.

    Hydra creates ``output_dir`` as its run folder (``hydra.run.dir: ${output_dir}``)
    before the stage starts and fails with a traceback when it names a file; the entry
    points check the command line first. Interpolations (``${...}``) are left to Hydra.
    """
    for ov in overrides:
        key, sep, value = ov.lstrip("+").partition("=")
        if not sep or key != "output_dir":
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if not value or "${" in value:
            continue
        for candidate in [value] + (value.split(",") if "," in value else []):
            problem = output_dir_problem(candidate.strip()) if candidate.strip() else None
            if problem:
                return problem
    return None


def exit_on_bad_output_dir(argv: Optional[Sequence[str]] = None) -> None:
    """Before Hydra starts: exit with code 2 and one line on stderr when the command line
    (``argv``, default ``sys.argv[1:]``) sets ``output_dir=`` to an existing file (or a
    path under one), which Hydra could not create as its run folder."""
    problem = output_dir_override_problem(list(sys.argv[1:] if argv is None else argv))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
