"""Drafter exports in the formats servers load (SGLang, and vLLM through speculators), and reading them back."""
