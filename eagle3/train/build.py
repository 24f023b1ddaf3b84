"""Building a training run: every piece the loop and the finish need, made in a fixed order.

:func:`build_run` checks the settings, opens the features (:mod:`eagle3.train.data`),
creates the Accelerator (device, mixed precision, gradient accumulation, tracker), checks
the run record (:mod:`eagle3.train.record`), seeds, builds or reloads the draft
vocabulary of the training split, builds the drafter, AdamW and the warmup + cosine
schedule, and restores the newest complete checkpoint of ``output_dir``
(:mod:`eagle3.train.checkpoint`). The pieces travel to :func:`eagle3.train.loop.train_loop`
and :func:`eagle3.train.finish.finish` in a :class:`Run`. The order is part of the result:
the seed is set before the drafter's weights are drawn, and a resume restores them after.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from eagle3.devices import resolve_device
from eagle3.errors import Eagle3Error
from eagle3.features import FeatureDataset
from eagle3.io import remove_stale_temp_files
from eagle3.paths import features_dirs, stage_output_dir
from eagle3.train.checkpoint import TrainState, latest_checkpoint
from eagle3.train.data import (BatchPlan, length_bucketed_batches, make_loader, open_datasets, train_subset,
                               warn_on_degenerate_loss_mask)
from eagle3.model.drafter import DrafterArch, Eagle3Drafter
from eagle3.train.faults import process_group_kwargs
from eagle3.train.fused import compile_drafter_elementwise
from eagle3.train.online import OnlineFeatures, build_online
from eagle3.train.record import check_resume_record, run_record, tracker_config
from eagle3.train.settings import (check_device_settings, check_settings, default_max_tokens, drafter_arch, feature_mode,
                                   resolve_mixed_precision)
from eagle3.train.ttt import TTTCollator, TTTModel, target_to_draft_index
from eagle3.train.vocab import auto_draft_vocab_size, build_draft_vocab, count_label_tokens

log = logging.getLogger("eagle3")

DRAFT_VOCAB = "draft_vocab.safetensors"


@dataclass
class Run:
    """One training run's pieces, from :func:`build_run` to ``train_loop`` and ``finish``.

    Attributes:
        cfg: the :class:`eagle3.config.TrainConfig`.
        target: the ``TargetInfo`` the drafter is trained for.
        dirs, output_dir: the features folders read and the folder written.
        started: ``time.perf_counter()`` when the build began (seconds; for ``wall_time_s``).
        accelerator: the ``accelerate.Accelerator``; ``mixed_precision`` its setting.
        max_tokens: padded tokens per micro-batch.
        train_ds, val_ds, aux_ids: the feature splits and their aux layer ids.
        record: the run record (:func:`eagle3.train.record.run_record`).
        coverage: share of the training split's label tokens inside the draft vocabulary.
        arch: the drafter's sizes; ``model`` the prepared :class:`~eagle3.train.ttt.TTTModel`,
            ``params`` its trainable parameters, ``optimizer``/``scheduler`` AdamW and its schedule.
        state: the checkpointed progress counters (restored on resume).
        plan, total_steps: the global batch plan and the optimizer steps of the whole run.
        collator: the TTT ``collate_fn``; ``val_batches`` this process's validation batches.
        pin_memory: pin host batches (CUDA).
        online: the capture pipeline of ``features=online`` (:mod:`eagle3.train.online`); None offline.
    """

    cfg: Any
    target: Any
    dirs: list[Path]
    output_dir: Path
    started: float
    accelerator: Any
    mixed_precision: str
    max_tokens: int
    train_ds: FeatureDataset
    val_ds: FeatureDataset
    aux_ids: list[int]
    record: dict
    coverage: float
    arch: DrafterArch
    model: Any
    params: list
    optimizer: Any
    scheduler: Any
    state: TrainState
    plan: BatchPlan
    total_steps: int
    collator: TTTCollator
    val_batches: list[list[int]]
    pin_memory: bool
    online: Optional[OnlineFeatures] = None

    def loader(self, ds: FeatureDataset, batch_lists: list[list[int]], train: bool = False):
        """A loader of ``ds`` over ``batch_lists`` with the run's collator: a ``DataLoader`` with
        ``loop.num_workers`` workers over stored features, or (``features=online``) the capture
        pipeline of :mod:`eagle3.train.online` (``train``: its waits count as trainer idle time)."""
        if self.online is not None:
            return self.online.loader(ds, batch_lists, self.collator, train=train)
        return make_loader(ds, batch_lists, self.collator, self.cfg.loop.num_workers, self.pin_memory)


def build_run(cfg: Any, target: Any, embed: torch.Tensor, lm_head: Optional[torch.Tensor] = None,
              engine: Optional[Any] = None) -> Run:
    """Everything a training run needs, restored from the newest checkpoint when there is one.

    Args:
        cfg: a :class:`eagle3.config.TrainConfig`.
        target: a ``TargetInfo`` (name, hidden_size, vocab_size, aux_layer_ids,
            content_hash, architecture, quantization, heads, FFN, rope, eps).
        embed: the target's ``[V, H]`` embedding table; lm_head ``[V, H]`` (``drafter.lm_head_init=target``).
        engine: ``features=online``: the capture engine instead of one built from ``cfg.engine`` (tests).

    Raises:
        Eagle3Error: impossible settings (for the device too), missing/empty/incompatible features, a
            features/target mismatch, a changed configuration on resume, no loss-masked
            tokens, fewer micro-batches than one optimizer step takes.
    """
    from accelerate.utils import set_seed

    started = time.perf_counter()
    dirs, output_dir = features_dirs(cfg), stage_output_dir(cfg)
    check_settings(cfg)
    online_mode = feature_mode(cfg) == "online"
    train_ds, val_ds, aux_ids = open_datasets(dirs, target, online=online_mode)
    device = resolve_device(cfg.device, setting="device")
    check_device_settings(cfg, device)
    mp = resolve_mixed_precision(cfg.loop.mixed_precision, device)
    max_tokens = default_max_tokens(cfg.loop.max_tokens_per_batch, device)
    output_dir.mkdir(parents=True, exist_ok=True)
    accelerator = _accelerator(cfg, device, mp, output_dir)
    if cfg.loop.fused_loss and accelerator.distributed_type.value == "FSDP":
        raise Eagle3Error("loop.fused_loss reads lm_head.weight outside lm_head's forward, which FSDP shards; "
                          "train with DDP (accelerate/ddp.yaml) or pass loop.fused_loss=false")
    # the optimizer step's global batch; grad_accum and the process count may change on resume as long as
    # their product does not (2 processes x grad_accum 1 resume as 1 process x grad_accum 2)
    micro_batches_per_step = cfg.loop.grad_accum * accelerator.num_processes
    # the plan before anything is written: a plan without one whole optimizer step is refused first
    plan = BatchPlan(train_ds.lengths, max_tokens, cfg.seed, cfg.loop.grad_accum, accelerator.num_processes,
                     samples=train_subset(len(train_ds), cfg.loop.train_fraction, cfg.seed))
    _log_subset(plan, len(train_ds), cfg.loop.train_fraction)
    total_steps = _total_steps(plan, cfg.loop, len(train_ds))
    record = run_record(cfg, dirs, micro_batches_per_step)
    if accelerator.is_main_process:
        check_resume_record(output_dir, record)
    online = build_online(cfg, target, train_ds, output_dir, accelerator, max_tokens, engine) if online_mode else None
    set_seed(cfg.seed)

    d2t, t2d, counts = _draft_vocab(accelerator, output_dir / DRAFT_VOCAB, dirs, train_ds, target, cfg.drafter,
                                    plan.samples)
    warn_on_degenerate_loss_mask(train_ds.manifests)
    coverage = float(counts[t2d].sum()) / max(1, int(counts.sum()))
    arch = drafter_arch(target, cfg.drafter, draft_vocab_size=d2t.numel())
    model = _ttt_model(arch, d2t, t2d, embed, lm_head, cfg.drafter)
    if cfg.loop.compile_drafter:
        log.info("loop.compile_drafter: compiled %d norm and MLP modules", compile_drafter_elementwise(model.drafter))
    model.fused_loss = bool(cfg.loop.fused_loss)
    params = [p for p in model.parameters() if p.requires_grad]
    ocfg = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=ocfg.lr, betas=tuple(ocfg.betas), weight_decay=ocfg.weight_decay,
                                  fused=device.type == "cuda")
    scheduler = _scheduler(ocfg, optimizer, total_steps)
    state = TrainState()
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler, state)
    _resume(accelerator, output_dir, state, total_steps)

    collator = TTTCollator(target_to_draft_index(d2t, target.vocab_size), cfg.drafter.ttt_steps, max_tokens,
                           int(cfg.loop.pad_multiple), getattr(cfg.drafter, "target_temperature", 1.0))
    val_batches = length_bucketed_batches(val_ds.lengths, max_tokens, cfg.seed, 0)
    val_batches = val_batches[accelerator.process_index :: accelerator.num_processes]
    if cfg.loop.tracker == "tensorboard":
        accelerator.init_trackers("tensorboard", config=tracker_config(cfg, micro_batches_per_step))
    return Run(
        cfg=cfg, target=target, dirs=dirs, output_dir=output_dir, started=started, accelerator=accelerator,
        mixed_precision=mp, max_tokens=max_tokens, train_ds=train_ds, val_ds=val_ds, aux_ids=aux_ids,
        record=record, coverage=coverage, arch=arch, model=model, params=params, optimizer=optimizer,
        scheduler=scheduler, state=state, plan=plan, total_steps=total_steps, collator=collator,
        val_batches=val_batches, pin_memory=device.type == "cuda", online=online,
    )


def _log_subset(plan: BatchPlan, split_samples: int, fraction: float) -> None:
    """Say how many training samples a ``loop.train_fraction`` run trains on."""
    if plan.samples is not None:
        log.info("training on %d of %d training samples (loop.train_fraction=%s)", plan.num_samples, split_samples,
                 fraction)


def _accelerator(cfg: Any, device: torch.device, mixed_precision: str, output_dir: Path):
    """Accelerate owns the device, mixed precision, gradient accumulation, the tracker and (several
    processes) the process group, whose collectives wait ``loop.collective_timeout_s`` at most
    (:mod:`eagle3.train.faults`)."""
    from accelerate import Accelerator

    return Accelerator(
        cpu=device.type == "cpu",
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=cfg.loop.grad_accum,
        log_with="tensorboard" if cfg.loop.tracker == "tensorboard" else None,
        project_dir=str(output_dir),
        kwargs_handlers=[process_group_kwargs(cfg.loop.collective_timeout_s)],
    )


def _draft_vocab(accelerator, path: Path, dirs: list[Path], train_ds: FeatureDataset, target: Any,
                 dcfg, samples: Optional[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d2t [N] int64, t2d [V] bool, counts [V] int64)`` of the label tokens of the samples
    trained on (``samples``, the ``loop.train_fraction`` subset's indices into ``train_ds``;
    ``None`` = the whole training split; :mod:`eagle3.train.vocab`): read from ``path`` when an
    earlier launch wrote it, else counted, chosen and written there atomically by the main process.

    Raises:
        Eagle3Error: the training samples hold no loss-masked tokens.
    """
    from safetensors.torch import load_file, save_file

    if path.exists():
        v = load_file(str(path))
        d2t, t2d, counts = v["d2t"], v["t2d"], v["counts"]
    else:
        counts = count_label_tokens(dirs, train_ds.manifests, target.vocab_size,
                                    progress=accelerator.is_local_main_process,
                                    rows=None if samples is None else train_ds.shard_rows(samples))
        d2t, t2d = build_draft_vocab(counts, dcfg.draft_vocab_size or auto_draft_vocab_size(counts))
        if accelerator.is_main_process:
            remove_stale_temp_files(path.parent)  # what a run killed in this save left (safetensors' .tmpXXXXXX)
            tmp = path.with_name(path.name + ".tmp")
            save_file({"d2t": d2t, "t2d": t2d, "counts": counts}, str(tmp))
            os.replace(tmp, path)
    if int(counts.sum()) == 0:
        raise Eagle3Error(
            f"the training samples in {dirs[0]} have no loss-masked (assistant) tokens; the chat template "
            "marks no generated turns; fix the template or the data and re-extract"
        )
    return d2t, t2d, counts


