"""Checkpoints of a training run: the progress counters, atomic writes, and the newest complete one.

A checkpoint is ``accelerator.save_state`` (model, optimizer, the registered scheduler and
:class:`TrainState`, each process's RNG state) written into
``<output_dir>/checkpoints/step-NNNNNNNN.tmp``, marked ``COMPLETE`` and renamed to
``step-NNNNNNNN`` once every process has written its part; the newest
:data:`KEEP_CHECKPOINTS` are kept. A folder under its final name is therefore always
complete, and a run killed in the middle of a save resumes from the previous one.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

CHECKPOINTS = "checkpoints"
KEEP_CHECKPOINTS = 2

# Why not Accelerate's own naming (ProjectConfiguration(automatic_checkpoint_naming=True,
# total_limit=...)): save_state then writes straight into checkpoints/checkpoint_<iteration>,
# so a save killed half-way leaves a folder under a final name, and load_state() without a
# folder loads the highest-numbered one, complete or not; `iteration` counts this process's
# saves, is not stored in the checkpoint and restarts at 0 on resume (the next save raises
# "already exists" unless it is set by hand); and total_limit prunes before the new save,
# counting half-written folders. Making it safe would mean setting the iteration, choosing the
# folder to load and deleting incomplete ones by hand, which is what this module does with a
# folder that is renamed only when complete.


@dataclass
class TrainState:
    """Progress counters, checkpointed with ``accelerator.register_for_checkpointing``.

    ``batch_in_epoch`` counts micro-batches of epoch ``epoch`` already trained on;
    ``step`` counts optimizer steps. ``train_stats`` is the whole run's ``[ttt_steps, 3]``
    training statistics (KL sum, loss rows, correct per TTT step; summed over processes,
    float64), flattened to a list of floats; empty before the first fold
    (:func:`eagle3.train.loop.fold_run_stats`) and in checkpoints written before it was kept.
    """

    epoch: int = 0
    batch_in_epoch: int = 0
    step: int = 0
    tokens: int = 0
    skipped_nonfinite: int = 0
    train_stats: list = field(default_factory=list)
    skipped_steps: int = 0  # optimizer steps skipped for non-finite gradients (eagle3.train.loop)

    def state_dict(self) -> dict:
        """The counters as a dict of ints and ``train_stats`` as a list of floats (saved as
        ``custom_checkpoint_<i>.pkl``)."""
        return asdict(self)

    def load_state_dict(self, d: dict) -> None:
        """Restore the counters of :meth:`state_dict`."""
        for k, v in d.items():
            setattr(self, k, [float(x) for x in v] if isinstance(v, (list, tuple)) else int(v))


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint after optimizer step ``step``: ``step-NNNNNNNN``."""
    return f"step-{step:08d}"


def latest_checkpoint(output_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint folder in ``<output_dir>/checkpoints``, or None."""
    root = output_dir / CHECKPOINTS
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if p.name.startswith("step-") and (p / "COMPLETE").exists()
                  and not p.name.endswith(".tmp"))
    return done[-1] if done else None


def save_checkpoint(accelerator, output_dir: Path, step: int) -> Path:
    """Write the checkpoint of step ``step`` (every process calls); returns its folder.

    The main process removes a stale ``.tmp`` folder, every process writes its part,
    and once all have (``save_state`` ends with no barrier and every process writes its
    own ``random_states_<rank>.pkl``) the main process marks the folder ``COMPLETE``,
    renames it and prunes all but the newest :data:`KEEP_CHECKPOINTS`.
    """
    root = output_dir / CHECKPOINTS
    final = root / checkpoint_name(step)
    tmp = root / f"{checkpoint_name(step)}.tmp"
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # a peer still writing into tmp would find it renamed away
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
