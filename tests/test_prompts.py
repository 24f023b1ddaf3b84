"""Prompt datasets: ShareGPT record-by-record parsing, user files, benchmarks, splits."""

import json
from collections import Counter
from pathlib import Path

import pytest

from eagle3.config import BenchmarksConfig, DataConfig
from eagle3.errors import Eagle3Error
from eagle3.prompts import load_benchmark, load_conversations, select_for_extraction, split_of

MTBENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt-bench" / "question.jsonl"


def _sharegpt_file(tmp_path):
    recs = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "I start"}, {"from": "human", "value": "x"}]},
        {"id": "c", "conversations": []},
        {"id": "d", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "q1"},
                                      {"from": "human", "value": "q2"}, {"from": "chatgpt", "value": "ans"}]},
        {"id": "e", "conversations": [{"from": "human", "value": "?"}, {"from": "alien", "value": "!"}]},
        {"id": "a", "conversations": [{"from": "human", "value": "dup id"}]},
    ]
    text = "[\n" + ",\n".join(json.dumps(r) for r in recs) + ',\n{"id": "f", "conversations": [{"from": "human", "value": "cut mid'
    p = tmp_path / "sg.json"
    p.write_text(text)
    return p


def test_truncated_sharegpt_file_is_parsed_record_by_record(tmp_path):
    p = _sharegpt_file(tmp_path)
    stats = {}
    ds = load_conversations(DataConfig(name="x", source="sharegpt_json", path=str(p)), stats)
    assert stats["records"] == 6 and stats["incomplete_records"] == 1
    assert stats["started_at_first_user"] == 1 and stats["dropped_empty"] == 1 and stats["dropped_unknown_role"] == 1
    assert "dropped_no_user" not in stats
    assert ds["id"] == ["sharegpt-a", "sharegpt-b", "sharegpt-d", "sharegpt-a#1"]
    assert ds[0]["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert ds[1]["messages"] == [{"role": "user", "content": "x"}]  # its opening gpt turn left out
    # roles mapped, consecutive human turns merged, system kept
    assert ds[2]["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1\n\nq2"},
        {"role": "assistant", "content": "ans"},
    ]
    assert set(ds["split"]) <= {"train", "validation", "test"}


def test_a_conversation_opening_with_gpt_turns_starts_at_its_first_human_turn(tmp_path):
    p = tmp_path / "sg.json"
    p.write_text(json.dumps([
        {"id": "g", "conversations": [{"from": "system", "value": "s"}, {"from": "gpt", "value": "g1"},
                                      {"from": "gpt", "value": "g2"}, {"from": "human", "value": "q"},
                                      {"from": "gpt", "value": "a"}, {"from": "human", "value": "q2"}]},
        {"id": "h", "conversations": [{"from": "gpt", "value": "only"}]},
    ]))
    stats = {}
    ds = load_conversations(DataConfig(name="x", source="sharegpt_json", path=str(p)), stats)
    assert ds["id"] == ["sharegpt-g"] and stats["started_at_first_user"] == 1 and stats["dropped_no_user"] == 1
    assert ds[0]["messages"] == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]


def test_user_sharegpt_file_with_nothing_usable_is_an_error(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps([{"id": "x", "conversations": [{"from": "gpt", "value": "no human"}]}]))
    with pytest.raises(Eagle3Error, match="no usable conversation"):
        load_conversations(DataConfig(name="x", source="sharegpt_json", path=str(p)))


def test_packaged_sharegpt_counts_and_splits():
    stats = {}
    cfg = DataConfig(name="sharegpt", source="sharegpt")
    ds = load_conversations(cfg, stats)
    assert stats["records"] == 17671 and stats["incomplete_records"] == 1  # the shipped file is cut mid-record
    assert stats["conversations"] == len(ds) == 17397  # 11,175 that open with a human turn, 6,222 that start at it
    assert stats["started_at_first_user"] == 6222 and stats["dropped_no_user"] == 148
    assert len(set(ds["id"])) == len(ds)
    c = Counter(ds["split"])
    assert abs(c["test"] / len(ds) - cfg.test_fraction) < 0.01
    assert abs(c["validation"] / len(ds) - cfg.validation_fraction) < 0.01
    assert all(next(t["role"] for t in m if t["role"] != "system") == "user" for m in ds["messages"])
    sel = select_for_extraction(ds, ["train", "validation"], 50)
    assert len(sel) == 50 and "test" not in sel["split"]
    again = select_for_extraction(load_conversations(cfg), ["train", "validation"], 50)
    assert again["id"] == sel["id"]  # deterministic


