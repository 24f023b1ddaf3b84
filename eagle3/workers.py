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

from eagle3.errors import Eagle3Error, GPUMemoryError

log = logging.getLogger("eagle3")

EXIT_USER_ERROR = 2  # an Eagle3Error: a setting to change; starting the worker again would fail again
EXIT_GPU_MEMORY = 3  # a GPUMemoryError: out of GPU memory at the smallest batches, often another replica's doing


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
        sys.exit(EXIT_GPU_MEMORY if isinstance(e, GPUMemoryError) else EXIT_USER_ERROR)


def run_workers(fn_path: str, cfgs: Sequence[Any], what: str, retries: int = 0) -> None:
    """Run ``fn(cfgs[w])`` in one spawned process per worker and wait for all.

    A worker that died of something other than a setting the user must fix (exit code 2,
    an :class:`~eagle3.errors.Eagle3Error`) is started again, alone with the others that
    failed, up to ``retries`` times: out of GPU memory among replicas sharing one GPU (exit
    code 3, a :class:`~eagle3.errors.GPUMemoryError` after the batch limits were halved to
    their floor), or a process killed by the host, usually passes once the other workers are
    done.
    The stage function must resume from the work it finished (extraction does).

    Args:
        fn_path: dotted path of the stage function (``eagle3.extract.run.run_extract``).
        cfgs: one config per worker.
        what: the stage's name in messages (``extraction``, ``evaluation``).
        retries: how many times failed workers are started again (0: never).

    Raises:
        Eagle3Error: one or more workers still failed (their finished work is kept;
            the message says to run the same command again).
    """
    import os

    ctx = mp.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // max(1, len(cfgs)))
    todo = list(range(len(cfgs)))
    for attempt in range(retries + 1):
        procs = {}
        for w in todo:
            p = ctx.Process(target=_entry, args=(fn_path, cfgs[w], w, threads), name=f"{what}-worker-{w}")
            p.start()
            procs[w] = p
        try:
            for p in procs.values():
                p.join()
        except KeyboardInterrupt:
            for p in procs.values():
                p.terminate()
            raise
        failed = [(w, p.exitcode) for w, p in procs.items() if p.exitcode != 0]
        retryable = [w for w, code in failed if code != EXIT_USER_ERROR]
        if not failed or len(retryable) < len(failed) or attempt == retries:
            break
        todo = retryable
        log.warning("%s worker(s) %s failed (exit code %s); starting them again to resume their work (retry %d of %d)",
                    what, ", ".join(str(w) for w in todo), ", ".join(str(c) for _, c in failed), attempt + 1, retries)
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
