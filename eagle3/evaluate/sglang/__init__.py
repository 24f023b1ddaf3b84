"""``engine=sglang``: evaluation through a baseline and a speculative SGLang server
(:mod:`eagle3.evaluate.sglang.backend`)."""
