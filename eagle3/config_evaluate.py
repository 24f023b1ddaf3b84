"""The evaluate stage's own sections of the one typed configuration (:mod:`eagle3.config`
re-exports them): the prompts it evaluates (``data``) and ``mode=doctor``'s settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class BenchmarksConfig:
    """Evaluation prompts (``evaluate.py``'s ``data``).

    Without a ``data=`` choice (``source`` None): the built-in benchmarks ``names`` among
    gsm8k, humaneval, sharegpt (its held-out test split) and mtbench (needs
    ``mtbench_path``). With one (``conf/data/<source>.yaml``, the same files extraction
    reads): that source alone, as one benchmark, and ``names`` / ``mtbench_path`` are not
    read: ``jsonl`` (OpenAI ``{"messages": [...]}`` per line) or ``sharegpt_json`` (a
    ShareGPT JSON file) at ``path``, named ``name`` when it is set to something other than
    the source (else after the file: ``my_chats.jsonl`` -> ``my_chats``); ``mtbench`` at
    ``path``; ``gsm8k``, ``humaneval`` or ``sharegpt`` from their packages. A damaged record
    of the file: ``on_bad_record`` (``error`` | ``skip``), as in extraction.
    ``limit``: prompts per benchmark (the first in file order, after leaving out those the
    drafter was trained on: :func:`eagle3.evaluate.benchmarks.load_benchmarks`).
    """

    names: list[str] = field(default_factory=lambda: ["gsm8k", "humaneval", "sharegpt"])
    limit: Optional[int] = None  # prompts per benchmark
    mtbench_path: Optional[str] = None
    seed: int = 0
    name: Optional[str] = None  # the benchmark's name with data=jsonl|sharegpt_json; None = the file's
    source: Optional[str] = None  # set by data=<source>; None = the built-in benchmarks (names)
    path: Optional[str] = None  # the prompt file of data=jsonl|sharegpt_json|mtbench
    on_bad_record: str = "error"  # a damaged record of that file: error (refuse, naming it) | skip (count it)


@dataclass
class DoctorConfig:
    """``mode=doctor`` (docs/doctor.md): fast checks of the export at ``drafter_dir`` against
    the target (``model=``) and the engine that will serve it, then a short greedy
    acceptance probe (``probe_prompts`` built-in prompts, ``probe_max_new_tokens`` tokens
    each, in process with ``engine=hf``; through ``engine.speculative_url`` as well with
    ``engine=sglang``; ``probe=false`` skips it). A probe ``tau`` below
    ``accepts_nothing_below`` fails ("accepts nothing"). ``serving_engine`` names the engine
    whose aux-id convention the export must match (``sglang`` | ``vllm``); None =
    ``engine.name``, with ``hf`` reading SGLang's. Exit code 1 when a check fails."""

    probe: bool = True
    probe_prompts: int = 4
    probe_max_new_tokens: int = 32
    accepts_nothing_below: float = 1.05
    serving_engine: Optional[str] = None  # sglang | vllm; None = engine.name (hf: sglang)


@dataclass
class ScheduleConfig:
    """``mode=schedule`` (``engine=vllm``, :mod:`eagle3.evaluate.vllm.schedule`): a served sweep
    over ``concurrency`` of speculation off and each static chain in ``chains`` (speculative
    tokens k; every server with the same explicit ``engine.max_num_seqs``), ``rounds`` times
    interleaved; the number of speculative tokens per batch size derived from it
    (:mod:`eagle3.schedule`; a chain is chosen only where it predicts ``min_gain`` times off's
    throughput), then, with ``check``, served and swept again beside the others."""

    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128])
    chains: list[int] = field(default_factory=lambda: [3, 1])
    rounds: int = 3
    min_gain: float = 1.0
    check: bool = True
