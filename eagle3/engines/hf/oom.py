"""Batches under a GPU memory limit: on CUDA out-of-memory, halve the batch limits and go on.

Several target replicas often share one GPU during extraction (``parallel.devices`` may list a
GPU several times, and several extractions may run at once). How much memory each batch needs
depends on the prompts it meets, so a plan that fits at the start can run out of memory
hours later, after another process grew. :func:`run_in_batches` then halves the engine's
batch limits (rows and padded tokens), frees the cache and plans again the items not yet
done; items finished before the failure are kept. Accelerate's
``find_executable_batch_size`` does the same for a training loop (a fixed batch size); here
batches are planned from prompt lengths, so the limits are what shrink.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional

import torch

from eagle3.errors import GPUMemoryError

log = logging.getLogger("eagle3")

MAX_HALVINGS = 6  # at most 1/64 of the configured limits; then the error is the user's to fix


def run_in_batches(limits: dict, keys: tuple[str, ...], lengths: list[int],
                   plan: Callable[[list[int]], list[list[int]]], run: Callable[[list[int]], None], what: str,
                   on_shrink: Optional[Callable[[], None]] = None,
                   progress: Callable[[list], Iterable] = lambda batches: batches) -> None:
    """Call ``run(idx)`` for every batch of item indices, halving ``limits`` on out-of-memory.

    Args:
        limits: the engine's batch limits (``{"generate_batch_size": 256, "max_batch_tokens":
            65536, ...}``), halved in place under memory pressure, so later calls start from
            what fitted.
        keys: the entries of ``limits`` this work is planned with.
        lengths: ``[n]`` token counts of the items.
        plan: batches of positions into the list of lengths it is given (e.g.
            ``eagle3.engines.hf.engine._batches`` with the current limits).
        run: does one batch of item indices (into ``lengths``) and stores its results.
        what: named in the warning and the error (``"generate"``, ``"capture"``).
        on_shrink: called after a halving (e.g. to drop a cache sized from the old limits).
        progress: wraps each plan's batches (a progress bar).

    Raises:
        GPUMemoryError: out of memory again after ``MAX_HALVINGS`` halvings (fewer replicas on
            the GPU, or lower the limits, is the fix); other errors propagate unchanged.
    """
    done = [False] * len(lengths)
    halvings = 0
    while True:
        pending = [i for i, d in enumerate(done) if not d]
        if not pending:
            return
        idx: list[int] = []
        try:
            for batch in progress(plan([lengths[i] for i in pending])):
                idx = [pending[j] for j in batch]
                run(idx)
                for i in idx:
                    done[i] = True
            return
        except torch.OutOfMemoryError as e:
            message = str(e).splitlines()[0] if str(e) else "CUDA out of memory"
        # here, outside the except block, the error's traceback is gone and with it the frames
        # that held the failed batch's tensors: only now can the cache be given back
        halvings += 1
        now = ", ".join(f"{k}={limits[k]}" for k in keys)
        if halvings > MAX_HALVINGS:
            raise GPUMemoryError(
                f"{what} ran out of GPU memory on a batch of {len(idx)} item(s) (longest {max(lengths[i] for i in idx)} "
                f"tokens) even at {now}, after {MAX_HALVINGS} halvings: run fewer replicas on this GPU "
                f"(parallel.workers, or other jobs), or lower capture.max_length ({message})"
            )
        for k in keys:
            limits[k] = max(1, limits[k] // 2)
        if on_shrink is not None:
            on_shrink()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log.warning("%s ran out of GPU memory on a batch of %d item(s) at %s; going on with %s (%d of %d items "
                    "left; set the engine's limits lower to start there)", what, len(idx), now,
                    ", ".join(f"{k}={limits[k]}" for k in keys), len(pending) - sum(done[i] for i in pending),
                    len(lengths))
