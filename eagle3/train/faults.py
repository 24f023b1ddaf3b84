"""Training with several processes when one of them fails: a bounded wait and an error that says what to do.

Every collective of the loop (the gradient all-reduce, validation sums, checkpoint barriers)
waits at most ``loop.collective_timeout_s`` seconds for the other processes: the process
group's timeout (:func:`process_group_kwargs`). A process whose peer died (its sockets
close: gloo fails at once) or stopped answering (the wait times out) raises a
``RuntimeError`` from inside the collective; :func:`peer_failure` turns it into an
:class:`~eagle3.errors.Eagle3Error` that names the newest complete checkpoint and says that
the same command resumes from it (:mod:`eagle3.train.checkpoint`). Under ``accelerate launch``
(torchrun) the launcher also ends the other processes once one has exited, so a dead process
ends the run either way; the timeout is what ends a run whose process is alive but stuck.
With NCCL, PyTorch's watchdog may end a process whose collective timed out before Python sees
an error (``TORCH_NCCL_ASYNC_ERROR_HANDLING``); its log names the collective, and the same
command resumes as well.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from eagle3.errors import Eagle3Error
from eagle3.train.checkpoint import latest_checkpoint

# what gloo, NCCL and the c10d store put in the message of a failed or timed-out collective
_COLLECTIVE_MARKS = ("gloo", "nccl", "c10d", "processgroup", "pair closure")  # gloo: "Application timeout caused pair closure"


def process_group_kwargs(timeout_s: float):
    """Accelerate's ``InitProcessGroupKwargs`` with a collective timeout of ``timeout_s`` seconds.

    ``InitProcessGroupKwargs.to_kwargs`` passes on only values that differ from its own
    defaults, and its default timeout is NCCL's 600 s, so 600 s would reach gloo as PyTorch's
    1800 s; a microsecond more keeps every value as asked."""
    from accelerate.utils import InitProcessGroupKwargs

    timeout = timedelta(seconds=float(timeout_s))
    if timeout == InitProcessGroupKwargs().timeout:
        timeout += timedelta(microseconds=1)
    return InitProcessGroupKwargs(timeout=timeout)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a collective whose peers failed: a ``torch.distributed.DistError``
    (NCCL, the store), or gloo's ``RuntimeError`` (a closed or reset connection, a timeout)."""
    if isinstance(exc, getattr(torch.distributed, "DistError", ())):
        return True
    if not isinstance(exc, RuntimeError) or isinstance(exc, torch.OutOfMemoryError):
        return False
    msg = str(exc).lower()
    return any(m in msg for m in _COLLECTIVE_MARKS)


@contextmanager
def peer_failures(cfg: Any):
    """Turn a collective failure inside the block into :func:`peer_failure`'s error (several processes
    only; any other exception passes unchanged).

    Raises:
        Eagle3Error: a collective failed because another process died or stopped answering.
    """
    try:
        yield
    except RuntimeError as e:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
                and is_collective_failure(e)):
            raise
        from eagle3.paths import stage_output_dir

        raise peer_failure(e, stage_output_dir(cfg), dist.get_rank(), dist.get_world_size(),
                           cfg.loop.collective_timeout_s) from e


def peer_failure(exc: BaseException, output_dir: Path, rank: int, world: int, timeout_s: float) -> Eagle3Error:
    """The error a process raises when a collective failed because another process died or stopped.

    Args:
        exc: the collective's exception (its first line is quoted).
        output_dir: the run's folder (its newest complete checkpoint is named).
        rank, world: this process's index and the process count.
        timeout_s: ``loop.collective_timeout_s``.
    """
    ckpt = latest_checkpoint(output_dir)
    where = (f"the newest complete checkpoint is {ckpt}; run the same command again to resume from it"
             if ckpt is not None else
             f"no checkpoint was written yet; the same command starts the run again in {output_dir}")
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    return Eagle3Error(
        f"process {rank} of {world}: another training process died or stopped answering (a collective failed "
        f"or waited more than loop.collective_timeout_s={timeout_s:g} s: {first}); {where} (see the other "
        "processes' logs for why one stopped)"
    )
