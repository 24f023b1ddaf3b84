"""The training loop: optimizer steps over the global batch plan, with logging, validation and checkpoints.

Accelerate owns gradient accumulation (``accelerator.accumulate``), the backward pass,
gradient clipping and TensorBoard (``accelerator.log``). Each epoch, process ``rank``
trains on micro-batches ``rank, rank + world, ...`` of the epoch's global list
(:class:`eagle3.train.data.BatchPlan`); a resumed epoch leaves out the micro-batches already
trained on, so an interrupted run trains on the same
samples in the same order as an uninterrupted one. The counters of
:class:`~eagle3.train.checkpoint.TrainState` are kept in global units, identical on every
process.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from tqdm.auto import tqdm

from eagle3.errors import Eagle3Error
from eagle3.train.build import Run
from eagle3.train.checkpoint import save_checkpoint
from eagle3.train.noise import noise_seed
from eagle3.train.ttt import batch_to, summarize
from eagle3.train.validation import validate

log = logging.getLogger("eagle3")


@dataclass
class Progress:
    """What one launch of the loop measured, for :func:`eagle3.train.finish.finish`.

    ``last_train``: training metrics of the last log interval (:func:`~eagle3.train.ttt.summarize`);
    ``last_val``: the last validation metrics (None before the first); ``train_time``: seconds
    spent in training steps (validation excluded); ``session_tokens``: tokens trained on in
    this launch; ``interrupted``: stopped by ``stop_after``; ``time_limited``: stopped by
    ``loop.time_limit_min`` before the last step (the run still finishes and exports).
    """

    last_train: dict = field(default_factory=dict)
    last_val: Optional[dict] = None
    train_time: float = 0.0
    session_tokens: int = 0
    first_step: int = 0  # the optimizer step this launch started from (> 0 after a resume)
    session_samples: int = 0  # samples this process's micro-batches held, non-finite ones included
    session_skipped: int = 0  # of those, skipped for non-finite features
    interrupted: bool = False
    time_limited: bool = False
    _clock: float = 0.0

    def start_clock(self) -> None:
        """Start timing training (``time.perf_counter``)."""
        self._clock = time.perf_counter()

    def stop_clock(self) -> None:
        """Add the seconds since :meth:`start_clock` to ``train_time``."""
        self.train_time += time.perf_counter() - self._clock


def _count_skipped(progress: Progress, batch: dict, step: int) -> None:
    """Count the micro-batch's samples and warn, naming them, when non-finite features were skipped."""
    skipped = int(batch["skipped_nonfinite"])
    progress.session_samples += skipped + len(batch["sample_ids"])
    progress.session_skipped += skipped
    if skipped:
        log.warning("step %d: skipped %d of %d samples of a micro-batch with non-finite features (%s)", step, skipped,
                    skipped + len(batch["sample_ids"]), ", ".join(map(str, batch.get("skipped_ids", [])[:5])))


class IntervalLog:
    """Training statistics of one log interval, written to the tracker and the progress bar.

    ``stats`` is the ``[ttt_steps, 3]`` sum of the steps' statistics on this process's
    device (:class:`~eagle3.train.ttt.TTTOutput`), reduced over processes only when written
    (their one reduction per log interval); ``tokens`` counts the interval's tokens over all
    processes, for tokens/s. ``run_stats`` is the same sum in float64 since the last
    :func:`fold_run_stats`, which moves it into the checkpointed ``TrainState.train_stats``.
    ``pending`` holds the statistics of the optimizer step under way (added to both once the
    step is taken, dropped when it is skipped) and ``nonfinite`` its micro-batches whose loss
    was not finite on this process.
    """

    def __init__(self, run: Run, pbar: tqdm):
        self.run, self.pbar = run, pbar
        self.stats = torch.zeros(run.cfg.drafter.ttt_steps, 3, device=run.accelerator.device)
        self.run_stats = torch.zeros(run.cfg.drafter.ttt_steps, 3, dtype=torch.float64, device=run.accelerator.device)
        self.pending = torch.zeros_like(self.run_stats)  # float64, so a step's sum is exact however it is split
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=run.accelerator.device)
        self.tokens, self.since = 0, time.perf_counter()
        self.waited = run.online.stats.wait_s if run.online is not None else 0.0

    def write(self, step: int) -> dict:
        """Log ``train/*`` at optimizer step ``step``, start a new interval; returns the interval's metrics."""
        acc, J = self.run.accelerator, self.run.cfg.drafter.ttt_steps
        now = time.perf_counter()
        s = acc.reduce(self.stats, "sum")  # the statistics' one reduction per log interval
        last_train = summarize(s, 0.0, 0, self.run.cfg.drafter.step_weight)
        tps = self.tokens / max(now - self.since, 1e-9)
        logs = {"train/loss": last_train["loss"], "train/lr": self.run.scheduler.get_last_lr()[0],
                "train/tokens_per_s": tps}
        if self.run.online is not None:  # features=online: how long the trainer waited for the capture engine
            st = self.run.online.stats
            logs["features/idle_fraction"] = (st.wait_s - self.waited) / max(now - self.since, 1e-9)
            logs["features/capture_tokens_per_s"] = st.captured_tokens / st.capture_s if st.capture_s else 0.0
            self.waited = st.wait_s
        for j in range(J):
            logs[f"train/acc_{j}"] = last_train["step_acc"][j]
            logs[f"train/loss_{j}"] = last_train["step_loss"][j]
        acc.log(logs, step=step)
        post = {"loss": f"{last_train['loss']:.3f}", "acc0": f"{last_train['step_acc'][0]:.3f}"}
        post[f"acc{J - 1}"] = f"{last_train['step_acc'][-1]:.3f}"
        post["tok/s"] = f"{tps:.0f}"
        self.pbar.set_postfix(post)
        self.stats.zero_()
        self.tokens, self.since = 0, now
        return last_train


