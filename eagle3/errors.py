"""User-facing errors.

:class:`Eagle3Error` carries one sentence that says what is wrong and what to change.
Entry points print it without a traceback and exit non-zero (:func:`eagle3.cli.run_stage`).
"""


class Eagle3Error(Exception):
    """A problem with the user's input or environment that the user can fix."""


class GPUMemoryError(Eagle3Error):
    """Out of GPU memory even at the smallest batch limits (:mod:`eagle3.engines.hf.oom`).

    Still the user's to fix when it persists (fewer replicas on the GPU, lower limits), but among
    replicas sharing one GPU it is often transient: another process held the memory. A data-parallel
    worker that fails with it exits with :data:`eagle3.workers.EXIT_GPU_MEMORY` and is started again
    once the other workers are done (:func:`eagle3.workers.run_workers`).
    """
