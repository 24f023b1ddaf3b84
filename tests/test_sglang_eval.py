"""SGLang evaluation against two loopback SGLang-shaped servers (baseline, speculative).

Acceptance numbers are recomputed from what the fake speculative server was asked
(its recorded prompts) and its closed-form behaviour (response_length, spec_passes),
not from the module's own summaries.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import eagle3  # noqa: F401
from eagle3.config import BenchmarksConfig, EvaluateConfig, ModelConfig, SGLangEngineConfig, SpeculativeConfig
from eagle3.errors import Eagle3Error
from eagle3.evaluate.sglang import evaluation as se
from eagle3.evaluate.measures import RequestRecord, padded_histogram, percentiles_ms
from eagle3.evaluate.sglang.results import PLOT_NAME, REQUESTS_NAME
from eagle3.evaluate.sglang.servers import cap_warnings

sys.path.insert(0, str(Path(__file__).parent))
from fake_sglang import FakeConfig, FakeSGLang, response_length, spec_passes, write_tiny_chat_tokenizer  # noqa: E402
from loopback_http import QuietHandler, serve  # noqa: E402

V = 512
PATTERN = [2, 0, 3, 1]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_tiny_chat_tokenizer(tmp_path_factory.mktemp("tok") / "tiny", V)


@pytest.fixture
def servers():
    made = []

    def make(**kw) -> FakeSGLang:
        s = FakeSGLang(FakeConfig(hidden_size=4, vocab_size=V, **kw))
        s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def benchmarks():
    from datasets import Dataset

    gsm = Dataset.from_list([{"id": f"g{i}", "messages": [{"role": "user", "content": f"w{10 + i} w{20 + 3 * i} w7"}]}
                             for i in range(6)])
    mt = Dataset.from_list([{"id": f"m{i}", "messages": [{"role": "user", "content": f"w{30 + i} w9"},
                                                         {"role": "user", "content": f"w{40 + i}"}]} for i in range(3)])
    return {"gsm8k": gsm, "mtbench": mt}


def make_cfg(tokenizer_dir, base_url, spec_url, concurrency=(1, 4), **engine_kw) -> EvaluateConfig:
    model = ModelConfig(name="fake-target", source="org/fake-target", architecture="llama", num_layers=8,
                        hidden_size=4, vocab_size=V, tokenizer=tokenizer_dir)
    engine = SGLangEngineConfig(baseline_url=base_url, speculative_url=spec_url, max_retries=3, backoff_s=0.001,
                                connect_timeout_s=2.0, request_timeout_s=10.0, **engine_kw)
    return EvaluateConfig(model=model, engine=engine, data=BenchmarksConfig(), speculative=SpeculativeConfig(3, 1, 4),
                          max_new_tokens=16, warmup_prompts=1, concurrency=list(concurrency))


def test_sweep_reports_tau_throughput_and_plot(tokenizer_dir, servers, tmp_path):
    # steps long enough that a loaded machine's scheduling noise cannot hide the 2x fewer passes
    base = servers(speculative=False, step_s=0.04, prefill_s=0.002)
    spec = servers(speculative=True, accept_pattern=PATTERN, step_s=0.04, prefill_s=0.002)
    cfg = make_cfg(tokenizer_dir, base.url, spec.url)
    res = se.run_sglang_evaluation(cfg, benchmarks(), {"aux_layer_ids": [2, 4, 5]}, tmp_path)

    assert res["engine"] == "sglang" and res["warnings"] == []
    # one warm-up conversation, then 6 single-turn + 3 two-turn prompts twice: the
    # interleaved batch-1 pairs (which are also the sweep's c=1 row), then the sweep at c=4
    measured = [b for b in spec.requests if b.get("stream")]
    assert len(measured) == 1 + 2 * (6 + 3 * 2)
    assert len([b for b in base.requests if b.get("stream")]) == 1 + 2 * (6 + 3 * 2)
    # mt-bench: the second turn carries the first (prompt + answer) in front of it
    firsts = {tuple(b["input_ids"]) for b in measured}
    seconds = [b["input_ids"] for b in measured if any(tuple(b["input_ids"][:len(f)]) == f and len(f) < len(b["input_ids"]) for f in firsts)]
    assert len(seconds) >= 3

    for name, turns in (("gsm8k", 6), ("mtbench", 6)):
        r = res["benchmarks"][name]
        for key in ("acceptance_length", "acceptance_rate", "verify_passes", "generated_tokens", "per_position_acceptance",
                    "tokens_per_s_spec", "tokens_per_s_base", "speedup", "lossless_matches", "diversity", "concurrency"):
            assert key in r, key
        # both fakes answer the same greedy ids: every prompt is lossless
        assert r["lossless_matches"] == r["lossless_checked"] == r["num_prompts"] and r["requests"] == turns
        assert len(r["per_position_acceptance"]) == 3 and len(r["accept_histogram"]) == 4
        assert [row["concurrency"] for row in r["concurrency"]] == [1, 4]
        assert r["speedup"] == pytest.approx(r["tokens_per_s_spec"] / r["tokens_per_s_base"])
        # the speculative fake needs fewer steps for every prompt: the interval lies above 1
        lo, hi = r["speedup_interval"]
        assert 1.0 < lo <= r["speedup"] <= hi and r["speedup_significant"] is True
        assert r["measured_at_concurrency"] == 1

    # the headline (interleaved pairs, right after the warm-up) and the sweep's c=1 row see
    # the same deterministic counters; recomputed independently from the fake's rules
    gsm_pairs = measured[1:1 + 6]
    toks = passes = 0
    for b in gsm_pairs:
        n = min(response_length(b["input_ids"]), 16)
        toks += n
        passes += len(spec_passes(n - 1, PATTERN))  # the first token comes from the prefill
    assert res["benchmarks"]["gsm8k"]["acceptance_length"] == pytest.approx(toks / passes)
    at_c1 = measured[1:1 + 12]  # the c=1 row of the sweep is the interleaved pairs
    toks = passes = 0
    hist = [0, 0, 0, 0]
    for b in at_c1:
        n = min(response_length(b["input_ids"]), 16)
        ps = spec_passes(n - 1, PATTERN)
        toks += n
        passes += len(ps)
        for a in ps:
            hist[a] += 1
    pooled = res["concurrency"][0]["speculative"]
    assert pooled["output_tokens"] == toks
    assert pooled["verify_passes"] == passes
    assert pooled["acceptance_length"] == pytest.approx(toks / passes)
    assert pooled["acceptance_length_verify_only"] == pytest.approx((toks - 12) / passes)
    assert pooled["acceptance_rate"] == pytest.approx(sum(a * h for a, h in enumerate(hist)) / (passes * 3))
    total = sum(hist)
    assert pooled["per_position_acceptance"] == pytest.approx([(hist[1] + hist[2] + hist[3]) / total,
                                                               (hist[2] + hist[3]) / total, hist[3] / total])
    # the speculative fake needs fewer steps per token: it must come out faster
    assert res["concurrency"][0]["speedup"] > 1.2
    png = tmp_path / PLOT_NAME
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = [json.loads(x) for x in (tmp_path / REQUESTS_NAME).read_text().splitlines()]
    assert len(lines) == 2 * 12 + 2 * 12  # the pairs (both roles), then the c=4 sweep (both roles)
    assert sum(x["phase"] == "interleaved" for x in lines) == 2 * 12
    assert res["servers"]["speculative"]["effective"]["speculative_algorithm"] == "EAGLE3"


def test_silent_cap_is_warned_and_visible(tokenizer_dir, servers, tmp_path):
    base = servers(speculative=False, step_s=0.002)
    spec = servers(speculative=True, effective_max_running_requests=2, step_s=0.002)
    cfg = make_cfg(tokenizer_dir, base.url, spec.url, concurrency=(1, 4))
    res = se.run_sglang_evaluation(cfg, {"gsm8k": benchmarks()["gsm8k"]}, {}, tmp_path)
    assert any("admits at most 2 running requests" in w and "[4]" in w for w in res["warnings"])
    assert spec.max_seen_running <= 2 and base.max_seen_running > 2
    assert res["servers"]["speculative"]["effective"]["effective_max_running_requests"] == 2


def test_missing_spec_verify_ct_gives_no_tau_and_a_warning(tokenizer_dir, servers, tmp_path):
    base = servers(speculative=False)
    spec = servers(speculative=True, missing_spec_verify_ct=True, avg_spec_accept_length=1.7)
    cfg = make_cfg(tokenizer_dir, base.url, spec.url, concurrency=(2,))
    res = se.run_sglang_evaluation(cfg, {"gsm8k": benchmarks()["gsm8k"]}, {}, tmp_path)
    assert res["benchmarks"]["gsm8k"]["acceptance_length"] is None
    assert any("spec_verify_ct" in w for w in res["warnings"])
    assert res["servers"]["speculative"]["avg_spec_accept_length_after_run"] == [1.7]


def test_servers_in_the_wrong_mode_are_refused(tokenizer_dir, servers, tmp_path):
    plain = servers(speculative=False)
    spec = servers(speculative=True)
    with pytest.raises(Eagle3Error, match="baseline server .* runs speculative decoding"):
        se.run_sglang_evaluation(make_cfg(tokenizer_dir, spec.url, spec.url), benchmarks(), {}, tmp_path)
    with pytest.raises(Eagle3Error, match="--speculative-algorithm EAGLE3"):
        se.run_sglang_evaluation(make_cfg(tokenizer_dir, plain.url, plain.url), benchmarks(), {}, tmp_path)


def test_served_drafter_must_match_the_evaluated_one(tokenizer_dir, servers, tmp_path):
    draft = tmp_path / "served"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}))
    base = servers(speculative=False)
    spec = servers(speculative=True, draft_model_path=str(draft))
    with pytest.raises(Eagle3Error, match=r"aux layers \[2, 4, 5\] but .* trained on \[2, 3, 5\]"):
        se.run_sglang_evaluation(make_cfg(tokenizer_dir, base.url, spec.url), benchmarks(), {"aux_layer_ids": [2, 3, 5]}, tmp_path)


def test_no_servers_and_no_sglang(tokenizer_dir, tmp_path):
    cfg = make_cfg(tokenizer_dir, None, None)
    cfg.engine.python = sys.executable
    with pytest.raises(Eagle3Error) as e:
        se.run_sglang_evaluation(cfg, benchmarks(), {}, tmp_path)
    assert "engine.baseline_url=http://HOST:PORT engine.speculative_url=http://HOST:PORT" in str(e.value)


def test_measure_helpers_by_hand():
    p = percentiles_ms([0.001, 0.002, 0.003, 0.004])
    assert p["mean"] == pytest.approx(2.5) and p["p50"] == pytest.approx(2.5) and p["p90"] == pytest.approx(3.7)
    assert padded_histogram([5, 3], 3) == [5, 3, 0, 0] and padded_histogram([5, 3, 2, 1], 3) == [5, 3, 2, 1]
    r = RequestRecord("b", "s", 0, 10, 5, ttft_s=0.1, latency_s=0.5, output_ids=[])
    assert r.tpot_s == pytest.approx(0.1)
    assert cap_warnings("speculative", {"max_running_requests": 48, "effective_max_running_requests": 48,
                                        "cuda_graph_max_bs": 48}, [1, 32, 64, 128])[0].count("[64, 128]") == 1


def test_evaluate_stage_end_to_end_writes_the_hf_report_files(tokenizer_dir, servers, tmp_path):
    """``python evaluate.py model=kimi-k25-int4 engine=sglang engine.baseline_url=...
    engine.speculative_url=...`` against two loopback servers (Kimi sizes shrunk)."""
    import torch
    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer

    from eagle3.target import chat_template_hash
    from eagle3.cli import to_typed
    from eagle3.model.drafter import DrafterArch, Eagle3Drafter
    from eagle3.evaluate.run import run_evaluate
    from eagle3.export import export_sglang

    export = tmp_path / "export" / "sglang"
    arch = DrafterArch(hidden_size=4, num_attention_heads=2, num_key_value_heads=2, head_dim=4, intermediate_size=8,
                       num_layers=1, target_hidden_size=4, vocab_size=V, draft_vocab_size=64)
    torch.manual_seed(0)
    meta = {"aux_layer_ids": [2, 30, 58], "target": {"name": "kimi-k25-int4", "architecture": "deepseek_v2"},
            "chat_template_hash": chat_template_hash(AutoTokenizer.from_pretrained(tokenizer_dir))}
    export_sglang(Eagle3Drafter(arch), export, meta)
    base = servers(speculative=False, step_s=0.002)
    spec = servers(speculative=True, draft_model_path=str(export), step_s=0.002)
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = to_typed(compose(config_name="evaluate", overrides=[
            "model=kimi-k25-int4", "engine=sglang", f"engine.baseline_url={base.url}", f"engine.speculative_url={spec.url}",
            f"model.tokenizer={tokenizer_dir}", "model.hidden_size=4", f"model.vocab_size={V}", f"drafter_dir={export}",
            "data.names=[gsm8k]", "data.limit=3", "concurrency=[1,2]", "max_new_tokens=8", f"output_dir={tmp_path / 'eval'}",
        ]))
    res = run_evaluate(cfg)
    out = tmp_path / "eval"
    for f in ("report.json", "report.md", "metrics.json", "per_position_acceptance.png", "acceptance_length.png",
              PLOT_NAME, REQUESTS_NAME):
        assert (out / f).is_file(), f
    rep = json.loads((out / "report.json").read_text())
    g = rep["benchmarks"]["gsm8k"]
    assert g["num_prompts"] == 3 and "verdict" in g and [r["concurrency"] for r in g["concurrency"]] == [1, 2]
    assert rep["engine"] == "sglang" and res["plots"]["throughput_vs_concurrency"] == PLOT_NAME
    assert "Throughput versus concurrency" in (out / "report.md").read_text()


def test_servers_are_launched_when_no_urls(tokenizer_dir, tmp_path, monkeypatch):
    """No URLs: the baseline (on engine.port) and the speculative server (on port + 1,
    with the drafter export and the configured 3/1/4) are launched through
    ``sglang.launch_server``, here as CPU servers (the flags the CPU build runs with)."""
    from fake_sglang import write_launch_shim

    monkeypatch.setenv("PYTHONPATH", write_launch_shim(tmp_path / "shim"))
    monkeypatch.setenv("FAKE_SGLANG_VOCAB", str(V))
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}))
    from eagle3.engines.sglang import free_port

    cfg = make_cfg(tokenizer_dir, None, None, concurrency=(2,))
    cfg.engine.python = sys.executable
    cfg.engine.port = free_port(count=2)  # baseline on port, speculative on port + 1
    cfg.engine.health_poll_s = 0.1
    cfg.engine.device = "cpu"
    cfg.drafter_dir = str(export)
    res = se.run_sglang_evaluation(cfg, {"gsm8k": benchmarks()["gsm8k"]}, {"aux_layer_ids": [2, 4, 5]}, tmp_path / "out")
    base_cmd = (tmp_path / "out" / "sglang-baseline.cmd").read_text()
    spec_cmd = (tmp_path / "out" / "sglang-speculative.cmd").read_text()
    assert "--speculative-algorithm" not in base_cmd and "--max-running-requests 128" in base_cmd
    assert f"--port {cfg.engine.port} " in base_cmd and f"--port {cfg.engine.port + 1} " in spec_cmd
    assert f"--speculative-draft-model-path {export.resolve()}" in spec_cmd
    assert "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in spec_cmd
    for cmd in (base_cmd, spec_cmd):
        assert "--device cpu --disable-overlap-schedule --max-total-tokens 8192 --mem-fraction-static 0.5" in cmd
        assert "--cuda-graph" not in cmd
    assert res["benchmarks"]["gsm8k"]["lossless_matches"] == 6
    assert res["benchmarks"]["gsm8k"]["acceptance_length"] > 1
    assert res["servers"]["speculative"]["effective"]["max_running_requests"] == 128


@pytest.mark.parametrize("setting", ["url", "urls"])
def test_engine_url_is_refused_in_served_evaluation(tokenizer_dir, servers, tmp_path, setting):
    """``engine.url`` / ``engine.urls`` name extraction's capture servers: served evaluation refuses
    them rather than ignore them (and launch servers of its own)."""
    spec = servers(speculative=True)
    cfg = make_cfg(tokenizer_dir, None, None)
    cfg.engine.python = sys.executable
    setattr(cfg.engine, setting, spec.url if setting == "url" else [spec.url])
    given = f"engine.url={spec.url}" if setting == "url" else f"engine.urls=[{spec.url}]"
    with pytest.raises(Eagle3Error) as e:
        se.run_sglang_evaluation(cfg, benchmarks(), {}, tmp_path)
    assert str(e.value) == (
        f"served evaluation does not read engine.url / engine.urls ({given}), which name extraction's capture "
        "servers; pass engine.baseline_url=http://HOST:PORT (the target without a drafter) and "
        "engine.speculative_url=http://HOST:PORT (the target serving the drafter) instead")
    assert spec.requests == []  # refused before any request


def test_engine_url_on_the_evaluate_command_line_is_refused(tokenizer_dir, servers, tmp_path):
    """``python evaluate.py model=kimi-k25-int4 engine=sglang engine.url=...``: refused in one sentence."""
    import torch
    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer

    from eagle3.cli import to_typed
    from eagle3.evaluate.run import run_evaluate
    from eagle3.export import export_sglang
    from eagle3.target import chat_template_hash
    from eagle3.model.drafter import DrafterArch, Eagle3Drafter

    export = tmp_path / "export" / "sglang"
    arch = DrafterArch(hidden_size=4, num_attention_heads=2, num_key_value_heads=2, head_dim=4, intermediate_size=8,
                       num_layers=1, target_hidden_size=4, vocab_size=V, draft_vocab_size=64)
    torch.manual_seed(0)
    export_sglang(Eagle3Drafter(arch), export, {
        "aux_layer_ids": [2, 30, 58], "target": {"name": "kimi-k25-int4", "architecture": "deepseek_v2"},
        "chat_template_hash": chat_template_hash(AutoTokenizer.from_pretrained(tokenizer_dir))})
    spec = servers(speculative=True)
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = to_typed(compose(config_name="evaluate", overrides=[
            "model=kimi-k25-int4", "engine=sglang", f"engine.url={spec.url}", f"engine.python={sys.executable}",
            f"model.tokenizer={tokenizer_dir}", "model.hidden_size=4", f"model.vocab_size={V}", f"drafter_dir={export}",
            "data.names=[gsm8k]", "data.limit=3", "concurrency=[1]", "max_new_tokens=8", f"output_dir={tmp_path / 'eval'}",
        ]))
    with pytest.raises(Eagle3Error, match=r"^served evaluation does not read engine.url / engine.urls \(engine.url="):
        run_evaluate(cfg)
    assert spec.requests == [] and not (tmp_path / "eval" / "report.json").exists()


def test_unreachable_servers_name_the_setting_used(tokenizer_dir, servers, tmp_path):
    from eagle3.engines.sglang import free_port

    closed = f"http://127.0.0.1:{free_port()}"
    base, spec = servers(speculative=False), servers(speculative=True)
    for base_url, spec_url, setting, at in ((closed, spec.url, "engine.baseline_url", closed),
                                            (base.url, closed, "engine.speculative_url", closed)):
        cfg = make_cfg(tokenizer_dir, base_url, spec_url, concurrency=(1,))
        cfg.engine.connect_timeout_s = 0.2
        with pytest.raises(Eagle3Error) as e:
            se.run_sglang_evaluation(cfg, {"gsm8k": benchmarks()["gsm8k"]}, {}, tmp_path)
        assert str(e.value) == f"no healthy SGLang server answers at {at}/health; start one (docs/sglang.md) or fix {setting}"


def test_served_drafter_with_a_damaged_config_is_one_sentence(tokenizer_dir, servers, tmp_path):
    draft = tmp_path / "served"
    draft.mkdir()
    (draft / "config.json").write_text('{"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3')
    base, spec = servers(speculative=False), servers(speculative=True, draft_model_path=str(draft))
    with pytest.raises(Eagle3Error) as e:
        se.run_sglang_evaluation(make_cfg(tokenizer_dir, base.url, spec.url), benchmarks(), {"aux_layer_ids": [2, 4, 5]},
                                 tmp_path)
    assert str(e.value).startswith(f"{draft}/config.json is not valid JSON (") and "\n" not in str(e.value)


def _rec(sample_id: str, tokens: int, seconds: float, ids=None, turn: int = 0) -> RequestRecord:
    return RequestRecord(benchmark="b", sample_id=sample_id, turn=turn, prompt_tokens=5, completion_tokens=tokens,
                         ttft_s=seconds / 10, latency_s=seconds, output_ids=list(ids if ids is not None else range(tokens)))


def test_paired_speedup_and_its_bootstrap_interval_by_hand():
    from eagle3.evaluate.turns import paired_speedup

    # every prompt runs exactly twice as fast with speculation: every resample gives 2
    pairs = [([_rec("a", 10, 1.0)], [_rec("a", 10, 0.5)]), ([_rec("b", 20, 4.0)], [_rec("b", 20, 2.0)])]
    r = paired_speedup(pairs, resamples=500, seed=3)
    assert r["tokens_per_s_base"] == pytest.approx(30 / 5.0) and r["tokens_per_s_spec"] == pytest.approx(30 / 2.5)
    assert r["speedup"] == pytest.approx(2.0) and r["interval"] == pytest.approx([2.0, 2.0]) and r["significant"]
    # one prompt twice as slow, one twice as fast: pooled 1.0; resamples of one prompt only give 0.5 or 2
    pairs = [([_rec("a", 10, 1.0)], [_rec("a", 10, 2.0)]), ([_rec("b", 10, 2.0)], [_rec("b", 10, 1.0)])]
    r = paired_speedup(pairs, resamples=4000, seed=0)
    assert r["speedup"] == pytest.approx(1.0)
    assert r["interval"] == pytest.approx([0.5, 2.0]) and r["significant"] is False
    # one prompt: a ratio, no interval
    r = paired_speedup(pairs[:1])
    assert r["speedup"] == pytest.approx(0.5) and r["interval"] is None and r["significant"] is None


def test_tau_interval_over_prompts_by_hand_and_against_a_plain_bootstrap():
    import numpy as np

    from eagle3.evaluate.measures import pooled_ratio_interval

    # every prompt at tau 3: every resample gives 3
    assert pooled_ratio_interval([[30, 10], [60, 20]], resamples=300) == pytest.approx([3.0, 3.0])
    # two prompts at tau 1 and 4 with equal passes: resamples are {1}, {4} or both (pooled 2.5)
    assert pooled_ratio_interval([[10, 10], [40, 10]], resamples=4000) == pytest.approx([1.0, 4.0])
    # fewer than two prompts, or no verify pass at all: no interval
    assert pooled_ratio_interval([[30, 10]]) is None and pooled_ratio_interval([[0, 0], [0, 0]]) is None
    # the same as a bootstrap written out loop by loop, with the same draws
    rng = np.random.default_rng(7)
    rows = np.column_stack([rng.integers(50, 300, 25), rng.integers(20, 100, 25)]).astype(float)
    draws = np.random.default_rng(11).integers(0, 25, size=(1000, 25))
    ref = [rows[d, 0].sum() / rows[d, 1].sum() for d in draws]
    want = [float(np.quantile(ref, 0.025)), float(np.quantile(ref, 0.975))]
    got = pooled_ratio_interval(rows, resamples=1000, seed=11)
    assert got == pytest.approx(want)
    point = rows[:, 0].sum() / rows[:, 1].sum()
    assert got[0] < point < got[1]


def test_inprocess_summary_gives_tau_an_interval_over_prompts():
    from eagle3.evaluate.inprocess.records import TurnRecord, summarize_benchmark
    from eagle3.spec import SpecSettings

    def rec(sid, turn, emitted, passes):
        # accept counts: emitted - passes accepted drafts spread over the passes (num_steps 3)
        acc = [min(3, max(0, emitted - passes - 3 * i)) for i in range(passes)]
        toks = list(range(emitted + 1))  # the prefill token and the emitted ones
        return TurnRecord("b", sid, turn, 10, toks, toks, 1.0, 2.0, 0.1, 0.1, passes, emitted, acc)

    st = SpecSettings(num_steps=3, topk=1, num_draft_tokens=4)
    # prompt a: two turns (tau 2 and 4, pooled 3); prompt b: tau 1. Resamples: a,a -> 3; b,b -> 1; a,b -> 2
    out = summarize_benchmark([rec("a", 0, 10, 5), rec("a", 1, 20, 5), rec("b", 0, 10, 10)], st)
    assert out["acceptance_length"] == pytest.approx(40 / 20)
    assert out["acceptance_length_interval"] == pytest.approx([1.0, 3.0])
    one = summarize_benchmark([rec("a", 0, 10, 5)], st)
    assert one["acceptance_length_interval"] is None


def test_lossless_check_names_the_first_differing_position():
    from eagle3.evaluate.turns import lossless_check

    same = ([_rec("a", 3, 1.0, [5, 6, 7])], [_rec("a", 3, 1.0, [5, 6, 7])])
    differs = ([_rec("b", 3, 1.0, [5, 6, 7]), _rec("b", 2, 1.0, [1, 2], turn=1)],
               [_rec("b", 3, 1.0, [5, 6, 7]), _rec("b", 2, 1.0, [1, 9], turn=1)])
    prefix = ([_rec("c", 3, 1.0, [5, 6, 7])], [_rec("c", 2, 1.0, [5, 6])])
    r = lossless_check([same, differs, prefix])
    assert r["matches"] == 1 and r["checked"] == 3
    assert [(m["sample_id"], m["turn"], m["first_diff"]) for m in r["mismatches"]] == [("b", 1, 1), ("c", 0, 2)]
    # every differing turn is listed; a prompt is a near tie only when all of them are ties
    two = ([_rec("d", 3, 1.0, [5, 6, 7]), _rec("d", 2, 1.0, [1, 2], turn=1)],
           [_rec("d", 3, 1.0, [5, 9, 7]), _rec("d", 2, 1.0, [1, 9], turn=1)])
    two[0][0].diagnosis = {"logit_gap": 0.125, "tie": True}
    two[0][1].diagnosis = {"logit_gap": 3.0, "tie": False}
    r = lossless_check([two])
    assert [(m["turn"], m["first_diff"], m["tie"]) for m in r["mismatches"]] == [(0, 1, True), (1, 1, False)]
    assert (r["matches"], r["near_ties"]) == (0, 0)
    two[0][1].diagnosis = {"logit_gap": 0.25, "tie": True}
    assert lossless_check([two])["near_ties"] == 1


def test_interleaving_alternates_which_server_goes_first(tokenizer_dir):
    from transformers import AutoTokenizer

    from eagle3.engines.sglang import StreamResult
    from eagle3.evaluate.sglang.sweeps import interleave_batch1

    order = []

    class Client:
        def __init__(self, role):
            self.role = role

        def generate_stream(self, body):
            order.append(self.role)
            return StreamResult(0.01, 0.1, [7, 2], {"completion_tokens": 2})

        def flush_cache(self):
            return True

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = {"x": [{"id": f"p{i}", "messages": [{"role": "user", "content": "w9"}]} for i in range(3)],
            "y": [{"id": "q", "messages": [{"role": "user", "content": "w8"}]}]}
    out = interleave_batch1({"baseline": Client("baseline"), "speculative": Client("speculative")}, tok, rows,
                            {"max_new_tokens": 4}, warmup=1)
    assert order[:2] == ["baseline", "speculative"]  # one warm-up each
    b, s = "baseline", "speculative"
    assert order[2:] == [b, s, s, b, b, s, s, b]
    assert [len(v) for v in out.values()] == [3, 1] and out["y"][0][0][0].sample_id == "q"


def test_servers_measured_in_turn_still_give_lossless_and_a_paired_speedup(tokenizer_dir, servers, tmp_path):
    """launch_together=false (launching on GPUs the two servers share): no interleaved
    phase; the pairs are the two servers' concurrency-1 runs."""
    base = servers(speculative=False, step_s=0.01)
    spec = servers(speculative=True, accept_pattern=PATTERN, step_s=0.01)
    cfg = make_cfg(tokenizer_dir, base.url, spec.url, concurrency=(1, 2), launch_together=False)
    res = se.run_sglang_evaluation(cfg, {"gsm8k": benchmarks()["gsm8k"]}, {}, tmp_path)
    assert len([b for b in spec.requests if b.get("stream")]) == 1 + 2 * 6  # warm-up, c=1, c=2: no pairs phase
    r = res["benchmarks"]["gsm8k"]
    assert r["lossless_matches"] == 6 and r["measured"].startswith("batch 1, the baseline's run")
    assert r["speedup"] == pytest.approx(r["tokens_per_s_spec"] / r["tokens_per_s_base"]) and r["speedup_interval"]


