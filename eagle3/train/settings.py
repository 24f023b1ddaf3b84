"""The train stage's decisions from its configuration, made before any data is read.

:func:`check_settings` refuses settings no run can train with, :func:`resolve_mixed_precision`
picks Accelerate's ``mixed_precision`` for the device, :func:`default_max_tokens` the
micro-batch budget, and :func:`drafter_arch` the drafter's sizes from ``drafter.*`` and
the target.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from eagle3.errors import Eagle3Error
from eagle3.model.drafter import DrafterArch

MIXED_PRECISION = ("auto", "bf16", "fp16", "no")  # Accelerate's, plus auto (bf16 on CUDA, none on CPU)


def _bad_setting(cfg: Any) -> Optional[str]:
    """The first optimiser, loop or drafter setting no run can train with, as ``name=value; rule``."""
    from transformers import SchedulerType  # the names transformers.get_scheduler takes

    # the loop passes no metric and no scheduler-specific arguments: these four need one
    needs_more = {"reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay"}
    schedulers = [t.value for t in SchedulerType if t.value not in needs_more]
    o, lp, d = cfg.optim, cfg.loop, cfg.drafter
    betas = list(o.betas)
    checks = [
        ("optim.lr", o.lr, o.lr > 0, "must be > 0"),
        ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, "must be >= 0"),
        ("optim.betas", betas, len(betas) == 2 and all(0 <= b < 1 for b in betas), "must be two values in [0, 1)"),
        ("optim.warmup_ratio", o.warmup_ratio, 0 <= o.warmup_ratio < 1, "must be in [0, 1)"),
        ("optim.grad_clip", o.grad_clip, o.grad_clip >= 0, "must be >= 0 (0 turns clipping off)"),
        ("optim.scheduler", o.scheduler, o.scheduler in schedulers, f"must be one of {', '.join(schedulers)}"),
        ("loop.epochs", lp.epochs, lp.epochs >= 1, "must be >= 1"),
        ("loop.max_steps", lp.max_steps, lp.max_steps is None or lp.max_steps >= 1, "must be >= 1 or null"),
        ("loop.max_tokens_per_batch", lp.max_tokens_per_batch,
         lp.max_tokens_per_batch is None or lp.max_tokens_per_batch >= 8, "must be >= 8 or null"),
        ("loop.pad_multiple", lp.pad_multiple, 1 <= lp.pad_multiple <= 1024, "must be in 1..1024 (tokens)"),
        ("loop.grad_accum", lp.grad_accum, lp.grad_accum >= 1, "must be >= 1"),
        ("loop.log_every", lp.log_every, lp.log_every >= 1, "must be >= 1"),
        ("loop.save_every", lp.save_every, lp.save_every >= 1, "must be >= 1"),
        ("loop.eval_every", lp.eval_every, lp.eval_every is None or lp.eval_every >= 1, "must be >= 1 or null"),
        ("loop.num_workers", lp.num_workers, lp.num_workers >= 0, "must be >= 0"),
        ("loop.time_limit_min", lp.time_limit_min, lp.time_limit_min is None or lp.time_limit_min > 0,
         "must be > 0 (minutes) or null"),
        ("loop.collective_timeout_s", lp.collective_timeout_s, lp.collective_timeout_s > 0,
         "must be > 0 (seconds a process waits for the others)"),
        ("loop.train_fraction", lp.train_fraction, 0 < lp.train_fraction <= 1,
         "must be in (0, 1] (a fraction of the training samples)"),
        ("loop.mixed_precision", lp.mixed_precision, lp.mixed_precision in MIXED_PRECISION,
         f"must be one of {', '.join(MIXED_PRECISION)}"),
        ("loop.tracker", lp.tracker, lp.tracker in ("tensorboard", "none"), "must be tensorboard or none"),
        ("drafter.ttt_steps", d.ttt_steps, d.ttt_steps >= 1, "must be >= 1"),
        ("drafter.feature_noise", d.feature_noise, 0 <= d.feature_noise < 10, "must be in [0, 10) (relative to each state's RMS)"),
        ("drafter.step_weight", d.step_weight, d.step_weight > 0, "must be > 0"),
        ("drafter.target_temperature", d.target_temperature, 0.01 <= d.target_temperature <= 100,
         "must be in [0.01, 100] (1 = the target's distribution)"),
        ("drafter.ttt_chain_chunk", d.ttt_chain_chunk, d.ttt_chain_chunk is None or d.ttt_chain_chunk >= 1,
         "must be >= 1 (chain rows per attention chunk) or null"),
        ("drafter.ttt_attention", d.ttt_attention, d.ttt_attention in ("dense", "flex"), "must be dense or flex"),
        ("drafter.ttt_attention", d.ttt_attention, d.ttt_attention == "dense" or d.ttt_chain_chunk is None,
         "does not take drafter.ttt_chain_chunk (chunks are a form of the dense attention); set one of them"),
        ("drafter.lm_head_init", d.lm_head_init, d.lm_head_init in ("random", "target"), "must be random or target"),
        ("drafter.num_layers", d.num_layers, d.num_layers >= 1, "must be >= 1"),
    ]
    f = getattr(cfg, "features", None)
    if f is not None:
        checks += [
            ("features", f.mode, f.mode in ("offline", "online"),
             "is not a training mode: train.py reads features=offline (the features store) or captures them "
             "while training with features=online (extract.py features=none writes what that reads)"),
            ("features.queue_depth", f.queue_depth, f.queue_depth >= 1, "must be >= 1 (micro-batches captured ahead)"),
            ("features.cache_gb", f.cache_gb, f.cache_gb >= 0, "must be >= 0 (GB; 0 = no cache)"),
            ("features.cache_gb", f.cache_gb, f.cache_gb == 0 or f.mode == "online",
             "keeps online features for later epochs; it needs features=online"),
            ("features.retry_timeout_s", f.retry_timeout_s, f.retry_timeout_s >= 0, "must be >= 0 (seconds)"),
        ]
    for name, value, ok, rule in checks:
        if not ok:
            return f"{name}={value} {rule}"
    return None


def check_settings(cfg: Any) -> None:
    """Settings of a :class:`eagle3.config.TrainConfig` that cannot train or export,
    refused before anything is read or written (so the corrected command can run in the
    same output folder).

    Raises:
        Eagle3Error: naming the one setting that is wrong (see :func:`_bad_setting`).
    """
    problem = _bad_setting(cfg)
    if problem:
        raise Eagle3Error(f"{problem}; fix that setting")


def feature_mode(cfg: Any) -> str:
    """``features.mode`` of a train config: ``offline`` (the features store) or ``online``
    (captured while training, :mod:`eagle3.train.online`)."""
    return str(getattr(getattr(cfg, "features", None), "mode", "offline"))


def check_device_settings(cfg: Any, device: torch.device) -> None:
    """Settings that the resolved device cannot run, refused before anything is written.

    Raises:
        Eagle3Error: ``drafter.ttt_attention=flex`` off CUDA (PyTorch's FlexAttention has no
            backward pass on CPU).
    """
    if getattr(cfg.drafter, "ttt_attention", "dense") == "flex" and device.type != "cuda":
        raise Eagle3Error(f"drafter.ttt_attention=flex trains on CUDA only (PyTorch's FlexAttention has no backward "
                          f"pass on {device.type}); use drafter.ttt_attention=dense on this device")


def resolve_mixed_precision(setting: str, device: torch.device) -> str:
    """Accelerate's ``mixed_precision`` for this device.

    ``auto``: ``bf16`` on CUDA (autocast, fp32 master weights); ``no`` on CPU, where
    bf16 autocast was measured slower than float32 for this model on CPUs without AMX
    (the casts cost more than the bf16 matmuls save) and float32 is exact.
    ``bf16``/``no`` are taken as given.

    Raises:
        Eagle3Error: an unknown setting.
    """
    if setting not in MIXED_PRECISION:
        raise Eagle3Error(f"loop.mixed_precision={setting!r}; use {', '.join(MIXED_PRECISION)}")
    if setting == "auto":
        return "bf16" if device.type == "cuda" else "no"
    return setting


def default_max_tokens(setting: Optional[int], device: torch.device) -> int:
    """Padded tokens per micro-batch: ``loop.max_tokens_per_batch``, else 8192 on CUDA and 2048 on CPU."""
    return int(setting or (8192 if device.type == "cuda" else 2048))


def drafter_arch(target: Any, dcfg, draft_vocab_size: Optional[int] = None) -> DrafterArch:
    """Drafter sizes: ``drafter.*`` where set, else the target's (``TargetInfo``).

    Raises:
        Eagle3Error: sizes that cannot form a drafter (heads not dividing, missing
            target fields for a hub-only target).
    """
    H = dcfg.hidden_size or target.hidden_size
    heads = dcfg.num_attention_heads or target.num_attention_heads
    kv = dcfg.num_key_value_heads or target.num_key_value_heads or heads
    inter = dcfg.intermediate_size or target.intermediate_size
    if not heads or not inter:
        raise Eagle3Error(
            "the target's config does not give attention heads / FFN width; set drafter.num_attention_heads "
            "and drafter.intermediate_size"
        )
    head_dim = dcfg.head_dim or (target.head_dim if H == target.hidden_size and target.head_dim else H // heads)
    if heads % kv:
        raise Eagle3Error(f"drafter.num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    return DrafterArch(
        hidden_size=int(H),
        num_attention_heads=int(heads),
        num_key_value_heads=int(kv),
        head_dim=int(head_dim),
        intermediate_size=int(inter),
        num_layers=int(dcfg.num_layers),
        target_hidden_size=int(target.hidden_size),
        vocab_size=int(target.vocab_size),
        draft_vocab_size=int(draft_vocab_size or dcfg.draft_vocab_size),
        rms_norm_eps=float(target.rms_norm_eps or 1e-6),
        rope_theta=float(target.rope_theta or 10000.0),
        max_position_embeddings=int(target.max_position_embeddings or 8192),
    )
