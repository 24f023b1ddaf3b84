"""The evaluate stage's prompts from a ``data=`` choice: ``evaluate.py data=jsonl data.path=FILE``
(and sharegpt_json, mtbench, the packaged sources) composes, names its benchmark, reads the
file with extraction's readers and their errors, and leaves out what the drafter trained on."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3.config import BenchmarksConfig, DataConfig
from eagle3.errors import Eagle3Error
from eagle3.evaluate.benchmarks import benchmark_names, load_benchmarks
from eagle3.prompts import load_conversations

CONF = Path(__file__).resolve().parents[1] / "conf"
CHATS = [
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
                  {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]},
    {"id": "b", "messages": [{"role": "user", "content": "q3"}]},
    {"id": "c", "messages": [{"role": "user", "content": "q4"}, {"role": "assistant", "content": "a4"}]},
]


def _compose(config: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from eagle3.cli import to_typed

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_typed(compose(config_name=config, overrides=overrides))


@pytest.fixture
def chats(tmp_path):
    p = tmp_path / "my_chats.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in CHATS))
    return p


def _file(path, **kw) -> BenchmarksConfig:
    return BenchmarksConfig(name=kw.pop("name", "jsonl"), source=kw.pop("source", "jsonl"), path=str(path), **kw)


def test_data_jsonl_composes_for_evaluate_and_names_the_benchmark_after_the_file(chats):
    cfg = _compose("evaluate", ["engine=vllm", "data=jsonl", f"data.path={chats}"])
    assert (cfg.data.source, cfg.data.path, cfg.data.on_bad_record) == ("jsonl", str(chats), "error")
    assert benchmark_names(cfg.data) == ["my_chats"]
    assert benchmark_names(_compose("evaluate", ["data=jsonl", f"data.path={chats}", "data.name=mine"]).data) == ["mine"]
    assert benchmark_names(_compose("evaluate", ["data=gsm8k"]).data) == ["gsm8k"]
    assert benchmark_names(_compose("evaluate", []).data) == ["gsm8k", "humaneval", "sharegpt"]  # no data= choice
    # the same conf/data files still give extraction and training their full source settings
    x = _compose("extract", ["data=jsonl", f"data.path={chats}"])
    assert isinstance(x.data, DataConfig) and (x.data.test_fraction, x.data.splits) == (0.05, ["train", "validation"])


def test_an_extraction_only_data_setting_is_refused_on_the_evaluate_command_line():
    from eagle3.cli import unknown_override_key
    from eagle3.config import EvaluateConfig

    msg = unknown_override_key(["data=jsonl", "data.validation_fraction=0"], EvaluateConfig, ["engine", "model", "data"])
    assert msg.startswith("'data.validation_fraction' is not a setting of this stage")


def test_a_prompt_file_gives_system_and_user_turns_in_file_order(chats):
    (ds,) = load_benchmarks(SimpleNamespace(data=_file(chats)), ["my_chats"], None).values()
    assert ds["id"] == ["my_chats-1", "b", "c"]  # ids as extraction reads them (file stem and line)
    assert ds[0]["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"},
                                 {"role": "user", "content": "q2"}]  # the file's answers are not used
    assert ds[2]["messages"] == [{"role": "user", "content": "q4"}]
    assert ds["category"] == ["", "", ""]
    limited = load_benchmarks(SimpleNamespace(data=_file(chats, limit=2)), ["my_chats"], None)["my_chats"]
    assert limited["id"] == ["my_chats-1", "b"]


def test_prompts_the_drafter_trained_on_are_left_out_and_counted(chats):
    manifest = {"plan": [["b", "train"]], "splits": {"validation": ["my_chats-1"]}}
    left_out: dict = {}
    out = load_benchmarks(SimpleNamespace(data=_file(chats)), ["my_chats"], manifest, left_out)
    assert out["my_chats"]["id"] == ["c"] and left_out == {"my_chats": {"left_out": 2, "held_out": 1}}
    everything = {"plan": [["my_chats-1", "train"], ["b", "train"], ["c", "train"]]}
    with pytest.raises(Eagle3Error, match="benchmark my_chats has no prompts left.*every prompt of .*my_chats.jsonl"):
        load_benchmarks(SimpleNamespace(data=_file(chats)), ["my_chats"], everything)


def test_a_missing_or_damaged_file_gives_extractions_own_error(tmp_path, chats):
    def both(path, **kw):
        """The error evaluation gives, and the one extraction's reader gives for the same file."""
        errs = []
        for read in (lambda: load_benchmarks(SimpleNamespace(data=_file(path, **kw)), ["x"], None),
                     lambda: load_conversations(DataConfig(name="jsonl", source="jsonl", path=str(path), **kw))):
            with pytest.raises(Eagle3Error) as e:
                read()
            errs.append(str(e.value))
        return errs

    missing = both(tmp_path / "nope.jsonl")
    assert missing[0] == missing[1] == f"data.path '{tmp_path / 'nope.jsonl'}' does not exist; give an existing file"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(CHATS[1]) + "\n" + '{"messages": [{"role": "user"\n')
    damaged = both(bad)
    assert damaged[0] == damaged[1] and damaged[0].startswith(f"{bad}:2: not valid JSON")
    no_user = tmp_path / "no_user.jsonl"
    no_user.write_text(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
    assert both(no_user)[0].startswith(f"{no_user}:1: the conversation has no user turn")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert both(empty)[0] == f'{empty} holds only blank lines; give one {{"messages": [...]}} object per line'
    skipped = load_benchmarks(SimpleNamespace(data=_file(bad, on_bad_record="skip")), ["bad"], None)["bad"]
    assert skipped["id"] == ["b"]


def test_a_sharegpt_json_file_and_mtbench_from_data_path(tmp_path):
    sg = tmp_path / "conv.json"
    sg.write_text(json.dumps([{"id": "k", "conversations": [{"from": "system", "value": "s"},
                                                           {"from": "human", "value": "h1"},
                                                           {"from": "gpt", "value": "g1"}]}]))
    cfg = _file(sg, name="sharegpt_json", source="sharegpt_json")
    assert benchmark_names(cfg) == ["conv"]
    ds = load_benchmarks(SimpleNamespace(data=cfg), ["conv"], None)["conv"]
    assert ds["id"] == ["sharegpt-k"]
    assert ds[0]["messages"] == [{"role": "system", "content": "s"}, {"role": "user", "content": "h1"}]
    q = tmp_path / "question.jsonl"
    q.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["t1", "t2"]}) + "\n")
    mt = _file(q, name="mtbench", source="mtbench")
    assert benchmark_names(mt) == ["mtbench"]
    m = load_benchmarks(SimpleNamespace(data=mt), ["mtbench"], None)["mtbench"]
    assert m["id"] == ["mtbench-81"] and m["category"] == ["writing"] and len(m[0]["messages"]) == 2
    with pytest.raises(Eagle3Error, match=r"^data.path '.*nope.jsonl' does not exist; give the MT-Bench question.jsonl"):
        load_benchmarks(SimpleNamespace(data=_file(tmp_path / "nope.jsonl", name="mtbench", source="mtbench")),
                        ["mtbench"], None)


