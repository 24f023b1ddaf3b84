"""The run record ``<output_dir>/train_config.json``: what a resumed run must share with the run it resumes.

The first launch in an ``output_dir`` writes the record; every later launch (a resume)
compares its own with it and refuses to continue when a setting that changes the result
differs. Hydra writes ``.hydra/config.yaml`` into the same folder, but it rewrites that
file at every launch, so after a resume it describes the resuming launch, not the run the
checkpoints came from; hence this separate record, written once. It holds the resolved
configuration minus the settings that may change on resume (:data:`RESUMABLE_KEYS`, which
would only repeat Hydra's file), plus what Hydra's file does not hold: the features'
manifest hashes and the global batch (``micro_batches_per_step``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3.errors import Eagle3Error
from eagle3.io import sha256_file, write_json_atomic

RECORD = "train_config.json"
# Settings that may change between a run and its resume (everything else must match).
RESUMABLE_KEYS = ("loop.grad_accum", "loop.log_every", "loop.save_every", "loop.eval_every", "loop.num_workers", "loop.tracker",
                  "loop.time_limit_min", "loop.compile_drafter", "loop.fused_loss", "loop.collective_timeout_s",
                  "loop.pad_multiple",  # padding is masked out of the loss (tests/test_train.py)
                  "drafter.ttt_attention", "drafter.ttt_chain_chunk",  # forms of one attention (tests/test_ttt.py)
                  "export", "device", "cache_dir", "output_dir",
                  # features=online: how far ahead it captures, where the cache lives, how a server is reached
                  "features.queue_depth", "features.cache_dir", "features.retry_timeout_s",
                  "engine.url", "engine.urls", "engine.host", "engine.port", "engine.python", "engine.launch_timeout_s",
                  "engine.request_timeout_s", "engine.connect_timeout_s", "engine.max_retries", "engine.backoff_s")


# Settings added after records were first written, with the value that reproduces what runs did
# before them: a record without one is read as holding that value (so an unchanged command resumes).
ADDED_SETTINGS = {"drafter.feature_noise": 0.0, "loop.train_fraction": 1.0, "drafter.target_temperature": 1.0,
                  "feature_settings.mode": "offline", "feature_settings.cache_gb": 0.0}


def flatten(d: Any, prefix: str = "") -> dict:
    """A nested dict as ``{"a.b.c": leaf}``; lists and scalars are leaves."""
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): d}


def _resumable(key: str) -> bool:
    return any(key == r or key.startswith(r + ".") for r in RESUMABLE_KEYS)


def _without_resumable(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if _resumable(f"{prefix}{k}"):
            continue
        out[k] = _without_resumable(v, f"{prefix}{k}.") if isinstance(v, dict) else v
    return out


def config_dict(cfg: Any) -> dict:
    """A :class:`eagle3.config.TrainConfig` (or a plain dict) as resolved plain containers, without ``defaults``."""
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True) if not isinstance(cfg, dict) else dict(cfg)
    c.pop("defaults", None)
    return c


def run_record(cfg: Any, dirs: list[Path], micro_batches_per_step: int) -> dict:
    """The record of this launch: the configuration less :data:`RESUMABLE_KEYS`, the features
    (``[{"dir", "manifest_sha256"}]``, one per folder) and ``micro_batches_per_step``.

    ``micro_batches_per_step`` is the optimizer step's global batch; grad_accum and the
    process count may change on resume as long as their product does not (2 processes x
    grad_accum 1 resume as 1 process x grad_accum 2).

    Raises:
        OSError: a features folder without a readable ``manifest.json``.
    """
    c = _without_resumable(config_dict(cfg))
    if (c.get("features") or {}).get("mode", "offline") == "offline":
        c.pop("engine", None)  # the capture engine is used by features=online only
    c["feature_settings"] = c.pop("features", {})
    c["features"] = [
        {"dir": str(d), "manifest_sha256": sha256_file(d / "manifest.json")} for d in dirs
    ]
    c["micro_batches_per_step"] = micro_batches_per_step
    return c


def check_resume_record(output_dir: Path, record: dict) -> None:
    """Write ``record`` as ``<output_dir>/train_config.json`` on the first launch; on later
    ones compare it with the stored record, settings in :data:`RESUMABLE_KEYS` excepted
    (a record written before they were left out may still hold them); a setting of
    :data:`ADDED_SETTINGS` missing from an older record counts as its listed value.

    Raises:
        Eagle3Error: a setting differs from the run stored in ``output_dir``.
    """
    path = output_dir / RECORD
    if not path.exists():
        write_json_atomic(path, record)
        return
    old = {**ADDED_SETTINGS, **flatten(json.loads(path.read_text()))}
    new = flatten(json.loads(json.dumps(record)))
    for k in sorted(set(old) | set(new)):
        if _resumable(k):
            continue
        if old.get(k, "<absent>") != new.get(k, "<absent>"):
            raise Eagle3Error(
                f"{output_dir} holds a training run with {k}={old.get(k, '<absent>')!r}, now {new.get(k, '<absent>')!r}; "
                "pass a new output_dir= (or delete that folder) to train with other settings"
            )


def tracker_config(cfg: Any, micro_batches_per_step: int) -> dict:
    """The hyperparameters given to the tracker (TensorBoard's hparams): the flattened
    configuration's scalars (int, float, str, bool) and ``micro_batches_per_step``."""
    c = dict(config_dict(cfg), micro_batches_per_step=micro_batches_per_step)
    return {k: v for k, v in flatten(c).items() if isinstance(v, (int, float, str, bool))}
