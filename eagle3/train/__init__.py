"""The train stage: the training-time test, the draft vocabulary, the Accelerate loop.

Callers import the submodules (``from eagle3.train.run import run_train``); this file
imports nothing. The drafter's architecture lives in :mod:`eagle3.model.drafter`, so that
export, spec, doctor and study import it without the loop. The data path:
:mod:`~eagle3.train.run` (the stage) -> :mod:`~eagle3.train.build` (settings, data,
Accelerator, run record, vocabulary, drafter, optimizer, resume) -> :mod:`~eagle3.train.loop`
-> :mod:`~eagle3.train.finish` (last checkpoint, validation, exports, metrics); beside them
:mod:`~eagle3.train.data`, :mod:`~eagle3.train.settings`, :mod:`~eagle3.train.record`,
:mod:`~eagle3.train.checkpoint`, :mod:`~eagle3.train.validation`, :mod:`~eagle3.train.ttt`,
:mod:`~eagle3.train.vocab`.
"""
