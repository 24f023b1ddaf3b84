"""Data-parallel in-process evaluation: ``workers`` processes, one merged report.

:func:`run_evaluate_parallel` starts one evaluate process per worker through
:func:`eagle3.workers.run_workers` (each runs :func:`eagle3.evaluate.run.run_evaluate`
on its share of the prompts), then merges their turn records into the report a
one-process run would write.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path

from eagle3.evaluate.benchmarks import benchmark_names
from eagle3.evaluate.inprocess.records import SAMPLES_FILE, TurnRecord, overall_summary, summarize_benchmark
from eagle3.evaluate.inprocess.resume import PARTIAL_DIR
from eagle3.paths import stage_output_dir
from eagle3.spec import SpecSettings

log = logging.getLogger("eagle3")

WORKERS_DIR = "workers"
#: what :func:`eagle3.workers.run_workers` runs in every worker process
WORKER_ENTRY = "eagle3.evaluate.run.run_evaluate"


def run_evaluate_parallel(cfg, settings: SpecSettings) -> dict:
    """``workers`` evaluation processes (hf engine), then their merged results (the stage
    writes them as one report).

    Worker ``w`` evaluates prompts ``w, w+N, ...`` of every benchmark on ``devices[w]``
    into ``output_dir/workers/W-of-N`` (a report of its own, and resumable partials);
    the merged report recomputes every measure from all turn records, so tau,
    acceptance rate, per-position acceptance and lossless matches equal a one-process
    run's. Timings are summed per prompt as usual; when workers share a device they
    measure that shared device (recorded in ``settings.workers`` and a warning).

    Raises:
        Eagle3Error: a worker failed (finished benchmarks are kept), bad device list.
    """
    from eagle3.workers import run_workers, worker_devices

    n = int(cfg.workers)
    devices = worker_devices(str(cfg.engine.device), list(cfg.devices), n, "devices")
    output_dir = stage_output_dir(cfg)
    cfgs = _worker_configs(cfg, devices, output_dir)
    log.info("evaluate: %d workers on %s", n, ", ".join(devices))
    run_workers(WORKER_ENTRY, cfgs, "evaluation")
    reports = [json.loads((Path(c.output_dir) / "report.json").read_text()) for c in cfgs]
    by_bench: dict[str, list[TurnRecord]] = {}
    for c in cfgs:
        for f in sorted((Path(c.output_dir) / PARTIAL_DIR).glob("*.json")):
            d = json.loads(f.read_text())
            by_bench.setdefault(f.stem, []).extend(TurnRecord(**r) for r in d["records"])
    names = [b for b in benchmark_names(cfg.data) if b in by_bench]
    records = [r for b in names for r in by_bench[b]]
    with open(output_dir / SAMPLES_FILE, "w") as out:  # the workers' per-turn lines, concatenated
        for c in cfgs:
            p = Path(c.output_dir) / SAMPLES_FILE
            if p.exists():
                out.write(p.read_text())
    results = copy.deepcopy(reports[0])
    for k in ("plots", "verdicts", "verdict", "headline"):
        results.pop(k, None)
    results["benchmarks"] = {b: summarize_benchmark(by_bench[b], settings) for b in names}
    results["overall"] = overall_summary(records, settings)
    results["settings"].update(device=", ".join(devices), workers=n, resumed_benchmarks=[])
    results["warnings"] = _merged_warnings(reports, devices, n)
    return results


def _worker_configs(cfg, devices: list[str], output_dir: Path) -> list:
    """One copy of ``cfg`` per worker: ``worker`` and its device set, its own output folder
    (``drafter_dir`` as given: each worker resolves it to the same export folder,
    :func:`eagle3.export.export_dir`)."""
    n = int(cfg.workers)
    cfgs = []
    for w, dev in enumerate(devices):
        c = copy.deepcopy(cfg)
        c.worker, c.engine.device = w, dev
        c.output_dir = str(output_dir / WORKERS_DIR / f"{w}-of-{n}")
        cfgs.append(c)
    return cfgs


def _merged_warnings(reports: list[dict], devices: list[str], n: int) -> list[str]:
    """The workers' warnings, each once; skipped-prompt counts added up over workers;
    a warning when workers shared a device (their timings then measure it shared)."""
    shared = len(set(devices)) < len(devices)
    warnings, skipped = [], {}
    for w in (x for r in reports for x in (r.get("warnings") or [])):
        m = re.match(r"^(\w+): (\d+) prompts longer than (max_prompt_tokens=\d+) were skipped$", w)
        if m:  # one count per worker: add them up
            key = (m.group(1), m.group(3))
            skipped[key] = skipped.get(key, 0) + int(m.group(2))
        elif w not in warnings:
            warnings.append(w)
    warnings += [f"{b}: {k} prompts longer than {lim} were skipped" for (b, lim), k in skipped.items()]
    if shared:
        warnings.append(f"{n} workers shared {', '.join(sorted(set(devices)))}: tokens/s and speed-up were measured on a "
                        "shared device (acceptance and lossless checks are unaffected); use workers=1 for batch-1 timings")
    return warnings