def test_split_depends_only_on_seed_and_id():
    ids = [f"s{i}" for i in range(3000)]
    a = {i: split_of(i, 0, 0.1, 0.2) for i in ids}
    # adding data does not move any other sample; the fractions are honoured
    b = {i: split_of(i, 0, 0.1, 0.2) for i in ids + [f"new{i}" for i in range(500)]}
    assert all(a[i] == b[i] for i in ids)
    c = Counter(a.values())
    assert abs(c["test"] / 3000 - 0.2) < 0.03 and abs(c["validation"] / 3000 - 0.1) < 0.03
    assert {i: split_of(i, 1, 0.1, 0.2) for i in ids} != a  # the seed matters


def test_select_refuses_test_split_and_bad_limit():
    ds = load_conversations(DataConfig(name="g", source="gsm8k"))
    with pytest.raises(Eagle3Error, match="test split"):
        select_for_extraction(ds, ["train", "test"], None)
    with pytest.raises(Eagle3Error, match="limit"):
        select_for_extraction(ds, ["train"], 0)
    with pytest.raises(Eagle3Error, match="offset"):
        select_for_extraction(ds, ["train"], None, -1)


def test_select_offset_cuts_a_source_into_parts():
    ds = load_conversations(DataConfig(name="g", source="gsm8k"))
    whole = list(select_for_extraction(ds, ["train", "validation"], None)["id"])
    first = list(select_for_extraction(ds, ["train", "validation"], 500)["id"])
    rest = list(select_for_extraction(ds, ["train", "validation"], None, 500)["id"])
    assert first + rest == whole and len(first) == 500 and len(whole) > 1200
    assert list(select_for_extraction(ds, ["train", "validation"], 3, 498)["id"]) == whole[498:501]
    assert len(select_for_extraction(ds, ["train"], None, 10_000)) == 0


def test_jsonl_user_file(tmp_path):
    p = tmp_path / "chats.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"id": "mine", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
    ]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    ds = load_conversations(DataConfig(name="c", source="jsonl", path=str(p)))
    assert ds["id"] == ["chats-1", "mine"]
    assert ds[1]["messages"][0] == {"role": "system", "content": "s"}


@pytest.mark.parametrize(
    "bad, match",
    [
        ('{"messages": [{"role": "user", "content": "x"}', "chats.jsonl:2: not valid JSON"),
        ('{"messages": []}', "chats.jsonl:2: the conversation is empty"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "chats.jsonl:2: .*no user turn"),
        ('{"text": "no messages"}', "chats.jsonl:2: expected an object"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path, bad, match):
    p = tmp_path / "chats.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "ok"}]}) + "\n" + bad + "\n")
    with pytest.raises(Eagle3Error, match=match):
        load_conversations(DataConfig(name="c", source="jsonl", path=str(p)))


def test_missing_path_and_unknown_source():
    with pytest.raises(Eagle3Error, match="data.path"):
        load_conversations(DataConfig(name="c", source="jsonl"))
    with pytest.raises(Eagle3Error, match="unknown"):
        load_conversations(DataConfig(name="c", source="alpaca"))


def test_benchmarks():
    g = load_benchmark("gsm8k", BenchmarksConfig(limit=None))
    assert len(g) == 1319 and g[0]["messages"][0]["content"].startswith("Janet")
    h = load_benchmark("humaneval", BenchmarksConfig(limit=3))
    assert h["id"] == ["humaneval-HumanEval/0", "humaneval-HumanEval/1", "humaneval-HumanEval/2"]
    assert "def has_close_elements" in h[0]["messages"][0]["content"]
    with pytest.raises(Eagle3Error, match="mtbench_path"):
        load_benchmark("mtbench", BenchmarksConfig())
    with pytest.raises(Eagle3Error, match="unknown"):
        load_benchmark("mmlu", BenchmarksConfig())


def test_mtbench(tmp_path):
    path = MTBENCH
    if not path.is_file():
        path = tmp_path / "q.jsonl"
        path.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["a", "b"]}) + "\n")
    m = load_benchmark("mtbench", BenchmarksConfig(mtbench_path=str(path)))
    assert m[0]["id"] == "mtbench-81" and m[0]["category"] == "writing"
    assert [x["role"] for x in m[0]["messages"]] == ["user", "user"]


