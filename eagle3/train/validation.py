"""Validation of the drafter during and after training: metrics over the validation split, logged.

:func:`evaluate` runs the training-time test unroll (:mod:`eagle3.train.ttt`) without
gradients over a loader and sums its statistics over all processes; :func:`validate` does
that for a run's validation batches and logs the result to the tracker and the log.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from eagle3.train.replay import serving_replay
from eagle3.train.ttt import TTTModel, batch_to, summarize

if TYPE_CHECKING:
    from eagle3.train.build import Run

log = logging.getLogger("eagle3")


@torch.no_grad()
def evaluate(accelerator, model: TTTModel, loader, step_weight: float) -> Optional[dict]:
    """Validation metrics (:func:`eagle3.train.ttt.summarize`) over ``loader``; None when no
    process's loader held a sample.

    Every process evaluates its own batches under ``accelerator.autocast()`` and the
    statistics are summed over processes (``accelerator.reduce``), so every process gets
    the metrics of all the batches, as one process evaluating them all would. A process
    with no batch (fewer validation batches than processes) takes part in the sums with
    zeros: every process makes the same collective calls whatever its share. The metrics:
    ``loss``, per-step ``step_loss``/``step_acc``,
    simulated ``tau`` (a chain from every reply position), ``replay_tau`` and
    ``replay_chains`` (chains where serving starts them: :mod:`eagle3.train.replay`) and
    ``samples``. The drafter's train/eval mode is restored.
    """
    ttt = accelerator.unwrap_model(model)
    drafter = ttt.drafter
    was_training = drafter.training
    drafter.eval()
    stats = torch.zeros(ttt.ttt_steps, 3, dtype=torch.float32, device=accelerator.device)
    accepted = torch.zeros((), dtype=torch.float32, device=accelerator.device)
    chains, samples, replay = 0, 0, [0, 0]
    for batch in loader:
        if not batch["sample_ids"]:  # every sample had non-finite features (a loss-free stand-in)
            continue
        batch = batch_to(batch, accelerator.device)
        with accelerator.autocast():
            out = ttt(batch)
        stats = stats + out.step_stats
        accepted = accepted + out.accepted
        chains += out.num_chains
        samples += len(batch["sample_ids"])
        a, c = serving_replay(out.accepted_rows, batch["chain_starts"], batch["input_ids"].shape[1])
        replay = [replay[0] + a, replay[1] + c]
    drafter.train(was_training)
    # every process reduces, with or without batches of its own (a skipped reduce leaves its peers waiting)
    totals = accelerator.reduce(torch.tensor([float(accepted), chains, samples, *replay], device=stats.device,
                                             dtype=torch.float64), "sum")
    stats = accelerator.reduce(stats, "sum")
    if not int(totals[2]):
        return None
    m = summarize(stats, float(totals[0]), int(totals[1]), step_weight)
    m["samples"] = int(totals[2])
    m["replay_tau"] = 1.0 + float(totals[3]) / float(totals[4]) if totals[4] else None
    m["replay_chains"] = int(totals[4])
    return m


def validate(run: "Run", step: int) -> Optional[dict]:
    """:func:`evaluate` over the run's validation batches, logged as ``val/*`` at optimizer
    step ``step``; None when the features hold no validation samples.

    The dict also records ``step``, so :func:`eagle3.train.finish.finish` can tell whether it
    describes the final weights (``metrics.json``'s ``validation.step``). Every process calls it,
    those without a validation batch of their own too (:func:`evaluate`)."""
    if len(run.val_ds) == 0:  # the same on every process (``run.val_batches`` is this process's share)
        return None
    m = evaluate(run.accelerator, run.model, run.loader(run.val_ds, run.val_batches), run.cfg.drafter.step_weight)
    if m is not None:
        m["step"] = step
        logs = {"val/loss": m["loss"], "val/tau": m["tau"]}
        if m["replay_tau"] is not None:
            logs["val/replay_tau"] = m["replay_tau"]
        for j, a in enumerate(m["step_acc"]):
            logs[f"val/acc_{j}"] = a
        run.accelerator.log(logs, step=step)
        log.info("step %d validation: loss %.4f, acc %s, tau %.3f (serving replay %s)", step, m["loss"],
                 [round(a, 3) for a in m["step_acc"]], m["tau"],
                 "-" if m["replay_tau"] is None else f"{m['replay_tau']:.3f}")
    return m
