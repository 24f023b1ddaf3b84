"""Served evaluation (engine=sglang, engine=vllm) of a user's own prompt file, against loopback
servers: ``python evaluate.py engine=... data=jsonl data.path=FILE`` sends exactly the file's
prompts, each prompt once per role at batch 1 (the batch-1 pairs are the sweep's
concurrency-1 row, not sent again) and once per other concurrency.

The expected prompt ids are written out by hand from the tiny tokenizer's rules (word
``w<i>`` is id ``i``; ChatML: ``<|im_start|>`` 1, ``<|im_end|>`` 2, user 3, assistant 4,
system 5) and the fakes' closed-form replies, not rendered by the code under test.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fake_sglang import FakeConfig, FakeSGLang, greedy_reply, write_tiny_chat_tokenizer  # noqa: E402
from fake_vllm import FakeVLLM, reply  # noqa: E402

V = 512
MAX_NEW = 8
ROLE_ID = {"user": 3, "assistant": 4, "system": 5}
PROMPTS = [  # one with a system message, one plain, one of two user turns (its assistant turn is not used)
    {"id": "sys", "messages": [{"role": "system", "content": "w11 w12"}, {"role": "user", "content": "w20 w21 w22"}]},
    {"messages": [{"role": "user", "content": "w30 w31"}]},
    {"id": "two", "messages": [{"role": "user", "content": "w40"}, {"role": "assistant", "content": "w99 w98"},
                               {"role": "user", "content": "w41 w42"}]},
]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_tiny_chat_tokenizer(tmp_path_factory.mktemp("tok") / "tiny", V)


@pytest.fixture
def prompt_file(tmp_path):
    p = tmp_path / "chats.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in PROMPTS))
    return p


def _ids(messages: list[dict]) -> list[int]:
    """The tiny ChatML template by hand: ``<|im_start|> role words <|im_end|>`` per message,
    then the generation prompt ``<|im_start|> assistant``."""
    out = []
    for m in messages:
        out += [1, ROLE_ID[m["role"]]] + [int(w[1:]) for w in m["content"].split()] + [2]
    return out + [1, 4]


def _text(ids: list[int]) -> str:
    """A reply's ids as the tokenizer decodes them without special tokens (0-2)."""
    names = {3: "user", 4: "assistant", 5: "system"}
    return " ".join(names.get(i, f"w{i}") for i in ids if i > 2)


def expected_prompts(answer) -> list[tuple[int, ...]]:
    """Every turn prompt of :data:`PROMPTS` as the servers must receive it: system messages
    first, user turns in order, a later turn carrying the server's answer to the earlier
    one (``answer(prompt ids) -> reply ids``), never the file's assistant text."""
    out = []
    for p in PROMPTS:
        history = [m for m in p["messages"] if m["role"] == "system"]
        for m in (m for m in p["messages"] if m["role"] == "user"):
            history.append(m)
            ids = _ids(history)
            out.append(tuple(ids))
            history.append({"role": "assistant", "content": _text(answer(ids))})
    return out


def _export(tmp_path, tokenizer_dir, kind: str) -> Path:
    from transformers import AutoTokenizer

    from eagle3.export import export_sglang, export_vllm
    from eagle3.target import chat_template_hash
    from eagle3.model.drafter import DrafterArch, Eagle3Drafter

    arch = DrafterArch(hidden_size=4, num_attention_heads=2, num_key_value_heads=2, head_dim=4, intermediate_size=8,
                       num_layers=1, target_hidden_size=4, vocab_size=V, draft_vocab_size=64)
    torch.manual_seed(0)
    meta = {"aux_layer_ids": [2, 30, 58], "target": {"name": "kimi-k25-int4", "architecture": "deepseek_v2"},
            "chat_template_hash": chat_template_hash(AutoTokenizer.from_pretrained(tokenizer_dir))}
    write = export_sglang if kind == "sglang" else export_vllm
    return write(Eagle3Drafter(arch), tmp_path / "export" / kind, meta)


def _evaluate(overrides: list[str]) -> dict:
    """``python evaluate.py OVERRIDES`` in this process (Hydra compose, then the stage)."""
    from hydra import compose, initialize_config_dir

    from eagle3.cli import to_typed
    from eagle3.evaluate.run import run_evaluate

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = to_typed(compose(config_name="evaluate", overrides=overrides))
    return run_evaluate(cfg)


def _common(tokenizer_dir, export: Path, prompt_file: Path, out: Path) -> list[str]:
    return ["model=kimi-k25-int4", f"model.tokenizer={tokenizer_dir}", "model.hidden_size=4", f"model.vocab_size={V}",
            f"drafter_dir={export}", "data=jsonl", f"data.path={prompt_file}", "concurrency=[1,2]",
            f"max_new_tokens={MAX_NEW}", "warmup_prompts=0", f"output_dir={out}"]