def test_sharegpt_benchmark_is_the_test_split_and_refuses_leaks():
    cfg = BenchmarksConfig(limit=20)
    sg = load_benchmark("sharegpt", cfg)
    assert len(sg) == 20
    assert all(split_of(i, 0, 0.02, 0.05) == "test" for i in sg["id"])
    assert all(m[-1]["role"] == "user" for m in sg["messages"])
    manifest = {"metadata": {"data": {"source": "sharegpt", "seed": 0, "fractions": {"validation": 0.02, "test": 0.05}}},
                "plan": [["sharegpt-other", "train"]], "splits": {"train": ["sharegpt-other"]}}
    assert load_benchmark("sharegpt", cfg, manifest)["id"] == sg["id"]
    leaked = dict(manifest, plan=[[sg["id"][3], "train"]])
    with pytest.raises(Eagle3Error, match="used in training"):
        load_benchmark("sharegpt", cfg, leaked)


def test_gsm8k_benchmark_leaves_out_what_was_trained_on():
    # a drafter trained on data=gsm8k features (train + validation splits) is evaluated on
    # the rest: exactly the ids whose split (sha256 of seed:id) is test
    ds = load_conversations(DataConfig(name="gsm8k", source="gsm8k"))
    splits = {s: [i for i, sp in zip(ds["id"], ds["split"]) if sp == s] for s in ("train", "validation", "test")}
    manifest = {"plan": [[i, "train"] for i in splits["train"][:10]], "splits": splits}
    g = load_benchmark("gsm8k", BenchmarksConfig(limit=None), manifest)
    expected = [f"gsm8k-{k}" for k in range(1319) if split_of(f"gsm8k-{k}", 0, 0.02, 0.05) == "test"]
    assert g["id"] == expected and 40 < len(expected) < 100
    # a manifest of other data leaves every GSM8K prompt in
    other = {"plan": [["sharegpt-x", "train"]], "splits": {"train": ["sharegpt-x"]}}
    assert len(load_benchmark("gsm8k", BenchmarksConfig(limit=None), other)) == 1319
    assert load_benchmark("gsm8k", BenchmarksConfig(limit=5), manifest)["id"] == expected[:5]
    # what the report says a row was scored on: the trained ids left out, the rest before the limit
    counts = {}
    load_benchmark("gsm8k", BenchmarksConfig(limit=5), manifest, counts)
    assert counts == {"left_out": len(splits["train"]) + len(splits["validation"]), "held_out": len(expected)}
    assert counts["left_out"] + counts["held_out"] == 1319


def test_load_benchmarks_reports_prompts_left_out_as_trained_on():
    # half of HumanEval trained on (extract.py data=humaneval data.test_fraction=0.5), GSM8K not
    from types import SimpleNamespace

    from eagle3.evaluate.benchmarks import load_benchmarks

    ds = load_conversations(DataConfig(name="humaneval", source="humaneval", test_fraction=0.5))
    trained = [i for i, sp in zip(ds["id"], ds["split"]) if sp != "test"]
    manifest = {"plan": [[i, "train"] for i in trained], "splits": {"train": trained}}
    left_out = {}
    out = load_benchmarks(SimpleNamespace(data=BenchmarksConfig(limit=7)), ["humaneval", "gsm8k"], manifest, left_out)
    assert left_out == {"humaneval": {"left_out": len(trained), "held_out": 164 - len(trained)}}
    assert 60 < len(trained) < 104 and len(out["humaneval"]) == 7 and not set(out["humaneval"]["id"]) & set(trained)
    assert len(out["gsm8k"]) == 7


def _bad_utf8(path, first: bytes, second_head: bytes):
    """Write ``first`` then a line ``second_head + b"\\xff..."``; return the bad byte's offset."""
    path.write_bytes(first + second_head + b'\xff\xfe"]}\n')
    return len(first) + len(second_head)


