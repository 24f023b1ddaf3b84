"""Modules loaded by a vLLM server process (its own environment: they import vLLM, not eagle3)."""