@pytest.mark.parametrize("together", [True, False])
def test_turns_longer_than_the_servers_context_less_the_reply_are_skipped_and_counted(tokenizer_dir, servers,
                                                                                        tmp_path, together):
    """A prompt longer than context_length - max_new_tokens is never sent (SGLang would refuse it
    or shorten its reply); a conversation whose later turn grows past the limit keeps its
    earlier turns; both are counted in the warnings. Both servers up at once, and one after
    the other."""
    from datasets import Dataset

    from eagle3.target import render_prompt
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    gsm_rows = [{"id": f"g{i}", "messages": [{"role": "user", "content": " ".join(f"w{10 + k}" for k in range(i))}]}
                for i in range(1, 7)]
    lens = [len(render_prompt(tok, r["messages"])) for r in gsm_rows]
    assert lens == sorted(lens) and len(set(lens)) == 6
    mt_rows = [{"id": "m0", "messages": [{"role": "user", "content": "w30"}, {"role": "user", "content": "w40 w41"}]}]
    max_new = 16
    ctx = lens[2] + max_new  # prompts 0..2 fit with room for the whole reply; 3..5 do not
    base = servers(speculative=False, context_length=ctx)
    spec = servers(speculative=True, accept_pattern=PATTERN, context_length=ctx)
    cfg = make_cfg(tokenizer_dir, base.url, spec.url, concurrency=(1, 2), launch_together=together)
    res = se.run_sglang_evaluation(cfg, {"gsm8k": Dataset.from_list(gsm_rows), "mtbench": Dataset.from_list(mt_rows)},
                                   {"aux_layer_ids": [2, 4, 5]}, tmp_path)
    why = f"the servers' context_length {ctx} less max_new_tokens {max_new}"
    skipped = f"gsm8k: 3 prompts longer than {lens[2]} tokens ({why}) were skipped"
    assert sum(w.endswith(skipped) for w in res["warnings"]) == (1 if together else 2)  # in turn: once per server
    sent = [b["input_ids"] for s in (base, spec) for b in s.requests if b.get("stream")]
    assert sent and max(len(ids) for ids in sent) <= lens[2]  # nothing too long reached a server
    gsm = res["benchmarks"]["gsm8k"]
    assert gsm["requests"] == 3 and gsm["lossless_checked"] == 3
    # mt-bench: the first turn fits; the second carries the first answer (16 tokens) and does not
    mt = res["benchmarks"]["mtbench"]
    assert mt["requests"] == 1
    assert any("mtbench: 1 conversations reached a turn longer than" in w for w in res["warnings"])