def test_sglang_evaluates_exactly_the_prompt_file_each_turn_once_per_concurrency(tokenizer_dir, prompt_file,
                                                                                 tmp_path):
    export = _export(tmp_path, tokenizer_dir, "sglang")
    base = FakeSGLang(FakeConfig(hidden_size=4, vocab_size=V, speculative=False))
    spec = FakeSGLang(FakeConfig(hidden_size=4, vocab_size=V, speculative=True, draft_model_path=str(export)))
    base.start(), spec.start()
    try:
        res = _evaluate(["engine=sglang", f"engine.baseline_url={base.url}", f"engine.speculative_url={spec.url}",
                         "engine.backoff_s=0.001"] + _common(tokenizer_dir, export, prompt_file, tmp_path / "eval"))
    finally:
        base.stop(), spec.stop()
    assert list(res["benchmarks"]) == ["chats"]  # named after the file
    assert res["settings"]["prompt_file"] == str(prompt_file)
    want = expected_prompts(lambda ids: greedy_reply(ids, V, 2, MAX_NEW)[0])
    assert len(want) == 4  # 1 + 1 + 2 turns
    for server in (base, spec):
        sent = [tuple(b["input_ids"]) for b in server.requests if b.get("stream")]
        # once in the interleaved batch-1 pairs (which are the c=1 row), once at c=2
        assert Counter(sent) == {p: 2 for p in want}
        assert Counter(sent[:4]) == {p: 1 for p in want}  # the batch-1 pairs come first
    b = res["benchmarks"]["chats"]
    assert b["num_prompts"] == 3 and b["lossless_matches"] == b["lossless_checked"] == 3
    assert [r["concurrency"] for r in b["concurrency"]] == [1, 2]


def test_vllm_evaluates_exactly_the_prompt_file_each_turn_once_per_concurrency(tokenizer_dir, prompt_file, tmp_path):
    export = _export(tmp_path, tokenizer_dir, "vllm")
    base, spec = FakeVLLM(False, vocab=V), FakeVLLM(True, str(export), vocab=V)
    base.start(), spec.start()
    try:
        res = _evaluate(["engine=vllm", f"engine.baseline_url={base.url}", f"engine.speculative_url={spec.url}",
                         "engine.backoff_s=0.001", "data.name=mine"]
                        + _common(tokenizer_dir, export, prompt_file, tmp_path / "eval"))
    finally:
        base.stop(), spec.stop()
    assert list(res["benchmarks"]) == ["mine"]  # data.name names it
    want = expected_prompts(lambda ids: reply(ids, MAX_NEW, V))
    for server in (base, spec):
        kinds = [e[0] for e in server.events]
        first_reset = kinds.index("reset")
        assert kinds.count("reset") == 1  # one sweep run (c=2); concurrency 1 is not run again
        batch1 = [tuple(e[1]) for e in server.events[:first_reset]]
        swept = [tuple(e[1]) for e in server.events[first_reset + 1:] if e[0] == "complete"]
        assert Counter(batch1) == {p: 1 for p in want}  # every turn once at batch 1 per role
        assert Counter(swept) == {p: 1 for p in want}
        assert all(e[2] for e in server.events if e[0] == "complete")  # no near-tie requests: outputs agree
    b = res["benchmarks"]["mine"]
    assert b["lossless_matches"] == b["lossless_checked"]
    rows = {r["concurrency"]: r for r in b["concurrency"]}
    # the c=1 row is the pairs: the speculative answers' tokens, recomputed from the fake's rule
    assert rows[1]["speculative"]["output_tokens"] == sum(len(reply(list(p), MAX_NEW, V)) for p in want)
    log = [json.loads(x) for x in (tmp_path / "eval" / "vllm_requests.jsonl").read_text().splitlines()]
    assert sum(x["phase"] == "batch1" for x in log) == 2 * len(want)
    assert {x["concurrency"]: x["from_batch1_pairs"] for x in log if x["phase"] == "sweep"} == {1: True, 2: False}


def test_a_missing_or_damaged_prompt_file_stops_a_served_run_before_any_request(tokenizer_dir, tmp_path):
    from eagle3.errors import Eagle3Error

    export = _export(tmp_path, tokenizer_dir, "vllm")
    base, spec = FakeVLLM(False, vocab=V), FakeVLLM(True, str(export), vocab=V)
    base.start(), spec.start()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PROMPTS[1]) + "\n" + '{"messages": [\n')
    try:
        urls = ["engine=vllm", f"engine.baseline_url={base.url}", f"engine.speculative_url={spec.url}"]
        with pytest.raises(Eagle3Error, match="data.path '.*missing.jsonl' does not exist; give an existing file"):
            _evaluate(urls + _common(tokenizer_dir, export, tmp_path / "missing.jsonl", tmp_path / "e1"))
        with pytest.raises(Eagle3Error, match=r"bad.jsonl:2: not valid JSON .*data.on_bad_record=skip"):
            _evaluate(urls + _common(tokenizer_dir, export, bad, tmp_path / "e2"))
    finally:
        base.stop(), spec.stop()
    assert base.events == [] and spec.events == []
