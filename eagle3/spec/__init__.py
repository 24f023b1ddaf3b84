"""Speculative decoding in process: the target runner, the drafter's proposer, draft trees, acceptance, the decoder."""
