"""Data-parallel worker processes shared by the extract and evaluate stages.

A stage that runs ``workers > 1`` copies of itself spawns one process per worker with
a copy of its typed config (``worker`` set), waits for all, and merges what they wrote.
Processes are started with ``spawn`` (CUDA cannot be forked), each with an equal share
of the host's CPU threads, and report failure through their exit code; an
:class:`~eagle3.errors.Eagle3Error` in a worker prints one line.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import sys
from typing import Any, Sequence

from eagle3.errors import Eagle3Error

log = logging.getLogger("eagle3")


def _entry(fn_path: str, cfg: Any, worker: int, threads: int) -> None:
    import torch

    logging.basicConfig(level=logging.INFO, format=f"[%(asctime)s][worker {worker}] %(message)s")
    torch.set_num_threads(threads)  # the workers share the host's cores; oversubscribed threads thrash
    module, name = fn_path.rsplit(".", 1)
    fn = getattr(importlib.import_module(module), name)
    try:
        fn(cfg)
    except Eagle3Error as e:
        print(f"error (worker {worker}): {e}", file=sys.stderr)
        sys.exit(2)


def run_workers(fn_path: str, cfgs: Sequence[Any], what: str) -> None:
    """Run ``fn(cfgs[w])`` in one spawned process per worker and wait for all.

    Args:
        fn_path: dotted path of the stage function (``eagle3.extract.run.run_extract``).
        cfgs: one config per worker.
        what: the stage's name in messages (``extraction``, ``evaluation``).

    Raises:
        Eagle3Error: one or more workers exited non-zero (their finished work is kept;
            the message says to run the same command again).
    """
    import os

    ctx = mp.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // max(1, len(cfgs)))
    procs = []
    for w, c in enumerate(cfgs):
        p = ctx.Process(target=_entry, args=(fn_path, c, w, threads), name=f"{what}-worker-{w}")
        p.start()
        procs.append(p)
    try:
        for p in procs:
            p.join()
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        raise
    failed = [(w, p.exitcode) for w, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise Eagle3Error(
            f"{what} worker(s) " + ", ".join(f"{w} (exit code {c})" for w, c in failed)
            + " failed (see their messages above); the work they finished is kept: run the same command again to resume"
        )


def worker_devices(device: str, devices: Sequence[str], workers: int, setting: str) -> list[str]:
    """One device per worker: ``devices`` when given, else ``cuda:0..N-1`` on CUDA
    (``cpu`` for all on a CPU).

    Args:
        device: the stage's device setting (``auto``, ``cpu``, ``cuda``, ``cuda:N``).
        devices: explicit per-worker devices (a GPU may repeat: several workers share it).
        setting: the config key of ``devices``, named in errors.

    Raises:
        Eagle3Error: a device list of the wrong length, or fewer GPUs than workers.
    """
    import torch

    if devices:
        if len(devices) != workers:
            raise Eagle3Error(f"{setting} lists {len(devices)} devices for {workers} workers; give one per worker")
        return [str(d) for d in devices]
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return ["cpu"] * workers
    have = torch.cuda.device_count()
    if have < workers:
        raise Eagle3Error(f"{workers} workers need {workers} GPUs (one replica each) but {have} are visible; "
                          f"use fewer workers or list the devices in {setting}=[...] (a GPU may be listed twice)")
    return [f"cuda:{i}" for i in range(workers)]