def test_no_prompt_short_enough_for_the_servers_is_one_sentence(tokenizer_dir, servers, tmp_path):
    base = servers(speculative=False, context_length=20)
    spec = servers(speculative=True, context_length=20)
    cfg = make_cfg(tokenizer_dir, base.url, spec.url, concurrency=(1,))
    with pytest.raises(Eagle3Error, match="no benchmark prompt is 4 tokens or shorter .*context_length 20 less "
                                          "max_new_tokens 16.*raise the servers' engine.context_length"):
        se.run_sglang_evaluation(cfg, benchmarks(), {}, tmp_path)
    assert not [b for s in (base, spec) for b in s.requests if b.get("stream")]


class _TopLogprobs(QuietHandler):
    """Answers SGLang's ``/generate`` with ``meta_info.output_top_logprobs`` in its shape
    (``[[[logprob, token_id, text] x k]]``): token 6 at -0.70, token 9 at -0.82, 4 at -3.0;
    ``mode`` "refuse" answers 400, "garbled" a top list of bare numbers."""

    bodies: list = []
    mode = "ok"

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if type(self).mode == "refuse":
            return self.send_text(json.dumps({"error": {"message": "top_logprobs_num is not supported"}}), 400)
        top = [[-0.70, 6, "a"], [-0.82, 9, "b"], [-3.0, 4, "c"]] if type(self).mode == "ok" else [1.0, 2.0]
        self.send_text(json.dumps({"text": "a", "output_ids": [6],
                                   "meta_info": {"completion_tokens": 1, "output_top_logprobs": [top]}}))


