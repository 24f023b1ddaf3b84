"""Data-parallel extraction: one spawned worker per device, then one manifest over all their shards.

Each worker runs :func:`eagle3.extract.run.run_extract` on its share of the generation
windows, so every window is generated with the same batch and seed as in a one-process
run and the merged folder equals a one-process extraction.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

from eagle3 import features
from eagle3.errors import Eagle3Error
from eagle3.extract.shards import REPLIES_DIR
from eagle3.extract.summary import STATS_FILE, _summary, format_summary, stats_part_name
from eagle3.io import read_json, remove_stale_temp_files, write_json_atomic
from eagle3.paths import stage_output_dir
from eagle3.target import resolve_target
from eagle3.workers import run_workers, worker_devices

log = logging.getLogger("eagle3")


def run_parallel(cfg) -> dict:
    """Data-parallel extraction: ``parallel.workers`` spawned workers, then one merged manifest.

    Worker ``w`` extracts generation windows ``w, w+N, ...`` on its own device into the
    shared output folder (shard files by global index, its own part manifest); when all
    have finished, :meth:`eagle3.features.FeatureWriter.merge_parts` writes one
    ``manifest.json`` listing every planned sample exactly once. Running the same command
    again after an interruption resumes every worker; a worker that crashed (CUDA out of
    memory, killed) is first started again ``parallel.retries`` times by this run.

    Raises:
        Eagle3Error: bad parallel settings, a failed worker (its finished shards are kept),
            or an inconsistent merge.
    """
    n = int(cfg.parallel.workers)
    if int(cfg.parallel.retries) < 0:
        raise Eagle3Error(f"parallel.retries={cfg.parallel.retries} must be >= 0 (0: a crashed worker is not started again)")
    if getattr(cfg.engine, "name", None) != "hf":
        raise Eagle3Error(
            f"parallel.workers={n} runs target replicas of the in-process hf engine; with engine="
            f"{getattr(cfg.engine, 'name', None)} list several servers in engine.urls and keep parallel.workers=1"
        )
    devices = worker_devices(str(cfg.engine.device), list(cfg.parallel.devices), n, "parallel.devices")
    out_dir = stage_output_dir(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    for folder in (out_dir, out_dir / REPLIES_DIR):  # what killed workers left half-written; no worker runs yet
        remove_stale_temp_files(folder)
    target = resolve_target(cfg.model, Path(cfg.cache_dir))  # build the target (e.g. the INT4 checkpoint) once, not N times
    log.info("extract: %d workers on %s", n, ", ".join(devices))
    cfgs = []
    for w, dev in enumerate(devices):
        wcfg = copy.deepcopy(cfg)
        wcfg.parallel.worker = w
        wcfg.engine.device = dev
        wcfg.output_dir = str(out_dir)
        cfgs.append(wcfg)
    t0 = time.time()
    run_workers("eagle3.extract.run.run_extract", cfgs, "extraction", retries=int(cfg.parallel.retries))
    writer = features.FeatureWriter.merge_parts(out_dir, n)
    side: dict = {}
    runs = []
    for w in range(n):
        part_side = read_json(out_dir / stats_part_name(w, n), {})
        runs.append(part_side.pop("_run", {}))
        side.update(part_side)
    write_json_atomic(out_dir / STATS_FILE, side)
    wall = time.time() - t0
    keys = ("samples", "tokens", "masked_tokens", "generated_tokens", "truncated", "dropped", "resumed_shards")
    this_run = {k: sum(r.get("this_run", {}).get(k, 0) for r in runs) for k in keys}
    this_run.update(wall_time_s=wall, total_time_s=wall, workers=n, devices=devices,
                    tokens_per_s=this_run["tokens"] / wall if wall > 0 else 0.0)
    data_stats = next((r["data_stats"] for r in runs if r.get("data_stats")), {})
    summary = _summary(cfg, target, writer.manifest, side, len(writer.manifest["plan"]), data_stats, this_run, out_dir)
    writer.finalize(summary)
    print(format_summary(summary))
    return summary