def fold_run_stats(run: Run, interval: IntervalLog) -> None:
    """Add this launch's training statistics since the last fold, summed over processes, to
    ``run.state.train_stats`` (every process calls: a collective). Called before every
    checkpoint, so a resumed run's whole-run average equals an uninterrupted run's (float64
    sums of float32 statistics are exact)."""
    s = run.accelerator.reduce(interval.run_stats, "sum").double().cpu().flatten()
    if run.state.train_stats:
        s = s + torch.tensor(run.state.train_stats, dtype=torch.float64)
    run.state.train_stats = s.tolist()
    interval.run_stats.zero_()


def run_train_metrics(run: Run) -> dict:
    """The whole run's training metrics from ``run.state.train_stats`` (after
    :func:`fold_run_stats`): ``loss`` (weighted as the objective), per TTT step
    ``step_loss``/``step_acc``/``step_rows``, and ``steps`` (optimizer steps covered)."""
    J = run.cfg.drafter.ttt_steps
    s = torch.tensor(run.state.train_stats or [0.0] * (3 * J), dtype=torch.float64).view(J, 3)
    m = summarize(s, 0.0, 0, run.cfg.drafter.step_weight)
    return {"loss": m["loss"], "step_loss": m["step_loss"], "step_acc": m["step_acc"], "step_rows": m["step_rows"],
            "steps": run.state.step}


def train_loop(run: Run, stop_after: Optional[int] = None,
               on_batch: Optional[Callable[[int, list], None]] = None) -> Progress:
    """Train from ``run.state`` up to ``run.total_steps`` optimizer steps (or ``stop_after``).

    Args:
        stop_after: stop after this many optimizer steps, as an interrupted run would
            (tests); the caller writes the checkpoint.
        on_batch: called with ``(optimizer step, sample ids)`` for every micro-batch.

    Raises:
        Eagle3Error: the checkpoint stopped inside an optimizer step that this process
            count cannot split.
    """
    acc, state, lcfg = run.accelerator, run.state, run.cfg.loop
    world = acc.num_processes
    progress = Progress(first_step=state.step)
    pbar = tqdm(total=run.total_steps, initial=state.step, desc="train", unit="step",
                disable=not acc.is_local_main_process)
    interval = IntervalLog(run, pbar)
    run.model.train()
    if state.batch_in_epoch % world:
        raise Eagle3Error(
            f"the checkpoint in {run.output_dir} stopped inside an optimizer step ({state.batch_in_epoch} micro-batches "
            f"into epoch {state.epoch}), which {world} processes cannot split; resume with the process count it was "
            "written with"
        )
    while state.step < run.total_steps:
        epoch_batches = run.plan.batches_of(state.epoch)
        progress.start_clock()
        for batch in _epoch_loader(run, epoch_batches):
            g0 = state.batch_in_epoch  # first global micro-batch of this round (one per process)
            state.skipped_nonfinite += batch["skipped_nonfinite"]
            _count_skipped(progress, batch, state.step)
            if on_batch is not None:
                on_batch(state.step, list(batch["sample_ids"]))
            # the feature noise of this micro-batch: a function of its global index, whatever the split
            acc.unwrap_model(run.model).noise_seed = noise_seed(run.cfg.seed, state.epoch, g0 + acc.process_index)
            _train_micro_batch(run, batch, interval)
            # counters in global units, identical on every process (checkpoints hold the main process's)
            round_tokens = run.plan.round_tokens(epoch_batches, g0)
            state.batch_in_epoch += world
            state.tokens += round_tokens
            interval.tokens += round_tokens
            progress.session_tokens += round_tokens
            if not acc.sync_gradients:
                continue
            run.scheduler.step()
            state.step += 1
            pbar.update(1)
            _after_step(run, progress, interval)
            if stop_after is not None and state.step >= stop_after:
                progress.interrupted = True
                break
            if state.step >= run.total_steps:
                break
            if _time_is_up(run):
                progress.time_limited = True
                log.warning("loop.time_limit_min=%s reached at step %d of %d: finishing now (checkpoint, "
                            "validation, exports); the learning-rate schedule had not ended, resume with a "
                            "larger limit to continue it", run.cfg.loop.time_limit_min, state.step, run.total_steps)
                break
        progress.stop_clock()
        if progress.interrupted or progress.time_limited or state.step >= run.total_steps:
            break
        state.epoch += 1
        state.batch_in_epoch = 0
        if not lcfg.eval_every:
            progress.last_val = validate(run, state.step)
    pbar.close()
    fold_run_stats(run, interval)  # before the checkpoint of stop() or finish()
    return progress