def _ttt_model(arch: DrafterArch, d2t: torch.Tensor, t2d: torch.Tensor, embed: torch.Tensor,
               lm_head: Optional[torch.Tensor], dcfg) -> TTTModel:
    """A fresh drafter (weights drawn from the global RNG) with its draft vocabulary, its
    embedding (and, with ``drafter.lm_head_init=target``, its head) from the target.

    Raises:
        Eagle3Error: an unknown ``drafter.lm_head_init``.
    """
    drafter = Eagle3Drafter(arch)
    drafter.set_draft_vocab(d2t, t2d)
    if dcfg.lm_head_init not in ("random", "target"):
        raise Eagle3Error(f"drafter.lm_head_init={dcfg.lm_head_init!r}; use random or target")
    drafter.init_from_target(embed, lm_head if dcfg.lm_head_init == "target" else None)
    return TTTModel(drafter, dcfg.ttt_steps, dcfg.step_weight, getattr(dcfg, "ttt_chain_chunk", None),
                    feature_noise=float(getattr(dcfg, "feature_noise", 0.0)),
                    attention=str(getattr(dcfg, "ttt_attention", "dense")))


def _total_steps(plan: BatchPlan, lcfg, split_samples: int) -> int:
    """Optimizer steps of the run: ``loop.max_steps``, else every epoch's whole steps.

    Raises:
        Eagle3Error: the first epoch holds fewer micro-batches than one optimizer step.
    """
    steps_per_epoch = plan.steps_per_epoch(lcfg.epochs)
    if steps_per_epoch[0] == 0:
        fraction = (f" (loop.train_fraction={lcfg.train_fraction} of {split_samples}; raise it)"
                    if plan.num_samples < split_samples else "")
        raise Eagle3Error(
            f"{plan.num_samples} training samples{fraction} make fewer than grad_accum x processes = {plan.per_step} "
            "batches; lower loop.grad_accum or loop.max_tokens_per_batch, or extract more data"
        )
    return int(lcfg.max_steps) if lcfg.max_steps else sum(steps_per_epoch)


def _scheduler(ocfg, optimizer, total_steps: int):
    """``transformers.get_scheduler(optim.scheduler)`` with ``ceil(warmup_ratio * total_steps)`` warmup steps."""
    from transformers import get_scheduler

    warmup = int(math.ceil(ocfg.warmup_ratio * total_steps))
    return get_scheduler(ocfg.scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


def _resume(accelerator, output_dir: Path, state: TrainState, total_steps: int) -> None:
    """Load the newest complete checkpoint of ``output_dir`` (model, optimizer, scheduler,
    ``state``, RNG) when there is one."""
    ckpt = latest_checkpoint(output_dir)
    if ckpt is not None:
        accelerator.load_state(str(ckpt))
        log.info("resumed from %s (step %d of %d)", ckpt, state.step, total_steps)