@pytest.mark.parametrize("cfg, match", [
    (BenchmarksConfig(name="jsonl", source="jsonl"), r"^data=jsonl needs its file: give data.path="),
    (BenchmarksConfig(path="x.jsonl"), r"^data.path=x.jsonl is read with a data= choice; add data=jsonl"),
    (BenchmarksConfig(name="gsm8k", source="gsm8k", path="x.jsonl"), "reads its packaged prompts and no data.path"),
    (BenchmarksConfig(name="jsonl", source="jsonl", path="x.jsonl", mtbench_path="q.jsonl"), "drop data.mtbench_path"),
    (BenchmarksConfig(name="jsonl", source="jsonl", path="dir/gsm8k.jsonl"), "'gsm8k' is a built-in benchmark's"),
    (BenchmarksConfig(name="my chats", source="jsonl", path="x.jsonl"), "'my chats' .* use letters, digits"),
    (BenchmarksConfig(name="alpaca", source="alpaca", path="x.jsonl"), "data.source 'alpaca' cannot be evaluated"),
    (BenchmarksConfig(name="jsonl", source="jsonl", path="x.jsonl", limit=0), "data.limit=0 must be a positive"),
])
def test_settings_that_cannot_work_are_refused_before_any_file_is_read(cfg, match):
    with pytest.raises(Eagle3Error, match=match):
        benchmark_names(cfg)


def test_a_gzipped_file_is_named_without_its_suffixes():
    assert benchmark_names(BenchmarksConfig(name="jsonl", source="jsonl", path="d/chats.v2.jsonl.gz")) == ["chats.v2"]


def test_resume_keys_change_when_a_prompts_text_changes_under_the_same_id(tmp_path, chats):
    from eagle3.evaluate.inprocess.resume import benchmark_keys
    from eagle3.spec import SpecSettings

    settings, _ = SpecSettings.make(3, 1, 4, 0.0, 1.0, 16)
    cfg = SimpleNamespace(engine=SimpleNamespace(attn_implementation="sdpa"), seed=0, max_prompt_tokens=64)

    def key():
        ds = load_benchmarks(SimpleNamespace(data=_file(chats)), ["my_chats"], None)
        return benchmark_keys(cfg, settings, "h", "torch.float32", "cpu", tmp_path, ds)["my_chats"]

    before = key()
    assert key() == before
    chats.write_text(chats.read_text().replace('"q3"', '"q3, reworded"'))  # line 2 keeps its id "b"
    assert key() != before