def _time_is_up(run: Run) -> bool:
    """Whether ``loop.time_limit_min`` minutes have passed since the build began (``run.started``).

    Several processes decide together (a sum of flags over processes), so all stop after the
    same optimizer step even when their clocks straddle the limit.
    """
    limit = run.cfg.loop.time_limit_min
    if limit is None:
        return False
    up = time.perf_counter() - run.started >= 60.0 * limit
    acc = run.accelerator
    if acc.num_processes > 1:
        flag = torch.tensor([int(up)], dtype=torch.int64, device=acc.device)
        up = bool(acc.reduce(flag, reduction="sum").item())
    return up


def _epoch_loader(run: Run, epoch_batches: list[list[int]]):
    """This process's micro-batches of the epoch, from where ``run.state`` stands.

    ``batch_in_epoch`` is a multiple of the process count (checked on resume), so the
    global micro-batches already trained on are the first ``batch_in_epoch // world`` of
    every process's share: they are left out of the loader (so ``features=online`` captures
    none of them again).
    """
    acc = run.accelerator
    world, rank = acc.num_processes, acc.process_index
    done = run.state.batch_in_epoch // world
    return run.loader(run.train_ds, epoch_batches[rank::world][done:], train=True)


def _train_micro_batch(run: Run, batch: dict, interval: IntervalLog) -> None:
    """Forward and backward one micro-batch under ``accelerator.accumulate``, then
    :func:`_optimizer_step` when Accelerate syncs the gradients. Every micro-batch runs both
    passes, the loss-free stand-in of one whose samples all had non-finite features too
    (:class:`~eagle3.train.ttt.TTTCollator`): with several processes each one joins every
    gradient all-reduce, whatever its micro-batch held."""
    acc = run.accelerator
    batch = batch_to(batch, acc.device)
    with acc.accumulate(run.model):
        out = run.model(batch)
        acc.backward(out.loss)
        interval.pending += out.step_stats
        interval.nonfinite += ~torch.isfinite(out.loss.detach())
        if acc.sync_gradients:
            _optimizer_step(run, interval)


def _optimizer_step(run: Run, interval: IntervalLog) -> None:
    """Clip the synced gradients to ``optim.grad_clip`` and step, or skip the step when they are not finite.

    The decision reads the norm of the all-reduced gradients, the same on every process, so a
    non-finite loss on any one process makes every process skip the same step, with no
    collective of its own (one host sync per step reads it): weights, optimizer state and
    training statistics stay as they were, the learning-rate schedule and the batch plan go
    on, and ``TrainState.skipped_steps`` counts it. One process skips the same steps as
    several with the same global batch.
    """
    acc, state = run.accelerator, run.state
    norm = acc.clip_grad_norm_(run.params, run.cfg.optim.grad_clip or math.inf)  # inf: the norm, nothing clipped
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
    if bool(torch.isfinite(norm)):
        run.optimizer.step()
        interval.stats += interval.pending.to(interval.stats.dtype)
        interval.run_stats += interval.pending
    else:
        state.skipped_steps += 1
        log.warning("optimizer step %d skipped on every process: the gradients were not finite (norm %s; %d of this "
                    "process's micro-batches had a non-finite loss); %d steps skipped so far", state.step + 1,
                    float(norm), int(interval.nonfinite), state.skipped_steps)
    run.optimizer.zero_grad(set_to_none=True)
    interval.pending.zero_()
    interval.nonfinite.zero_()


def _after_step(run: Run, progress: Progress, interval: IntervalLog) -> None:
    """After an optimizer step: log every ``loop.log_every`` steps (and at the last), validate
    every ``loop.eval_every`` steps (not counted as training time), checkpoint every
    ``loop.save_every`` steps before the last (the finish writes the last one)."""
    step, lcfg = run.state.step, run.cfg.loop
    if step % lcfg.log_every == 0 or step == run.total_steps:
        progress.last_train = interval.write(step)
    if lcfg.eval_every and step % lcfg.eval_every == 0:
        progress.stop_clock()
        progress.last_val = validate(run, step)
        progress.start_clock()
    if step % lcfg.save_every == 0 and step < run.total_steps:
        fold_run_stats(run, interval)
        save_checkpoint(run.accelerator, run.output_dir, step)
