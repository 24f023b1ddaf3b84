"""The evaluate stage: provenance checks, in-process and served evaluation, metrics, the report."""