@pytest.mark.parametrize(
    "source, name, first, head",
    [
        ("jsonl", "chats.jsonl", b'{"messages": [{"role": "user", "content": "ok"}]}\n',
         b'{"messages": [{"role": "user", "content": "caf'),
        ("sharegpt_json", "sg.json", b'[{"id": "a", "conversations": [{"from": "human", "value": "hi"}]},\n',
         b'{"id": "b", "conversations": [{"from": "human", "value": "caf'),
        ("mtbench", "question.jsonl", b'{"question_id": 1, "category": "x", "turns": ["a"]}\n',
         b'{"question_id": 2, "category": "x", "turns": ["caf'),
    ],
)
def test_a_prompt_file_that_is_not_utf8_names_file_line_and_byte(tmp_path, source, name, first, head):
    p = tmp_path / name
    offset = _bad_utf8(p, first, head)
    col = len(head) + 1
    expected = (f"{p}:2: byte 0xff at byte offset {offset} (column {col} of line 2) is not valid UTF-8; "
                "save the file as UTF-8 or fix that line")
    with pytest.raises(Eagle3Error) as e:
        load_conversations(DataConfig(name="c", source=source, path=str(p)))
    assert str(e.value) == expected
    if source == "mtbench":  # the MT-Bench benchmark reads the same file
        with pytest.raises(Eagle3Error) as e:
            load_benchmark("mtbench", BenchmarksConfig(mtbench_path=str(p)))
        assert str(e.value) == expected


def test_a_gzipped_jsonl_that_is_not_utf8_names_the_line(tmp_path):
    import gzip

    p = tmp_path / "chats.jsonl.gz"
    first = b'{"messages": [{"role": "user", "content": "ok"}]}\r\n\r\n'  # CRLF line ends count as in text mode
    head = b'{"messages": [{"role": "user", "content": "'
    with gzip.open(p, "wb") as fh:
        fh.write(first + head + b'\xc3"}]}\n')  # a lead byte without its continuation
    with pytest.raises(Eagle3Error, match=rf"chats.jsonl.gz:3: byte 0xc3 at byte offset {len(first) + len(head)} "):
        load_conversations(DataConfig(name="c", source="jsonl", path=str(p)))
    with gzip.open(p, "wb") as fh:  # a valid one reads as before
        fh.write(first + '{"messages": [{"role": "user", "content": "caf\u00e9"}]}\n'.encode())
    ds = load_conversations(DataConfig(name="c", source="jsonl", path=str(p)))
    assert ds["id"] == ["chats.jsonl-1", "chats.jsonl-3"] and ds[1]["messages"][0]["content"] == "caf\u00e9"


@pytest.mark.parametrize(
    "source, text, expected",
    [
        ("jsonl", "", '{p} is empty; give one {{"messages": [...]}} object per line'),
        ("jsonl", "\n  \n\n", '{p} holds only blank lines; give one {{"messages": [...]}} object per line'),
        ("mtbench", "", "{p} is empty; give one MT-Bench question (question_id, category, turns) per line"),
        ("sharegpt_json", "", "{p} is empty; give a JSON array of ShareGPT conversations"),
        ("sharegpt_json", " [ ]\n", "{p} holds an empty JSON array; give at least one ShareGPT conversation"),
        ("sharegpt_json", '[{"id": "a", "conversations": [{"from": "human", "val',
         "{p}: its first record is not valid JSON (cut off or malformed); fix the file"),
        ("sharegpt_json", json.dumps([
            {"id": "a", "conversations": [{"from": "gpt", "value": "x"}]},
            {"id": "b", "conversations": [{"from": "gpt", "value": "y"}, {"from": "gpt", "value": "z"}]},
            {"id": "c", "conversations": []},
        ]), "{p} holds no usable conversation: none of its 3 records qualifies (2 have no human turn, "
            "1 have an empty conversation); give each conversation a human turn"),
    ],
)
def test_a_prompt_file_without_a_usable_conversation_says_so(tmp_path, source, text, expected):
    p = tmp_path / "prompts.data"
    p.write_text(text)
    with pytest.raises(Eagle3Error) as e:
        load_conversations(DataConfig(name="c", source=source, path=str(p)))
    assert str(e.value) == expected.format(p=p)


