"""The train stage: an EAGLE-3 drafter with training-time test, through Accelerate.

``run_train(cfg)`` reads the extract stage's features folder, builds the draft
vocabulary from the training split, trains the drafter (:mod:`eagle3.train.ttt`), writes
validation metrics to ``<output_dir>/metrics.json`` and exports
``<output_dir>/export/sglang`` (and ``export/speculators`` where the optional
``speculators`` package is installed).

Loop: Accelerate owns the device and mixed precision (bf16 autocast with fp32 master
weights on CUDA; see :func:`eagle3.train.settings.resolve_mixed_precision` for the CPU
choice), gradient accumulation (``accelerator.accumulate``), gradient clipping, AdamW, a
warmup + cosine schedule (``transformers.get_scheduler``), TensorBoard through
``accelerator.log``. Batches are length-bucketed up to ``loop.max_tokens_per_batch``
padded tokens; their order is a pure function of ``(seed, epoch)``.

Resume is the normal path: checkpoints (``accelerator.save_state`` with the step
counter :class:`~eagle3.train.checkpoint.TrainState` and the scheduler registered) go to
``<output_dir>/checkpoints/step-NNNNNNNN``; running the same command again in the
same ``output_dir`` loads the newest complete one and continues with the same
sample order, so an interrupted run ends where an uninterrupted one would.
Settings that change the result are recorded in ``train_config.json`` and must
match on resume.

The data path, top to bottom: :func:`eagle3.train.build.build_run` (settings, features,
Accelerator, run record, draft vocabulary, drafter, optimizer, schedule, resume),
:func:`eagle3.train.loop.train_loop` (optimizer steps, logging, validation,
checkpoints), :func:`eagle3.train.finish.finish` (last checkpoint, final validation,
exports, ``metrics.json``).
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Optional

import torch

from eagle3.train.build import build_run
from eagle3.train.faults import peer_failures
from eagle3.train.finish import finish, stop
from eagle3.train.loop import train_loop


def run_train(cfg) -> dict:
    """The train stage (``python train.py``): resolve the target, train, export.

    Returns:
        The metrics written to ``<output_dir>/metrics.json`` plus ``output_dir`` and
        the export paths.

    Raises:
        Eagle3Error: missing/empty/incompatible features, a features/target mismatch,
            a changed configuration on resume, impossible sizes.
    """
    from eagle3.features import load_manifest
    from eagle3.paths import features_dirs
    from eagle3.target import load_target_embeddings, resolve_target
    from eagle3.train.settings import check_settings

    check_settings(cfg)  # settings and the features folders are said before the target is built (minutes on first use)
    for d in features_dirs(cfg):
        load_manifest(d)
    target = resolve_target(cfg.model, cfg.cache_dir)
    embed, lm_head = load_target_embeddings(cfg.model, cfg.cache_dir)
    return train_drafter(cfg, target, embed, lm_head)


def train_drafter(
    cfg,
    target: Any,
    embed: torch.Tensor,
    lm_head: Optional[torch.Tensor] = None,
    stop_after: Optional[int] = None,
    on_batch: Optional[Callable[[int, list], None]] = None,
    engine: Optional[Any] = None,
) -> dict:
    """Train (or resume training) a drafter for ``target`` on ``cfg``'s features.

    Args:
        cfg: a :class:`eagle3.config.TrainConfig`.
        target: a ``TargetInfo`` (name, hidden_size, vocab_size, aux_layer_ids,
            content_hash, architecture, quantization, heads, FFN, rope, eps).
        embed: the target's ``[V, H]`` embedding table; lm_head ``[V, H]`` (used when
            ``drafter.lm_head_init == "target"``).
        stop_after: stop (with a checkpoint) after this many optimizer steps, as an
            interrupted run would (tests).
        on_batch: called with ``(optimizer step, sample ids)`` for every micro-batch.
        engine: ``features=online``: the capture engine to use instead of one built from
            ``cfg.engine`` (closed at the end like a built one).

    Returns:
        The metrics dict (also in ``metrics.json``); ``{"interrupted": True, ...}``
        when stopped by ``stop_after``.

    Raises:
        Eagle3Error: see :func:`eagle3.train.build.build_run` and
            :func:`eagle3.train.loop.train_loop`; with several processes, another process died or
            stopped answering for ``loop.collective_timeout_s`` (:mod:`eagle3.train.faults`: the same
            command resumes from the newest checkpoint).
    """
    with peer_failures(cfg):  # several processes: a dead or stuck peer ends every other one with a clear error
        run = build_run(cfg, target, embed, lm_head, engine=engine)
        try:
            progress = train_loop(run, stop_after=stop_after, on_batch=on_batch)
            result = stop(run) if progress.interrupted else finish(run, progress)
        finally:
            if run.online is not None:
                run.online.close()
    # Several processes: free the DDP model while `group` still holds its process group, so that the group's
    # last reference goes through its Python binding, which releases the GIL before ~ProcessGroupGloo joins
    # gloo's worker threads. Dropped last by DDP's C++ Reducer (when `run` goes), the join ran with the GIL
    # held, and a worker still releasing the tensors of a finished collective waited for the GIL forever
    # (seen as a hang of one process at the end of a 2-process CPU run, about 1 launch in 40).
    group = getattr(run.model, "process_group", None)
    del run
    if group is not None:
        gc.collect()  # a DDP model in a reference cycle goes now, not after `group`
    del group
    return result
