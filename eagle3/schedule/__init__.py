"""Speculative tokens by batch size: derived from served measurements (:mod:`eagle3.schedule.derive`),
written as bands and in each engine's own setting (:mod:`eagle3.schedule.bands`). Pure: no engine is imported."""
