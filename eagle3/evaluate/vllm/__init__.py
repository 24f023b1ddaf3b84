"""``engine=vllm``: evaluation through a baseline and a speculative vLLM server
(:mod:`eagle3.evaluate.vllm.backend`)."""