@pytest.mark.parametrize("mode", ["ok", "refuse", "garbled"])
def test_sglang_near_tie_test_measures_the_gap_and_never_ends_an_evaluation(tokenizer_dir, mode):
    """The SGLang path's diagnosis on a loopback server: the gap between the two tokens'
    log-probs (0.12 a tie, 2.30 not); a refused request or an unreadable answer leaves the
    mismatch a changed output with the reason, and the served run warns."""
    from transformers import AutoTokenizer

    from eagle3.engines.sglang import SGLangClient
    from eagle3.evaluate.sglang.evaluation import _diagnose
    from eagle3.target import render_prompt

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = {"b": [{"id": "t", "messages": [{"role": "user", "content": "hi"}]},
                  {"id": "w", "messages": [{"role": "user", "content": "yo"}]}]}
    paired = {"b": [([_rec("t", 3, 1.0, [5, 6, 7])], [_rec("t", 3, 1.0, [5, 9, 7])]),    # 6 vs 9
                    ([_rec("w", 3, 1.0, [5, 6, 7])], [_rec("w", 3, 1.0, [5, 4, 7])])]}   # 6 vs 4
    _TopLogprobs.bodies, _TopLogprobs.mode = [], mode
    with serve(_TopLogprobs) as url:
        warnings = _diagnose(SGLangClient(url, max_retries=0), tok, rows, paired)
    t, w = (p[0][0].diagnosis for p in paired["b"])
    if mode == "ok":
        assert t["logit_gap"] == pytest.approx(0.12) and t["tie"] is True
        assert w["logit_gap"] == pytest.approx(2.30) and w["tie"] is False
        assert warnings == []
        # the request: the turn's prompt, then the baseline's output before the first difference
        assert [b["input_ids"] for b in _TopLogprobs.bodies] == [
            render_prompt(tok, rows["b"][0]["messages"]) + [5], render_prompt(tok, rows["b"][1]["messages"]) + [5]]
    else:
        assert t == w == {"logit_gap": None, "tie": False}
        assert len(warnings) == 1 and warnings[0].startswith("the near-tie test of 2 greedy mismatches failed")
        assert ("top_logprobs_num=20 failed" if mode == "refuse" else "cannot be read") in warnings[0]
