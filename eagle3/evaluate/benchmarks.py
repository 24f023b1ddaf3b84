"""Which benchmarks the evaluate stage runs and their prompts.

:func:`benchmark_names` turns ``cfg.data`` into the list of benchmarks to run (gsm8k,
humaneval, held-out sharegpt, mtbench when its questions file is set) and refuses
settings that cannot work; :func:`load_benchmarks` loads each one through
:func:`eagle3.prompts.load_benchmark` and keeps ``data.limit`` prompts.
"""

from __future__ import annotations

from typing import Optional, Sequence

from eagle3.errors import Eagle3Error

BENCHMARKS = ("gsm8k", "humaneval", "sharegpt", "mtbench")


def benchmark_names(data_cfg) -> list[str]:
    """Benchmarks to run: ``data.names`` (+ mtbench when ``data.mtbench_path`` is set).

    Raises:
        Eagle3Error: unknown names, an empty list, or mtbench without a path.
    """
    names = list(dict.fromkeys(str(n) for n in data_cfg.names))
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise Eagle3Error(f"unknown benchmarks {unknown} in data.names; choose among {list(BENCHMARKS)}")
    if data_cfg.mtbench_path and "mtbench" not in names:
        names.append("mtbench")
    if "mtbench" in names and not data_cfg.mtbench_path:
        raise Eagle3Error("the mtbench benchmark needs its questions file: set data.mtbench_path=PATH/question.jsonl")
    if not names:
        raise Eagle3Error("data.names is empty; list benchmarks such as [gsm8k, humaneval, sharegpt]")
    if data_cfg.limit is not None and data_cfg.limit < 1:
        raise Eagle3Error(f"data.limit={data_cfg.limit} must be a positive number of prompts per benchmark")
    return names


def load_benchmarks(cfg, names: Sequence[str], train_manifest: Optional[dict],
                    left_out: Optional[dict] = None) -> dict:
    """``{name: datasets.Dataset(id, messages)}`` with at most ``data.limit`` rows each.

    Args:
        cfg: the ``EvaluateConfig`` (its ``data`` section names sources and the limit).
        names: from :func:`benchmark_names`.
        train_manifest: from :func:`eagle3.evaluate.provenance.load_train_manifest`
            (held-out ShareGPT prompts that were trained on are refused; GSM8K,
            HumanEval and MT-Bench prompts that were trained on are left out), or None.
        left_out: if given, filled with ``{name: {"left_out": n, "held_out": m}}`` for each
            benchmark that lost prompts to training (e.g. HumanEval after
            ``extract.py data=humaneval data.test_fraction=0.5``: 84 left out, 80 held out),
            the report's ``settings.trained_on_left_out``.

    Raises:
        Eagle3Error: a benchmark without prompts, or as
            :func:`eagle3.prompts.load_benchmark` (e.g. overlap with training).
    """
    from eagle3.prompts import load_benchmark

    out = {}
    for name in names:
        counts: dict = {}
        ds = load_benchmark(name, cfg.data, train_manifest, counts)
        if left_out is not None and counts.get("left_out"):
            left_out[name] = counts
        if cfg.data.limit is not None and len(ds) > cfg.data.limit:
            ds = ds.select(range(cfg.data.limit))
        if len(ds) == 0:
            raise Eagle3Error(f"benchmark {name} has no prompts left (every one was trained on, or none in its source); "
                              f"drop {name} from data.names or evaluate a drafter whose features keep a test split of it")
        out[name] = ds
    return out
