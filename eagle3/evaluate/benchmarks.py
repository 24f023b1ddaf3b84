"""Which benchmarks the evaluate stage runs and their prompts.

:func:`benchmark_names` turns ``cfg.data`` into the list of benchmarks to run and refuses
settings that cannot work: without a ``data=`` choice the built-in gsm8k, humaneval,
held-out sharegpt (and mtbench when its questions file is set); with one
(``data=jsonl data.path=FILE``, ``data=sharegpt_json``, ``data=mtbench``, ``data=gsm8k``
...) that source alone. :func:`load_benchmarks` loads each one (a built-in through
:func:`eagle3.prompts.load_benchmark`, a prompt file through :func:`load_prompt_file`)
and keeps ``data.limit`` prompts. Every engine (hf, sglang, vllm) reads its prompts here.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

from eagle3.errors import Eagle3Error

BENCHMARKS = ("gsm8k", "humaneval", "sharegpt", "mtbench")
#: ``data.source`` values read from a user file at ``data.path`` (the extraction readers)
FILE_SOURCES = ("jsonl", "sharegpt_json")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _source_benchmark(data_cfg) -> str:
    """The one benchmark of a ``data=<source>`` choice (see :func:`benchmark_names`)."""
    src, path = str(data_cfg.source), data_cfg.path
    if data_cfg.mtbench_path:
        raise Eagle3Error(f"data={src} evaluates that source alone, and data.mtbench_path is read only without a "
                          "data= choice; drop data.mtbench_path (or give the questions as data=mtbench data.path=FILE)")
    if src in ("gsm8k", "humaneval", "sharegpt"):
        if path:
            raise Eagle3Error(f"data={src} reads its packaged prompts and no data.path; for a file of your own use "
                              "data=jsonl (or sharegpt_json) data.path=FILE")
        return src
    if src not in FILE_SOURCES + ("mtbench",):
        raise Eagle3Error(f"data.source '{src}' cannot be evaluated; use data=jsonl or data=sharegpt_json with "
                          "data.path=FILE, data=mtbench data.path=question.jsonl, or data=gsm8k|humaneval|sharegpt")
    if not path:
        raise Eagle3Error(f"data={src} needs its file: give data.path=/path/to/file")
    if src == "mtbench":
        return "mtbench"
    name = str(data_cfg.name) if data_cfg.name and data_cfg.name != src else Path(str(path)).name
    if data_cfg.name in (None, src):  # named after the file: my_chats.jsonl (or .jsonl.gz) -> my_chats
        name = name[: -len(".gz")] if name.endswith(".gz") else name
        name = Path(name).stem
    if not _NAME.fullmatch(name):
        raise Eagle3Error(f"the benchmark name {name!r} (data.name, else the file's name) names its report rows and "
                          "files; use letters, digits, '.', '_' and '-', e.g. data.name=my_prompts")
    if name in BENCHMARKS:
        raise Eagle3Error(f"the benchmark name {name!r} is a built-in benchmark's; give the file's prompts another, "
                          "e.g. data.name=my_prompts")
    return name


def benchmark_names(data_cfg) -> list[str]:
    """Benchmarks to run: ``data.names`` (+ mtbench when ``data.mtbench_path`` is set); with
    a ``data=<source>`` choice (``data.source`` set) that source's one benchmark: a prompt
    file (``jsonl``, ``sharegpt_json``) named ``data.name`` when it differs from the source,
    else after the file (``my_chats.jsonl`` -> ``my_chats``); ``mtbench`` from ``data.path``;
    ``gsm8k``, ``humaneval``, ``sharegpt`` from their packages.

    Raises:
        Eagle3Error: unknown names, an empty list, mtbench without a path, a ``data.limit``
            below 1; with a source: no ``data.path`` where one is needed (or one where none
            is read), ``data.mtbench_path`` beside it, a name that is no file name or is a
            built-in benchmark's; ``data.path`` without a ``data=`` choice.
    """
    if data_cfg.limit is not None and data_cfg.limit < 1:
        raise Eagle3Error(f"data.limit={data_cfg.limit} must be a positive number of prompts per benchmark")
    if getattr(data_cfg, "source", None):
        return [_source_benchmark(data_cfg)]
    if getattr(data_cfg, "path", None):
        raise Eagle3Error(f"data.path={data_cfg.path} is read with a data= choice; add data=jsonl (one "
                          '{"messages": [...]} per line), data=sharegpt_json or data=mtbench')
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
    return names


def prompt_settings(data_cfg) -> dict:
    """The report's ``settings`` entries naming a ``data=<source>`` choice:
    ``{"prompt_source": source, "prompt_file": data.path or None}``; ``{}`` without one."""
    src = getattr(data_cfg, "source", None)
    return {"prompt_source": str(src), "prompt_file": data_cfg.path} if src else {}


def load_prompt_file(data_cfg, train_manifest: Optional[dict] = None, stats: Optional[dict] = None):
    """The prompts of a user file (``data=jsonl`` or ``data=sharegpt_json`` at ``data.path``)
    as a benchmark: ``datasets.Dataset`` with ``id``, ``messages`` (the conversation's system
    messages, then its user turns: each user turn is answered by the decoding, the file's
    assistant turns are not used) and ``category`` (""), in file order, without the ids the
    drafter was trained on (``train_manifest``'s plan and train/validation splits; a file
    that was also extracted from keeps its test split). ``stats``, if given, gets
    ``left_out`` and ``held_out`` (as :func:`eagle3.prompts.load_benchmark`). The file is
    read by extraction's readers (:mod:`eagle3.prompts.sources`), with their checks.

    Raises:
        Eagle3Error: a missing or unreadable file, one that is not UTF-8, a malformed line or
            record (named by file and line; ``data.on_bad_record=skip`` skips and counts
            damaged JSON instead), duplicate ids, or a file without a conversation.
    """
    import datasets

    from eagle3.config import DataConfig
    from eagle3.prompts.load import dataset_of, load_conversations, trained_ids

    ds = load_conversations(DataConfig(name=str(data_cfg.source), source=str(data_cfg.source), path=str(data_cfg.path),
                                       seed=int(data_cfg.seed), validation_fraction=0.0, test_fraction=0.0,
                                       on_bad_record=str(data_cfg.on_bad_record)))
    rows = [(sid, [m for m in msgs if m["role"] == "system"] + [m for m in msgs if m["role"] == "user"])
            for sid, msgs in zip(ds["id"], ds["messages"])]
    total = len(rows)
    if train_manifest is not None:
        trained = trained_ids(train_manifest)
        rows = [r for r in rows if r[0] not in trained]
    if stats is not None:
        stats.update(left_out=total - len(rows), held_out=len(rows))
    message = [{"role": datasets.Value("string"), "content": datasets.Value("string")}]
    return dataset_of({"id": [r[0] for r in rows], "messages": [r[1] for r in rows], "category": [""] * len(rows)},
                      datasets.Features({"id": datasets.Value("string"), "messages": message,
                                         "category": datasets.Value("string")}))


def load_benchmarks(cfg, names: Sequence[str], train_manifest: Optional[dict],
                    left_out: Optional[dict] = None) -> dict:
    """``{name: datasets.Dataset(id, messages, category)}`` with at most ``data.limit`` rows each.

    Args:
        cfg: the ``EvaluateConfig`` (its ``data`` section names sources and the limit).
        names: from :func:`benchmark_names` (with ``data.source`` set, its one benchmark:
            a prompt file through :func:`load_prompt_file`, ``mtbench`` from ``data.path``).
        train_manifest: from :func:`eagle3.export.provenance.load_train_manifest`
            (held-out ShareGPT prompts that were trained on are refused; GSM8K,
            HumanEval, MT-Bench and prompt-file prompts that were trained on are left out), or None.
        left_out: if given, filled with ``{name: {"left_out": n, "held_out": m}}`` for each
            benchmark that lost prompts to training (e.g. HumanEval after
            ``extract.py data=humaneval data.test_fraction=0.5``: 84 left out, 80 held out),
            the report's ``settings.trained_on_left_out``.

    Raises:
        Eagle3Error: a benchmark without prompts, or as :func:`load_prompt_file` and
            :func:`eagle3.prompts.load_benchmark` (e.g. overlap with training).
    """
    from eagle3.prompts import load_benchmark

    src = getattr(cfg.data, "source", None)
    out = {}
    for name in names:
        counts: dict = {}
        if src in FILE_SOURCES:
            ds = load_prompt_file(cfg.data, train_manifest, counts)
        elif src == "mtbench":
            if not Path(str(cfg.data.path)).expanduser().is_file():
                raise Eagle3Error(f"data.path '{cfg.data.path}' does not exist; give the MT-Bench question.jsonl")
            ds = load_benchmark(name, SimpleNamespace(limit=None, mtbench_path=cfg.data.path), train_manifest, counts)
        else:
            ds = load_benchmark(name, cfg.data, train_manifest, counts)
        if left_out is not None and counts.get("left_out"):
            left_out[name] = counts
        if cfg.data.limit is not None and len(ds) > cfg.data.limit:
            ds = ds.select(range(cfg.data.limit))
        if len(ds) == 0:
            fix = (f"every prompt of {cfg.data.path} was trained on; evaluate prompts the drafter did not train on"
                   if src in FILE_SOURCES else f"drop {name} from data.names or evaluate a drafter whose features "
                   "keep a test split of it")
            raise Eagle3Error(f"benchmark {name} has no prompts left (every one was trained on, or none in its "
                              f"source); {fix}")
        out[name] = ds
    return out
