"""Prompt datasets (``datasets.Dataset``) with deterministic splits: extraction prompts and benchmarks.

Every dataset has the columns ``id`` (a stable string), ``messages`` (a list of
``{"role", "content"}`` with roles system/user/assistant) and ``split``; the records
come from :mod:`eagle3.prompts.sources`.

Splits are deterministic in ``data.seed`` and the sample id alone (sha256 of
``"<seed>:<id>"`` mapped to [0, 1)), so adding data never moves another sample:
``u < test_fraction`` -> test, ``u < test_fraction + validation_fraction`` ->
validation, else train. The test split never reaches training.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Optional

import datasets

from eagle3.errors import Eagle3Error
from eagle3.prompts.sources import _gsm8k_records, _humaneval_records, _mtbench_records, _records

SPLITS = ("train", "validation", "test")


def dataset_of(rows: dict[str, list], features: datasets.Features) -> datasets.Dataset:
    """``rows`` (column name -> list) as a ``datasets.Dataset`` whose fingerprint is the
    sha256 of the rows themselves (16 hex digits).

    ``Dataset.from_dict`` fingerprints a new table by pickling it with dill; with
    Python 3.12, dill 0.4 and pyarrow 26 that walks into pyarrow's own module and fails
    ("Can't pickle <class 'MonthDayNano'>"), which stopped every extraction on a GPU
    host with that Python. The content hash is also stable across runs, which dill's
    is not guaranteed to be.
    """
    blob = json.dumps(rows, sort_keys=True, ensure_ascii=False).encode()
    table = datasets.table.InMemoryTable.from_pydict(features.encode_batch(rows), schema=features.arrow_schema)
    return datasets.Dataset(table, info=datasets.DatasetInfo(features=features),
                            fingerprint=hashlib.sha256(blob).hexdigest()[:16])


FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
        "split": datasets.Value("string"),
    }
)


def split_of(sample_id: str, seed: int, validation_fraction: float, test_fraction: float) -> str:
    """The split of ``sample_id`` (train | validation | test); depends on seed and id only."""
    h = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    u = int.from_bytes(h[:8], "big") / 2.0**64
    if u < test_fraction:
        return "test"
    if u < test_fraction + validation_fraction:
        return "validation"
    return "train"


def _check_fractions(data_cfg) -> None:
    v, t = float(data_cfg.validation_fraction), float(data_cfg.test_fraction)
    if v < 0 or t < 0 or v + t >= 1:
        raise Eagle3Error(
            f"data.validation_fraction={v} and data.test_fraction={t} must be >= 0 and sum to less than 1"
        )


def load_conversations(data_cfg, stats: Optional[dict] = None) -> datasets.Dataset:
    """All conversations of ``data_cfg`` with their split (``limit`` is not applied here).

    Args:
        data_cfg: :class:`eagle3.config.DataConfig`.
        stats: if given, filled with counts (``records``, ``conversations``,
            ``incomplete_records``, ``dropped_*``, per-split sizes).

    Returns:
        ``datasets.Dataset`` with columns ``id``, ``messages``, ``split``, in source order.

    Raises:
        Eagle3Error: unknown source, missing package/file, malformed user file.
    """
    _check_fractions(data_cfg)
    counts: Counter = Counter()
    recs = _records(data_cfg, counts)
    rows = {"id": [], "messages": [], "split": []}
    for sid, msgs in recs:
        rows["id"].append(sid)
        rows["messages"].append(msgs)
        rows["split"].append(
            split_of(sid, data_cfg.seed, data_cfg.validation_fraction, data_cfg.test_fraction)
        )
    counts["conversations"] = len(recs)
    for s in SPLITS:
        counts[f"split_{s}"] = rows["split"].count(s)
    if stats is not None:
        stats.update(dict(counts))
    return dataset_of(rows, FEATURES)


def select_for_extraction(ds: datasets.Dataset, splits, limit: Optional[int], offset: int = 0) -> datasets.Dataset:
    """The rows of ``splits`` (never ``test``), in source order, from the ``offset``-th on,
    at most ``limit`` of them (``offset`` cuts a source into parts extracted separately,
    e.g. one folder per machine: offset 0 limit 4000, then offset 4000).

    Raises:
        Eagle3Error: ``test`` or an unknown split asked for, ``limit`` < 1 or ``offset`` < 0.
    """
    splits = list(splits)
    bad = [s for s in splits if s not in SPLITS]
    if bad:
        raise Eagle3Error(f"data.splits {bad} unknown; use train and/or validation")
    if "test" in splits:
        raise Eagle3Error("data.splits must not include test: the test split is kept for evaluation")
    if limit is not None and int(limit) < 1:
        raise Eagle3Error(f"data.limit={limit} must be at least 1 (or null for all)")
    if int(offset) < 0:
        raise Eagle3Error(f"data.offset={offset} must be >= 0 (the number of selected conversations to skip)")
    keep = [i for i, s in enumerate(ds["split"]) if s in splits][int(offset):]
    if limit is not None:
        keep = keep[: int(limit)]
    return ds.select(keep)


def trained_ids(train_manifest: dict) -> set[str]:
    """Sample ids a drafter's features may have trained on: the manifest's ``plan`` and
    its ``train`` and ``validation`` splits (of the whole source, extracted or not).

    Args:
        train_manifest: from :func:`eagle3.export.provenance.load_train_manifest`:
            ``plan`` (``[[sample_id, split], ...]``) and ``splits`` (``{split: [ids]}``).
    """
    ids = {p[0] for p in train_manifest.get("plan", [])}
    for split in ("train", "validation"):
        ids.update((train_manifest.get("splits") or {}).get(split, []))
    return ids


def load_benchmark(name: str, bench_cfg, train_manifest: Optional[dict] = None,
                   stats: Optional[dict] = None) -> datasets.Dataset:
    """Evaluation prompts of one benchmark: columns ``id``, ``messages`` (user turns
    only; MT-Bench has two), ``category`` (MT-Bench category, else "").

    ``sharegpt`` serves the held-out test split, computed with the seed and fractions
    recorded in ``train_manifest`` (``metadata.data``) when given, else the defaults;
    each prompt is the first user turn (after any system message). ``gsm8k``,
    ``humaneval`` and ``mtbench`` serve every record except those the drafter was
    trained on: ids in ``train_manifest``'s plan or its train/validation splits (a
    drafter trained on ``data=gsm8k`` features is evaluated on GSM8K's held-out test
    split; without such features nothing is left out). ``bench_cfg.limit`` keeps the
    first N in source order, after that. ``stats``, if given, is filled with
    ``left_out`` (prompts left out as trained on) and ``held_out`` (prompts left before
    the limit), so a report can say what a benchmark's row was scored on.

    Raises:
        Eagle3Error: unknown benchmark, missing ``mtbench_path``, or a ShareGPT test id
            that appears in the training manifest (evaluation data must never be trained on).
    """
    from eagle3.config import DataConfig

    limit = bench_cfg.limit
    rows: list[tuple[str, list[dict], str]]
    if name == "gsm8k":
        rows = [(i, m, "") for i, m in _gsm8k_records()]
    elif name == "humaneval":
        rows = [(i, m, "") for i, m in _humaneval_records()]
    elif name == "mtbench":
        if not bench_cfg.mtbench_path:
            raise Eagle3Error("the mtbench benchmark needs its questions file: give data.mtbench_path=/path/to/question.jsonl")
        p = Path(os.path.expanduser(bench_cfg.mtbench_path))
        if not p.is_file():
            raise Eagle3Error(f"data.mtbench_path '{p}' does not exist; give the MT-Bench question.jsonl")
        rows = _mtbench_records(p)
    elif name == "sharegpt":
        meta = ((train_manifest or {}).get("metadata") or {}).get("data") or {}
        dcfg = DataConfig(name="sharegpt", source="sharegpt")
        if meta.get("source", "sharegpt") == "sharegpt":
            dcfg.seed = int(meta.get("seed", dcfg.seed))
            fr = meta.get("fractions") or {}
            dcfg.validation_fraction = float(fr.get("validation", dcfg.validation_fraction))
            dcfg.test_fraction = float(fr.get("test", dcfg.test_fraction))
        ds = load_conversations(dcfg)
        rows = []
        for sid, msgs, split in zip(ds["id"], ds["messages"], ds["split"]):
            if split != "test":
                continue
            sys_msgs = [m for m in msgs if m["role"] == "system"][:1]
            first_user = next(m for m in msgs if m["role"] == "user")
            rows.append((sid, sys_msgs + [first_user], ""))
        if train_manifest is not None:
            trained = trained_ids(train_manifest)
            leaked = [sid for sid, _, _ in rows if sid in trained]
            if leaked:
                raise Eagle3Error(
                    f"{len(leaked)} ShareGPT test prompts (e.g. {leaked[0]}) were used in training; "
                    "evaluate a drafter trained on features whose data.seed/fractions keep the test split out"
                )
    else:
        raise Eagle3Error(f"benchmark '{name}' is unknown; use gsm8k, humaneval, sharegpt or mtbench")
    total = len(rows)
    if name != "sharegpt" and train_manifest is not None:
        trained = trained_ids(train_manifest)
        rows = [r for r in rows if r[0] not in trained]
    if stats is not None:
        stats.update(left_out=total - len(rows), held_out=len(rows))
    if limit is not None:
        rows = rows[: int(limit)]
    return dataset_of(
        {"id": [r[0] for r in rows], "messages": [r[1] for r in rows], "category": [r[2] for r in rows]},
        datasets.Features(
            {
                "id": datasets.Value("string"),
                "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
                "category": datasets.Value("string"),
            }
        ),
    )
