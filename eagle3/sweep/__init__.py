"""Hydra multirun sweeps: each job's summary (:mod:`~eagle3.sweep.record`), the sweep's table and
callback (:mod:`~eagle3.sweep.summary`), and a learning curve over finished runs
(:mod:`~eagle3.sweep.curve`)."""
