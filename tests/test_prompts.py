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
    assert stats["dropped_no_leading_user"] == 1 and stats["dropped_empty"] == 1 and stats["dropped_unknown_role"] == 1
    assert ds["id"] == ["sharegpt-a", "sharegpt-d", "sharegpt-a#1"]
    assert ds[0]["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    # roles mapped, consecutive human turns merged, system kept
    assert ds[1]["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1\n\nq2"},
        {"role": "assistant", "content": "ans"},
    ]
    assert set(ds["split"]) <= {"train", "validation", "test"}


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
    assert stats["conversations"] == len(ds) > 11000
    assert len(set(ds["id"])) == len(ds)
    c = Counter(ds["split"])
    assert abs(c["test"] / len(ds) - cfg.test_fraction) < 0.01
    assert abs(c["validation"] / len(ds) - cfg.validation_fraction) < 0.01
    assert all(m[0]["role"] in ("user", "system") for m in ds["messages"][:500])
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
