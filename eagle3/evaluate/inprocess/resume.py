"""Resuming a stopped in-process evaluation.

Each finished benchmark is kept in ``output_dir/partial/<name>.json`` with a key: the
sha256 of everything that decides its records (speculative settings, target content
hash, dtype, device, attention, the export's fingerprint, seed, prompt limit and the
benchmark's prompt ids and text). The same command run again (e.g. after a time limit stopped
it) reuses the finished benchmarks whose key is unchanged and evaluates the rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Optional, Sequence

from eagle3.evaluate.inprocess.records import TurnRecord
from eagle3.spec import SpecSettings

log = logging.getLogger("eagle3")

PARTIAL_DIR = "partial"


def run_key(parts: dict) -> str:
    """Fingerprint of everything that decides a benchmark's records (sha256 of JSON)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def export_fingerprint(drafter_dir: Path) -> dict:
    """What identifies an export cheaply: its config and the weights' size and mtime."""
    w = drafter_dir / "model.safetensors"
    st = w.stat() if w.exists() else None
    cfg = (drafter_dir / "config.json").read_text() if (drafter_dir / "config.json").exists() else ""
    return {"config": cfg, "weights": [st.st_size, st.st_mtime_ns] if st else None}


def benchmark_keys(cfg, settings: SpecSettings, target_hash: str, dtype: str, device_type: str,
                   drafter_dir: Path, benchmarks: dict) -> dict[str, str]:
    """``{name: run_key}`` of every benchmark to evaluate.

    Args:
        cfg: the ``EvaluateConfig`` (``engine.attn_implementation``, ``seed``,
            ``max_prompt_tokens``).
        settings: the speculative settings.
        target_hash: the target's content hash.
        dtype: the loaded target's dtype as ``str(model.dtype)`` (``torch.float32``).
        device_type: ``cpu`` or ``cuda``.
        drafter_dir: the export folder (see :func:`export_fingerprint`).
        benchmarks: ``{name: datasets.Dataset}`` with ``id`` and ``messages`` columns.
    """
    base_key = {
        "settings": dataclasses.asdict(settings), "target": target_hash, "dtype": dtype,
        "device": device_type, "attn": cfg.engine.attn_implementation, "export": export_fingerprint(drafter_dir),
        "seed": cfg.seed, "max_prompt_tokens": cfg.max_prompt_tokens,
        "teacher_forced": bool(getattr(cfg, "teacher_forced", False)),  # records without the replay are not reused
    }
    # the prompts' text too: a prompt file edited in place keeps its line-number ids (data=jsonl)
    return {n: run_key({**base_key, "benchmark": n, "ids": [str(i) for i in ds["id"]],
                        "messages": run_key({"m": list(ds["messages"])})}) for n, ds in benchmarks.items()}


def load_partial(output_dir: Path, name: str, key: str) -> Optional[tuple[list[TurnRecord], list[str]]]:
    """Records of a benchmark finished by an earlier run with the same key, else None."""
    p = output_dir / PARTIAL_DIR / f"{name}.json"
    if not p.is_file():
        return None
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError:
        return None
    if d.get("key") != key:
        return None
    return [TurnRecord(**r) for r in d["records"]], list(d.get("warnings") or [])


def load_finished(output_dir: Path, keys: dict[str, str]) -> dict[str, tuple[list[TurnRecord], list[str]]]:
    """``{name: (records, warnings)}`` of the benchmarks in ``keys`` that an earlier run
    finished with the same key (see :func:`load_partial`), each one logged."""
    done = {}
    for n in keys:
        got = load_partial(output_dir, n, keys[n])
        if got is not None:
            done[n] = got
            log.info("%s: reusing the %d turns evaluated by an earlier run in %s", n, len(got[0]), output_dir)
    return done


def save_partial(output_dir: Path, name: str, key: str, records: Sequence[TurnRecord], warnings: Sequence[str]) -> None:
    """Keep a finished benchmark's records so a stopped run resumes after it (atomic)."""
    d = output_dir / PARTIAL_DIR
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{name}.json"
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps({"key": key, "records": [dataclasses.asdict(r) for r in records],
                               "warnings": list(warnings)}))
    os.replace(tmp, p)
