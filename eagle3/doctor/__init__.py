"""``python evaluate.py mode=doctor``: diagnose a drafter export against the target and the
engine that will serve it (a checklist with one fix-it line per failure, then a short
acceptance probe). Callers import ``eagle3.doctor.run``."""