def test_prompt_datasets_are_fingerprinted_from_their_rows_not_by_pickling(tmp_path, monkeypatch):
    """datasets' own fingerprint pickles the arrow table with dill, which fails under Python
    3.12 with pyarrow 26 ("Can't pickle <class 'MonthDayNano'>"); the prompt datasets carry a
    sha256 of their rows instead, so that pickling path is never taken."""
    import hashlib

    import datasets.arrow_dataset

    def refuse(*a, **k):
        raise AssertionError("datasets' dill fingerprint was computed")

    monkeypatch.setattr(datasets.arrow_dataset, "generate_fingerprint", refuse)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    cfg = DataConfig(source="jsonl", path=str(path), validation_fraction=0.0, test_fraction=0.0)
    ds = load_conversations(cfg)
    rows = {"id": ["a"], "messages": [[{"role": "user", "content": "hi"}]], "split": ["train"]}
    blob = json.dumps(rows, sort_keys=True, ensure_ascii=False).encode()
    assert ds._fingerprint == hashlib.sha256(blob).hexdigest()[:16]
    assert ds.to_dict() == rows
    assert len(select_for_extraction(ds, ["train"], 1)) == 1
    b = load_benchmark("humaneval", BenchmarksConfig(limit=2))
    assert len(b) == 2 and b[0]["messages"][0]["role"] == "user"


def _damaged_middle(tmp_path):
    good = [{"id": k, "conversations": [{"from": "human", "value": f"q{k}"}]} for k in "abc"]
    text = "[" + json.dumps(good[0]) + ',\n{"id": "x", "conversations": [{"from": "human" "value": "no colon"}]},\n' \
        + ",\n".join(json.dumps(r) for r in good[1:]) + "]"
    p = tmp_path / "mid.json"
    p.write_text(text)
    return p


def test_a_damaged_record_in_the_middle_of_a_sharegpt_file_is_refused_or_skipped_and_counted(tmp_path):
    p = _damaged_middle(tmp_path)
    with pytest.raises(Eagle3Error, match=r"mid.json: record 2 \(at character \d+\) is not valid JSON .*"
                                          r"data.on_bad_record=skip"):
        load_conversations(DataConfig(name="x", source="sharegpt_json", path=str(p)))
    stats = {}
    ds = load_conversations(DataConfig(name="x", source="sharegpt_json", path=str(p), on_bad_record="skip"), stats)
    assert ds["id"] == ["sharegpt-a", "sharegpt-b", "sharegpt-c"]  # read on after the damaged record
    assert stats["records"] == 3 and stats["skipped_bad_records"] == 1 and "incomplete_records" not in stats
    with pytest.raises(Eagle3Error, match="data.on_bad_record='maybe' must be 'error'"):
        load_conversations(DataConfig(name="x", source="sharegpt_json", path=str(p), on_bad_record="maybe"))


def test_a_bad_jsonl_line_is_refused_or_skipped_and_the_summary_says_what_was_not_used(tmp_path):
    from eagle3.extract.summary import data_line

    p = tmp_path / "p.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "a"}]}\n{"messages": [\n'
                 '{"messages": [{"role": "user", "content": "b"}]}\n')
    with pytest.raises(Eagle3Error, match=r"p.jsonl:2: not valid JSON .*data.on_bad_record=skip"):
        load_conversations(DataConfig(name="x", source="jsonl", path=str(p)))
    stats = {}
    ds = load_conversations(DataConfig(name="x", source="jsonl", path=str(p), on_bad_record="skip"), stats)
    assert len(ds) == 2 and stats["records"] == 2 and stats["skipped_bad_records"] == 1
    assert data_line(stats) == "  prompt source: 2 records read, 2 conversations usable; not used: 1 damaged, skipped"
    # the shipped ShareGPT file's counts, as load_conversations gives them
    shipped = {"records": 17671, "conversations": 17397, "started_at_first_user": 6222, "dropped_no_user": 148,
               "dropped_empty": 126, "incomplete_records": 1}
    assert data_line(shipped) == ("  prompt source: 17671 records read, 17397 conversations usable (6222 of them opened "
                                  "with gpt turns and start at their first human turn); not used: 148 no human turn, "
                                  "126 empty, 1 cut off at the end of the file")
    assert data_line({"conversations": 164}) is None  # a benchmark source counts no records


def test_every_record_of_the_shipped_sharegpt_file_is_used_or_counted_with_its_reason():
    stats = {}
    ds = load_conversations(DataConfig(name="sharegpt", source="sharegpt"), stats)
    dropped = sum(v for k, v in stats.items() if k.startswith("dropped_"))
    assert stats["records"] == len(ds) + dropped  # decoded records: used or dropped for a stated reason
    assert stats.get("skipped_bad_records", 0) == 0 and stats["incomplete_records"] == 1  # only its cut-off tail
