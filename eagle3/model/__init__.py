"""The drafter model: the EAGLE-3 architecture only (imported by train, export, spec, doctor and study)."""
