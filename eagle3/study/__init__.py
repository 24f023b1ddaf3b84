"""Studies of the target's deployments (docs/precision-study.md); callers import the modules."""
