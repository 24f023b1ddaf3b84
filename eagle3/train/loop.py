"""The train stage: an EAGLE-3 drafter with training-time test, through Accelerate.

``run_train(cfg)`` reads the extract stage's features folder, builds the draft
vocabulary from the training split, trains the drafter (:mod:`eagle3.train.ttt`), writes
validation metrics to ``<output_dir>/metrics.json`` and exports
``<output_dir>/export/sglang`` (and ``export/speculators`` where the optional
``speculators`` package is installed).

Loop: Accelerate owns the device and mixed precision (bf16 autocast with fp32 master
weights on CUDA; see :func:`resolve_mixed_precision` for the CPU choice), gradient
accumulation (``accelerator.accumulate``), gradient clipping, AdamW, a warmup +
cosine schedule (``transformers.get_scheduler``), TensorBoard through
``accelerator.log``. Batches are length-bucketed up to ``loop.max_tokens_per_batch``
padded tokens; their order is a pure function of ``(seed, epoch)``.

Resume is the normal path: checkpoints (``accelerator.save_state`` with the step
counter :class:`TrainState` and the scheduler registered) go to
``<output_dir>/checkpoints/step-NNNNNNNN``; running the same command again in the
same ``output_dir`` loads the newest complete one and continues with the same
sample order, so an interrupted run ends where an uninterrupted one would.
Settings that change the result are recorded in ``train_config.json`` and must
match on resume.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from eagle3.devices import resolve_device
from eagle3.train.drafter import DrafterArch, Eagle3Drafter
from eagle3.errors import Eagle3Error
from eagle3.paths import features_dirs, stage_output_dir
from eagle3.features import FeatureDataset
from eagle3.io import sha256_file, write_json_atomic
from eagle3.train.ttt import TTTCollator, TTTModel, batch_to, summarize, target_to_draft_index
from eagle3.train.vocab import auto_draft_vocab_size, build_draft_vocab, count_label_tokens

log = logging.getLogger("eagle3")

CHECKPOINTS = "checkpoints"
KEEP_CHECKPOINTS = 2
# Settings that may change between a run and its resume (everything else must match).
RESUMABLE_KEYS = ("loop.grad_accum", "loop.log_every", "loop.save_every", "loop.eval_every", "loop.num_workers", "loop.tracker",
                  "export", "device", "cache_dir", "output_dir")


# ------------------------------------------------------------------ decisions
def resolve_mixed_precision(setting: str, device: torch.device) -> str:
    """Accelerate's ``mixed_precision`` for this device.

    ``auto``: ``bf16`` on CUDA (autocast, fp32 master weights); ``no`` on CPU, where
    bf16 autocast was measured slower than float32 for this model on CPUs without AMX
    (the casts cost more than the bf16 matmuls save) and float32 is exact.
    ``bf16``/``no`` are taken as given.

    Raises:
        Eagle3Error: an unknown setting.
    """
    if setting not in ("auto", "bf16", "no", "fp16"):
        raise Eagle3Error(f"loop.mixed_precision={setting!r}; use auto, bf16 or no")
    if setting == "auto":
        return "bf16" if device.type == "cuda" else "no"
    return setting


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


# ------------------------------------------------------------------- batching
def length_bucketed_batches(lengths: Sequence[int], max_tokens: int, seed: int, epoch: int,
                            pool: int = 512) -> list[list[int]]:
    """Batches of sample indices whose padded size ``B * max(len)`` fits ``max_tokens``.

    Deterministic in ``(seed, epoch)``: shuffle, cut into pools of ``pool`` samples,
    sort each pool by length, pack greedily, shuffle the batches. Samples longer than
    ``max_tokens`` form a batch alone (and are cut to ``max_tokens`` by the collator).
    """
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
    order = torch.randperm(len(lengths), generator=g).tolist()
    batches: list[list[int]] = []
    for i in range(0, len(order), pool):
        chunk = sorted(order[i : i + pool], key=lambda j: (-min(lengths[j], max_tokens), j))
        cur: list[int] = []
        longest = 0
        for j in chunk:
            n = min(lengths[j], max_tokens)
            if cur and (len(cur) + 1) * max(longest, n) > max_tokens:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(j)
            longest = max(longest, n)
        if cur:
            batches.append(cur)
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[p] for p in perm]


# ------------------------------------------------------------------ state
@dataclass
class TrainState:
    """Progress counters, checkpointed with ``accelerator.register_for_checkpointing``.

    ``batch_in_epoch`` counts micro-batches of epoch ``epoch`` already trained on;
    ``step`` counts optimizer steps.
    """

    epoch: int = 0
    batch_in_epoch: int = 0
    step: int = 0
    tokens: int = 0
    skipped_nonfinite: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, d: dict) -> None:
        for k, v in d.items():
            setattr(self, k, int(v))


def _latest_checkpoint(output_dir: Path) -> Optional[Path]:
    root = output_dir / CHECKPOINTS
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if p.name.startswith("step-") and (p / "COMPLETE").exists()
                  and not p.name.endswith(".tmp"))
    return done[-1] if done else None


def _save_checkpoint(accelerator, output_dir: Path, step: int) -> Path:
    root = output_dir / CHECKPOINTS
    final = root / f"step-{step:08d}"
    tmp = root / f"step-{step:08d}.tmp"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        (tmp / "COMPLETE").write_text(f"{step}\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        done = sorted(p for p in root.iterdir() if p.name.startswith("step-") and not p.name.endswith(".tmp"))
        for old in done[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


# ------------------------------------------------------------- config record
def _flatten(d: Any, prefix: str = "") -> dict:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): d}


def _run_record(cfg, manifests: list[dict], dirs: list[Path]) -> dict:
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True) if not isinstance(cfg, dict) else dict(cfg)
    c.pop("defaults", None)
    c["features"] = [
        {"dir": str(d), "manifest_sha256": sha256_file(d / "manifest.json")} for d in dirs
    ]
    return c


def _check_resume_record(output_dir: Path, record: dict) -> None:
    path = output_dir / "train_config.json"
    if not path.exists():
        write_json_atomic(path, record)
        return
    old = _flatten(json.loads(path.read_text()))
    new = _flatten(json.loads(json.dumps(record)))
    for k in sorted(set(old) | set(new)):
        if any(k == r or k.startswith(r + ".") for r in RESUMABLE_KEYS):
            continue
        if old.get(k, "<absent>") != new.get(k, "<absent>"):
            raise Eagle3Error(
                f"{output_dir} holds a training run with {k}={old.get(k, '<absent>')!r}, now {new.get(k, '<absent>')!r}; "
                "pass a new output_dir= (or delete that folder) to train with other settings"
            )


# ------------------------------------------------------------------- checks
def check_features_match_target(metadata: dict, target: Any, dirs: list[Path]) -> list[int]:
    """The features must come from the configured target; returns their aux ids.

    Raises:
        Eagle3Error: content hash, hidden size, vocabulary or aux layer ids differ.
    """
    t = metadata.get("target") or {}
    name = dirs[0]
    if t.get("content_hash") and getattr(target, "content_hash", None) and t["content_hash"] != target.content_hash:
        raise Eagle3Error(
            f"features in {name} were extracted from target weights {t['content_hash']} but model={target.name} "
            f"resolves to {target.content_hash}; train with the model the features came from"
        )
    for key in ("hidden_size", "vocab_size"):
        if t.get(key) is not None and int(t[key]) != int(getattr(target, key)):
            raise Eagle3Error(f"features in {name} have target {key}={t[key]}, model={target.name} has {getattr(target, key)}")
    aux = metadata.get("aux_layer_ids")
    if aux is None:
        raise Eagle3Error(f"the manifest of {name} does not record aux_layer_ids; re-run extract.py")
    if list(aux) != list(target.aux_layer_ids):
        raise Eagle3Error(
            f"features in {name} hold aux layers {list(aux)} but model.aux_layer_ids resolves to "
            f"{list(target.aux_layer_ids)}; set model.aux_layer_ids={list(aux)} or re-extract"
        )
    return list(aux)


# ---------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(accelerator, model: TTTModel, loader, step_weight: float) -> Optional[dict]:
    """Validation metrics (:func:`eagle3.train.ttt.summarize`) over ``loader``; None if empty."""
    drafter = accelerator.unwrap_model(model).drafter
    was_training = drafter.training
    drafter.eval()
    stats, accepted, chains, samples = None, None, 0, 0
    for batch in loader:
        if not batch["sample_ids"]:
            continue
        batch = batch_to(batch, accelerator.device)
        with accelerator.autocast():
            out = accelerator.unwrap_model(model)(batch)
        stats = out.step_stats if stats is None else stats + out.step_stats
        accepted = out.accepted if accepted is None else accepted + out.accepted
        chains += out.num_chains
        samples += len(batch["sample_ids"])
    drafter.train(was_training)
    if stats is None:
        return None
    totals = accelerator.reduce(torch.tensor([float(accepted), chains, samples], device=stats.device), "sum")
    stats = accelerator.reduce(stats, "sum")
    m = summarize(stats, float(totals[0]), int(totals[1]), step_weight)
    m["samples"] = int(totals[2])
    return m


def _peak_memory() -> dict:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30, "peak_memory_kind": "cuda_max_allocated"}
    return {"peak_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "peak_memory_kind": "process_max_rss"}


# ------------------------------------------------------------------- stage
def run_train(cfg) -> dict:
    """The train stage (``python train.py``): resolve the target, train, export.

    Returns:
        The metrics written to ``<output_dir>/metrics.json`` plus ``output_dir`` and
        the export paths.

    Raises:
        Eagle3Error: missing/empty/incompatible features, a features/target mismatch,
            a changed configuration on resume, impossible sizes.
    """
    from eagle3.target import load_target_embeddings, resolve_target

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

    Returns:
        The metrics dict (also in ``metrics.json``); ``{"interrupted": True, ...}``
        when stopped by ``stop_after``.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import get_scheduler

    t_start = time.perf_counter()
    dirs = features_dirs(cfg)
    output_dir = stage_output_dir(cfg)
    dcfg, ocfg, lcfg = cfg.drafter, cfg.optim, cfg.loop
    if lcfg.grad_accum < 1 or (lcfg.max_tokens_per_batch or 8) < 8 or dcfg.ttt_steps < 1:
        raise Eagle3Error("loop.grad_accum and drafter.ttt_steps must be >= 1, loop.max_tokens_per_batch >= 8")
    if cfg.export.sglang and dcfg.num_layers != 1:
        raise Eagle3Error(
            f"drafter.num_layers={dcfg.num_layers}: SGLang serves one-layer EAGLE-3 drafters; "
            "set drafter.num_layers=1 or export.sglang=false"
        )

    # ---- data
    train_ds = FeatureDataset(dirs, splits=("train",))
    if len(train_ds) == 0:
        raise Eagle3Error(f"features in {', '.join(map(str, dirs))} hold no training samples; extract more data")
    val_ds = FeatureDataset(dirs, splits=("validation",), verify=False)
    aux_ids = check_features_match_target(train_ds.metadata, target, dirs)
    h_feat = train_ds[0]["aux_hidden_states"].shape[-1]
    if h_feat != target.hidden_size:
        raise Eagle3Error(f"features hold aux states of width {h_feat}, the target's hidden size is {target.hidden_size}")

    device = resolve_device(cfg.device, setting="device")
    mp = resolve_mixed_precision(lcfg.mixed_precision, device)
    max_tokens = int(lcfg.max_tokens_per_batch or (8192 if device.type == "cuda" else 2048))
    use_tb = lcfg.tracker == "tensorboard"
    output_dir.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(
        cpu=device.type == "cpu",
        mixed_precision=mp,
        gradient_accumulation_steps=lcfg.grad_accum,
        log_with="tensorboard" if use_tb else None,
        project_dir=str(output_dir),
    )
    record = _run_record(cfg, train_ds.manifests, dirs)
    # the optimizer step's global batch; grad_accum and the process count may change on resume as long as
    # their product does not (2 processes x grad_accum 1 resume as 1 process x grad_accum 2)
    record["micro_batches_per_step"] = lcfg.grad_accum * accelerator.num_processes
    if accelerator.is_main_process:
        _check_resume_record(output_dir, record)
    set_seed(cfg.seed)

    # ---- draft vocabulary (training split only)
    vocab_path = output_dir / "draft_vocab.safetensors"
    from safetensors.torch import load_file, save_file

    if vocab_path.exists():
        v = load_file(str(vocab_path))
        d2t, t2d, counts = v["d2t"], v["t2d"], v["counts"]
    else:
        counts = count_label_tokens(dirs, train_ds.manifests, target.vocab_size,
                                    progress=accelerator.is_local_main_process)
        d2t, t2d = build_draft_vocab(counts, dcfg.draft_vocab_size or auto_draft_vocab_size(counts))
        if accelerator.is_main_process:
            tmp = vocab_path.with_name(vocab_path.name + ".tmp")
            save_file({"d2t": d2t, "t2d": t2d, "counts": counts}, str(tmp))
            os.replace(tmp, vocab_path)
    if int(counts.sum()) == 0:
        raise Eagle3Error(
            f"the training samples in {dirs[0]} have no loss-masked (assistant) tokens; the chat template "
            "marks no generated turns; fix the template or the data and re-extract"
        )
    masked = sum(sh["masked_tokens"] for m in train_ds.manifests for sh in m["shards"])
    total = sum(sh["tokens"] for m in train_ds.manifests for sh in m["shards"])
    if total and masked / total > 0.99:
        log.warning("%.1f%% of the tokens carry loss: the loss mask looks degenerate (prompts included?)",
                    100 * masked / total)
    coverage = float(counts[t2d].sum()) / max(1, int(counts.sum()))

    # ---- model
    arch = drafter_arch(target, dcfg, draft_vocab_size=d2t.numel())
    drafter = Eagle3Drafter(arch)
    drafter.set_draft_vocab(d2t, t2d)
    if dcfg.lm_head_init not in ("random", "target"):
        raise Eagle3Error(f"drafter.lm_head_init={dcfg.lm_head_init!r}; use random or target")
    drafter.init_from_target(embed, lm_head if dcfg.lm_head_init == "target" else None)
    model = TTTModel(drafter, dcfg.ttt_steps, dcfg.step_weight)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=ocfg.lr, betas=tuple(ocfg.betas), weight_decay=ocfg.weight_decay,
        fused=device.type == "cuda",
    )

    # ---- schedule
    lengths = train_ds.lengths
    ga = lcfg.grad_accum
    world, rank = accelerator.num_processes, accelerator.process_index

    per_step = ga * world  # micro-batches in one optimizer step, over all processes

    def batches_of(epoch: int) -> list[list[int]]:
        """The epoch's global micro-batch list, cut to whole optimizer steps. Micro-batch
        ``i`` goes to process ``i % world``, so step ``k`` trains on global micro-batches
        ``k*per_step .. (k+1)*per_step - 1`` whatever the split between processes and
        accumulation: N processes x grad_accum g equal one process x grad_accum N*g."""
        b = length_bucketed_batches(lengths, max_tokens, cfg.seed, epoch)
        return b[: len(b) - len(b) % per_step]

    steps_per_epoch = [len(batches_of(e)) // per_step for e in range(max(1, lcfg.epochs))]
    if steps_per_epoch[0] == 0:
        raise Eagle3Error(
            f"{len(train_ds)} training samples make fewer than grad_accum x processes = {ga * world} batches; "
            "lower loop.grad_accum or loop.max_tokens_per_batch, or extract more data"
        )
    total_steps = int(lcfg.max_steps) if lcfg.max_steps else sum(steps_per_epoch)
    warmup = int(math.ceil(ocfg.warmup_ratio * total_steps))
    scheduler = get_scheduler(ocfg.scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)
    state = TrainState()
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler, state)
    ckpt = _latest_checkpoint(output_dir)
    if ckpt is not None:
        accelerator.load_state(str(ckpt))
        log.info("resumed from %s (step %d of %d)", ckpt, state.step, total_steps)

    collator = TTTCollator(target_to_draft_index(d2t, target.vocab_size), dcfg.ttt_steps, max_tokens, pad_multiple=16)
    pin = device.type == "cuda"

    def loader_for(ds, batch_lists):
        return torch.utils.data.DataLoader(
            ds, batch_sampler=batch_lists, collate_fn=collator, num_workers=lcfg.num_workers, pin_memory=pin,
            persistent_workers=False,
        )

    val_batches = length_bucketed_batches(val_ds.lengths, max_tokens, cfg.seed, 0)
    val_batches = val_batches[rank::world]

    if use_tb:
        hp = {k: v for k, v in _flatten(record).items() if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers("tensorboard", config=hp)

    # ---- loop
    unwrapped = accelerator.unwrap_model(model)
    J = dcfg.ttt_steps
    acc_stats = torch.zeros(J, 3, device=accelerator.device)
    acc_tokens, t_log = 0, time.perf_counter()
    train_time, session_tokens = 0.0, 0
    last_val: Optional[dict] = None
    last_train: dict = {}
    pbar = tqdm(total=total_steps, initial=state.step, desc="train", unit="step",
                disable=not accelerator.is_local_main_process)
    model.train()
    interrupted = False
    if state.batch_in_epoch % world:
        raise Eagle3Error(
            f"the checkpoint in {output_dir} stopped inside an optimizer step ({state.batch_in_epoch} micro-batches "
            f"into epoch {state.epoch}), which {world} processes cannot split; resume with the process count it was "
            "written with"
        )
    while state.step < total_steps:
        epoch_batches = batches_of(state.epoch)
        mine = epoch_batches[state.batch_in_epoch + rank :: world]
        t0 = time.perf_counter()
        for batch in loader_for(train_ds, mine):
            g0 = state.batch_in_epoch  # first global micro-batch of this round (one per process)
            state.skipped_nonfinite += batch["skipped_nonfinite"]
            if on_batch is not None:
                on_batch(state.step, list(batch["sample_ids"]))
            batch = batch_to(batch, accelerator.device)
            with accelerator.accumulate(model):
                if batch["sample_ids"]:
                    out = model(batch)
                    accelerator.backward(out.loss)
                    acc_stats += out.step_stats
                if accelerator.sync_gradients and ocfg.grad_clip:
                    accelerator.clip_grad_norm_(params, ocfg.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # counters in global units, identical on every process (checkpoints hold the main process's)
            round_tokens = sum(min(lengths[j], max_tokens) for b in epoch_batches[g0 : g0 + world] for j in b)
            state.batch_in_epoch += world
            state.tokens += round_tokens
            acc_tokens += round_tokens
            session_tokens += round_tokens
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            state.step += 1
            pbar.update(1)
            if state.step % lcfg.log_every == 0 or state.step == total_steps:
                now = time.perf_counter()
                s = accelerator.reduce(acc_stats, "sum")  # the one host sync per log interval
                last_train = summarize(s, 0.0, 0, dcfg.step_weight)
                tps = acc_tokens / max(now - t_log, 1e-9)
                logs = {"train/loss": last_train["loss"], "train/lr": scheduler.get_last_lr()[0],
                        "train/tokens_per_s": tps}
                for j in range(J):
                    logs[f"train/acc_{j}"] = last_train["step_acc"][j]
                    logs[f"train/loss_{j}"] = last_train["step_loss"][j]
                accelerator.log(logs, step=state.step)
                post = {"loss": f"{last_train['loss']:.3f}", "acc0": f"{last_train['step_acc'][0]:.3f}"}
                post[f"acc{J - 1}"] = f"{last_train['step_acc'][-1]:.3f}"
                post["tok/s"] = f"{tps:.0f}"
                pbar.set_postfix(post)
                acc_stats.zero_()
                acc_tokens, t_log = 0, now
            if lcfg.eval_every and state.step % lcfg.eval_every == 0:
                train_time += time.perf_counter() - t0
                last_val = _eval_and_log(accelerator, model, val_ds, val_batches, loader_for, dcfg, state.step)
                t0 = time.perf_counter()
            if state.step % lcfg.save_every == 0 and state.step < total_steps:
                _save_checkpoint(accelerator, output_dir, state.step)
            if stop_after is not None and state.step >= stop_after:
                interrupted = True
                break
            if state.step >= total_steps:
                break
        train_time += time.perf_counter() - t0
        if interrupted or state.step >= total_steps:
            break
        state.epoch += 1
        state.batch_in_epoch = 0
        if not lcfg.eval_every:
            last_val = _eval_and_log(accelerator, model, val_ds, val_batches, loader_for, dcfg, state.step)
    pbar.close()
    if interrupted:
        _save_checkpoint(accelerator, output_dir, state.step)
        accelerator.end_training()
        return {"interrupted": True, "step": state.step, "output_dir": str(output_dir)}

    # ---- finish: checkpoint, final validation, metrics, exports
    if _latest_checkpoint(output_dir) is None or _latest_checkpoint(output_dir).name != f"step-{state.step:08d}":
        _save_checkpoint(accelerator, output_dir, state.step)
    if last_val is None or lcfg.eval_every:
        last_val = _eval_and_log(accelerator, model, val_ds, val_batches, loader_for, dcfg, state.step)
    if last_val is None:
        log.warning("the features hold no validation samples; metrics.json has no validation block")
    first = train_ds.manifests[0]
    meta = {
        "target": {
            "name": target.name,
            "source": getattr(target, "source", None),
            "path": getattr(target, "path", None),
            "content_hash": (first["metadata"].get("target") or {}).get("content_hash", target.content_hash),
            "quantization": (first["metadata"].get("target") or {}).get("quantization", target.quantization),
            "architecture": target.architecture,
        },
        "chat_template_hash": first["metadata"].get("chat_template_hash"),
        "aux_layer_ids": aux_ids,
        "features_dir": str(dirs[0]) if len(dirs) == 1 else [str(d) for d in dirs],
        "features_manifest_sha256": record["features"][0]["manifest_sha256"] if len(dirs) == 1
        else [f["manifest_sha256"] for f in record["features"]],
        "draft_vocab_size": arch.draft_vocab_size,
        "ttt_steps": dcfg.ttt_steps,
        "train_step": state.step,
    }
    metrics = {
        "output_dir": str(output_dir),
        "step": state.step,
        "epoch": state.epoch,
        "train_tokens": state.tokens,
        "train": last_train,
        "validation": last_val,
        "tokens_per_s": session_tokens / train_time if train_time > 0 else None,
        "num_processes": world,
        "distributed_type": str(accelerator.distributed_type.value),
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - t_start,
        "skipped_nonfinite": state.skipped_nonfinite,
        "draft_vocab_coverage": coverage,
        "device": str(accelerator.device),
        "mixed_precision": mp,
        "drafter": asdict(arch),
        "max_tokens_per_batch": max_tokens,
        "ttt_steps": dcfg.ttt_steps,
        **_peak_memory(),
    }
    exports: dict[str, str] = {}
    final = unwrapped.drafter
    if accelerator.distributed_type.value == "FSDP":  # sharded parameters: gather a full copy (every process calls)
        full = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            final = Eagle3Drafter(arch)
            final.load_state_dict({k[len("drafter."):]: v for k, v in full.items() if k.startswith("drafter.")})
    if accelerator.is_main_process:
        if cfg.export.sglang:
            from eagle3.export import export_sglang

            exports["sglang"] = str(export_sglang(final, output_dir / "export" / "sglang", meta))
        if cfg.export.speculators:
            from eagle3.export import export_speculators, speculators_available

            if speculators_available():
                exports["speculators"] = str(
                    export_speculators(final, output_dir / "export" / "speculators", meta, dcfg.ttt_steps))
            else:
                log.info("speculators is not installed: skipping export/speculators (pip install speculators)")
        metrics["exports"] = exports
        write_json_atomic(output_dir / "metrics.json", metrics)
        _record_sweep_job(metrics)
    accelerator.wait_for_everyone()  # leave together: a process group torn down while a peer still exports can hang
    accelerator.end_training()
    if last_val is not None:
        log.info("validation: acc per step %s, simulated tau %.3f",
                 [round(a, 3) for a in last_val["step_acc"]], last_val["tau"])
    return metrics


def _eval_and_log(accelerator, model, val_ds, val_batches, loader_for, dcfg, step) -> Optional[dict]:
    if not val_batches:
        return None
    m = evaluate(accelerator, model, loader_for(val_ds, val_batches), dcfg.step_weight)
    if m is not None:
        logs = {"val/loss": m["loss"], "val/tau": m["tau"]}
        for j, a in enumerate(m["step_acc"]):
            logs[f"val/acc_{j}"] = a
        accelerator.log(logs, step=step)
        log.info("step %d validation: loss %.4f, acc %s, tau %.3f", step, m["loss"],
                 [round(a, 3) for a in m["step_acc"]], m["tau"])
    return m


def _record_sweep_job(metrics: dict) -> None:
    try:
        from eagle3.sweep import record_job_summary
    except ImportError:
        return
    val = metrics.get("validation") or {}
    summary = {"tau": val.get("tau"), "val_loss": val.get("loss")}
    for j, a in enumerate(val.get("step_acc") or []):
        summary[f"acc_{j}"] = a
    summary["tokens_per_s"] = metrics.get("tokens_per_s")
    summary["peak_mem_gb"] = metrics.get("peak_memory_gb")
    record_job_summary(summary, metrics_path=os.path.join(metrics["output_dir"], "metrics.json"))
