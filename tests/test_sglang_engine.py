"""The sglang engine against a loopback SGLang-shaped server (tests/fake_sglang.py).

Expected values are recomputed from the fake's closed-form "model" (aux_value,
topk_after, greedy_reply), so a wrong position shift, reshape or stop-token rule fails.
"""

from __future__ import annotations

import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

import eagle3  # noqa: F401
from eagle3.config import ModelConfig, SamplingConfig, SGLangEngineConfig
from eagle3.engines import sglang as sg
from eagle3.errors import Eagle3Error

sys.path.insert(0, str(Path(__file__).parent))
from fake_sglang import FakeConfig, FakeSGLang, aux_value, greedy_reply, topk_after, write_launch_shim, write_tiny_chat_tokenizer  # noqa: E402

H, V = 8, 512


def model_cfg(**kw) -> ModelConfig:
    base = dict(name="fake-target", source="org/fake-target", architecture="llama", num_layers=8,
                hidden_size=H, vocab_size=V)
    base.update(kw)
    return ModelConfig(**base)


def engine_cfg(**kw) -> SGLangEngineConfig:
    base = dict(max_retries=6, backoff_s=0.001, request_timeout_s=10.0, concurrency=4, capture_concurrency=3,
                connect_timeout_s=3.0, health_poll_s=0.1)
    base.update(kw)
    return SGLangEngineConfig(**base)


@pytest.fixture
def fake():
    servers = []

    def make(**kw) -> FakeSGLang:
        s = FakeSGLang(FakeConfig(hidden_size=H, vocab_size=V, **kw))
        s.start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()


def seqs(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def expected_capture(seq: list[int], k: int):
    T = len(seq)
    aux = torch.tensor([[[aux_value(seq[t], t, j, c) for c in range(H)] for j in range(3)] for t in range(T)])
    ids = torch.tensor([[tid for _, tid in topk_after(seq[t], k, V)] for t in range(T)], dtype=torch.int32)
    lps = torch.tensor([[lp for lp, _ in topk_after(seq[t], k, V)] for t in range(T)], dtype=torch.float32)
    return aux, ids, lps


# ------------------------------------------------------------------ capture
def test_capture_matches_fake_model_with_next_token_shift(fake):
    srv = fake()
    eng = sg.SGLangEngine.from_config(model_cfg(), engine_cfg(url=srv.url), "unused-cache", "unused-run")
    batch = seqs(7) + [[5]]
    caps = eng.capture(batch, top_k=4)
    assert len(caps) == len(batch)
    for seq, cap in zip(batch, caps):
        aux, ids, lps = expected_capture(seq, 4)
        assert cap.aux_hidden_states.dtype == torch.bfloat16 and cap.aux_hidden_states.shape == (len(seq), 3, H)
        assert torch.equal(cap.aux_hidden_states.float(), aux)  # exact: values are bf16-representable
        # position t holds the distribution of token t+1, i.e. the one after token t
        assert cap.topk_ids.dtype == torch.int32 and torch.equal(cap.topk_ids, ids)
        assert cap.topk_logprobs.dtype == torch.float32 and torch.allclose(cap.topk_logprobs, lps)
    body = srv.requests[0]
    assert body["sampling_params"]["max_new_tokens"] == 1 and body["logprob_start_len"] == 0
    assert body["return_hidden_states"] is True and body["return_logprob"] is True and body["top_logprobs_num"] == 4


def test_parse_capture_sorts_topk_and_reads_last_row_from_output():
    # hand-built answer for the 2-token sequence [10, 20], k=2, H=1 (width 3)
    out = {"meta_info": {
        "hidden_states": [[[0.5, -1.0, 2.0], [0.25, 0.0, -0.5]]],
        "input_top_logprobs": [None, [[-2.0, 7, None], [-0.5, 9, None]]],
        "output_top_logprobs": [[[-0.1, 4, None], [-3.0, 5, None]]],
        "cached_tokens": 0,
    }}
    cap = sg.parse_capture(out, [10, 20], hidden_size=1, top_k=2)
    assert cap.aux_hidden_states.float().tolist() == [[[0.5], [-1.0], [2.0]], [[0.25], [0.0], [-0.5]]]
    assert cap.topk_ids.tolist() == [[9, 7], [4, 5]]  # most likely first
    assert cap.topk_logprobs.tolist() == [[-0.5, -2.0], [-0.10000000149011612, -3.0]]


def test_wrong_width_names_the_flag(fake):
    srv = fake(hidden_width=H)  # final hidden states only: not in EAGLE3 mode
    eng = sg.SGLangEngine.from_config(model_cfg(), engine_cfg(url=srv.url), "c", "r")
    with pytest.raises(Eagle3Error, match="width 8, expected 3 x 8 = 24.*--speculative-algorithm EAGLE3"):
        eng.capture([[5, 6, 7]], top_k=2)
    srv2 = fake(hidden_width=30)
    eng2 = sg.SGLangEngine.from_config(model_cfg(), engine_cfg(url=srv2.url), "c", "r")
    with pytest.raises(Eagle3Error, match="width 30.*model.hidden_size"):
        eng2.capture([[5, 6, 7]], top_k=2)


def test_row_count_mismatch_names_chunked_prefill_and_radix_cache(fake):
    srv = fake(chunked_prefill_size=4)
    eng = sg.SGLangEngine([sg.SGLangClient(srv.url)], [{}], engine_cfg(), H, [2, 4, 5])
    with pytest.raises(Eagle3Error, match="3 hidden-state rows for a 7-token.*--chunked-prefill-size -1"):
        eng.capture([[9] * 7], top_k=2)
    srv2 = fake(disable_radix_cache=False)
    eng2 = sg.SGLangEngine([sg.SGLangClient(srv2.url)], [{}], engine_cfg(capture_concurrency=1), H, [2, 4, 5])
    eng2.capture([[9, 8, 7, 6]], top_k=2)
    with pytest.raises(Eagle3Error, match="--disable-radix-cache"):
        eng2.capture([[9, 8, 7, 6, 5]], top_k=2)


def test_connect_refuses_server_not_in_capture_mode(fake):
    srv = fake(speculative=False, enable_return_hidden_states=False, disable_radix_cache=False, chunked_prefill_size=8192)
    with pytest.raises(Eagle3Error) as e:
        sg.SGLangEngine.from_config(model_cfg(), engine_cfg(url=srv.url), "c", "r")
    msg = str(e.value)
    for flag in ("--speculative-algorithm EAGLE3", "--enable-return-hidden-states", "--disable-radix-cache",
                 "--chunked-prefill-size -1"):
        assert flag in msg


def test_connect_checks_the_served_drafters_aux_layers(fake, tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    # llama family: SGLang captures id+1 for every written id; [1, 3, 4] -> HF [2, 4, 5]
    (draft / "config.json").write_text('{"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}')
    srv = fake(draft_model_path=str(draft))
    eng = sg.SGLangEngine.from_config(model_cfg(), engine_cfg(url=srv.url), "c", "r")  # default [2, 4, 5] for 8 layers
    assert eng.aux_layer_ids == [2, 4, 5]
    with pytest.raises(Eagle3Error, match=r"aux layers \[2, 4, 5\].*model.aux_layer_ids is \[2, 3, 5\]"):
        sg.SGLangEngine.from_config(model_cfg(aux_layer_ids=[2, 3, 5]), engine_cfg(url=srv.url), "c", "r")


# ------------------------------------------------------------------ faults
def test_retries_5xx_drops_and_malformed_json_without_losing_or_duplicating(fake):
    srv = fake(fail_5xx=3, drop=2, malformed=2)
    eng = sg.SGLangEngine.from_config(model_cfg(), engine_cfg(url=srv.url), "c", "r")
    batch = seqs(6, seed=1)
    caps = eng.capture(batch, top_k=3)
    for seq, cap in zip(batch, caps):
        aux, ids, _ = expected_capture(seq, 3)
        assert torch.equal(cap.aux_hidden_states.float(), aux) and torch.equal(cap.topk_ids, ids)
    assert srv.n_generate == 6 + 3 + 2 + 2  # every fault cost exactly one extra attempt
    assert sorted(map(tuple, (b["input_ids"] for b in srv.requests))) == sorted(map(tuple, batch))


def test_persistent_failure_is_a_clear_error(fake):
    srv = fake(fail_5xx=1000)
    eng = sg.SGLangEngine([sg.SGLangClient(srv.url, max_retries=2, backoff_s=0.001)], [{}], engine_cfg(), H, [2, 4, 5])
    t0 = time.monotonic()
    with pytest.raises(Eagle3Error, match="failed POST /generate 3 times.*HTTP 503"):
        eng.capture([[1, 2, 3]], top_k=2)
    assert time.monotonic() - t0 < 5


def test_client_error_is_not_retried(fake):
    srv = fake()
    client = sg.SGLangClient(srv.url, max_retries=5, backoff_s=0.001)
    with pytest.raises(Eagle3Error, match="HTTP 400"):
        client.generate({"input_ids": []})
    assert srv.n_generate == 1


# ------------------------------------------------------------------ data parallel
def test_data_parallel_over_urls_each_sample_once(fake):
    a, b = fake(step_s=0.002), fake(step_s=0.002)
    eng = sg.SGLangEngine.from_config(model_cfg(), engine_cfg(urls=[a.url, b.url]), "c", "r")
    batch = seqs(24, seed=2)
    caps = eng.capture(batch, top_k=2)
    for seq, cap in zip(batch, caps):
        assert torch.equal(cap.topk_ids, expected_capture(seq, 2)[1])
    answered = [tuple(r["input_ids"]) for r in a.requests + b.requests]
    assert Counter(answered) == Counter(map(tuple, batch))
    assert a.requests and b.requests  # both servers took work


def test_dead_server_is_dropped_and_its_work_reassigned(fake):
    a, b = fake(), fake()
    eng = sg.SGLangEngine.from_config(model_cfg(), engine_cfg(urls=[a.url, b.url]), "c", "r")
    b.stop()  # dies after the engine connected
    eng.clients[1].max_retries = 1
    batch = seqs(10, seed=3)
    outs = eng.generate(batch, SamplingConfig(max_new_tokens=16))
    assert outs == [greedy_reply(s, V, 2, 16)[0] for s in batch]
    assert Counter(tuple(r["input_ids"]) for r in a.requests) == Counter(map(tuple, batch))


def test_data_parallel_servers_must_match(fake):
    a, b = fake(), fake(max_running_requests=64)
    with pytest.raises(Eagle3Error, match=r"differs from .* in \['max_running_requests'\]"):
        sg.SGLangEngine.from_config(model_cfg(), engine_cfg(urls=[a.url, b.url]), "c", "r")


# ------------------------------------------------------------------ generate
def test_generate_keeps_the_stop_token_and_respects_max_new_tokens(fake):
    srv = fake()
    eng = sg.SGLangEngine.from_config(model_cfg(), engine_cfg(url=srv.url), "c", "r")
    batch = seqs(5, seed=4)
    outs = eng.generate(batch, SamplingConfig(max_new_tokens=64))
    for s, o in zip(batch, outs):
        assert o == greedy_reply(s, V, 2, 64)[0] and o[-1] == 2
    short = eng.generate(batch, SamplingConfig(max_new_tokens=2))
    assert all(len(o) == 2 and 2 not in o for o in short)
    assert srv.requests[0]["sampling_params"] == {"max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0}


def test_stop_token_appended_when_the_server_trims_it():
    out = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "stop", "matched": 2}}}
    assert sg.output_ids_from_response(out) == [5, 6, 2]
    out = {"output_ids": [5, 6, 2], "meta_info": {"finish_reason": {"type": "stop", "matched": 2}}}
    assert sg.output_ids_from_response(out) == [5, 6, 2]
    out = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "stop", "matched": "</s>"}}}
    assert sg.output_ids_from_response(out) == [5, 6]


# ------------------------------------------------------------------ server info / metadata
def test_info_records_version_flags_and_effective_settings(fake):
    srv = fake(launch_command=["python", "-m", "sglang.launch_server", "--model-path", "m", "--host", "0.0.0.0",
                               "--port", "1234", "--max-running-requests", "128"], cuda_graph_max_bs=96)
    eng = sg.SGLangEngine.from_config(model_cfg(), engine_cfg(url=srv.url), "c", "r")
    info = eng.info()
    assert info["name"] == "sglang" and info["server_version"] == "0.5.23"
    assert info["launch_flags"] == ["--model-path", "m", "--max-running-requests", "128"]
    eff = info["effective"]
    assert eff["max_running_requests"] == 128 and eff["cuda_graph_max_bs"] == 96
    assert eff["disable_radix_cache"] is True and eff["chunked_prefill_size"] == -1
    assert eff["speculative_algorithm"] == "EAGLE3" and eff["enable_return_hidden_states"] is True
    assert srv.url not in repr(info)  # nothing that changes between equivalent runs


def test_old_server_info_endpoint_and_effective_cap(fake):
    srv = fake(old_api=True, effective_max_running_requests=48, cuda_graph_max_bs=48)
    client = sg.SGLangClient(srv.url)
    info = client.server_info()  # /server_info is 404 there: falls back to /get_server_info
    eff = sg.effective_settings(info)
    assert eff["cuda_graph_max_bs"] == 48 and eff["effective_max_running_requests"] == 48


def test_connect_waits_for_a_slow_start(fake):
    srv = fake(startup_s=1.0)
    t0 = time.monotonic()
    sg.SGLangEngine.from_config(model_cfg(), engine_cfg(url=srv.url), "c", "r")
    assert time.monotonic() - t0 >= 0.9


def test_connect_to_nothing_fails_fast():
    url = f"http://127.0.0.1:{sg.free_port()}"
    with pytest.raises(Eagle3Error, match="no healthy SGLang server answers at"):
        sg.SGLangEngine.from_config(model_cfg(), engine_cfg(url=url, connect_timeout_s=0.5), "c", "r")


# ------------------------------------------------------------------ no server, no sglang
def test_no_url_and_no_sglang_is_one_clear_sentence(tmp_path):
    cfg = engine_cfg(python=sys.executable)
    with pytest.raises(Eagle3Error) as e:
        sg.SGLangEngine.from_config(model_cfg(), cfg, tmp_path / "cache", tmp_path / "run")
    msg = str(e.value)
    assert "engine.url=http://HOST:PORT" in msg and "not installed" in msg and "\n" not in msg
    assert not (tmp_path / "cache").exists()  # failed before anything expensive


# ------------------------------------------------------------------ launcher
def kimi_model_cfg() -> ModelConfig:
    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="extract", overrides=["model=kimi-k25-int4"])
    from eagle3.cli import to_typed

    typed = to_typed(cfg)
    assert typed.engine.name == "sglang"  # the Kimi model config selects the sglang engine
    return typed.model, typed.engine


def test_kimi_launch_command_has_the_deployment_flags_and_only_verified_ones():
    m, e = kimi_model_cfg()
    spec = dict(sg.CAPTURE_SPEC, draft_model_path="/cache/boot")
    cmd = sg.render_launch_command(m, e, model_path="moonshotai/Kimi-K2.5", port=30000, speculative=spec, capture=True)
    line = shlex.join(cmd)
    assert line.startswith(
        "python -m sglang.launch_server --model-path moonshotai/Kimi-K2.5 --tp 8 --trust-remote-code "
        "--tool-call-parser kimi_k2 --reasoning-parser kimi_k2"
    )
    for piece in ("--host 127.0.0.1", "--port 30000", "--max-running-requests 128", "--cuda-graph-max-bs 128",
                  "--speculative-algorithm EAGLE3", "--speculative-draft-model-path /cache/boot",
                  "--speculative-num-steps 1", "--speculative-eagle-topk 1", "--speculative-num-draft-tokens 2",
                  "--enable-return-hidden-states", "--disable-radix-cache", "--chunked-prefill-size -1"):
        assert f" {piece}" in line, piece
    assert sg.unknown_flags(cmd, set(sg.VERIFIED_FLAGS)) == []  # --tp abbreviates --tp-size only
    newer = sg.render_launch_command(m, e, model_path="x", port=1, cuda_graph_flag_name=sg.cuda_graph_flag({"--cuda-graph-max-bs-decode"}))
    assert "--cuda-graph-max-bs-decode" in newer and "--enable-return-hidden-states" not in newer


def test_capture_mode_refuses_chunked_prefill():
    m, e = kimi_model_cfg()
    e.chunked_prefill_size = 8192
    with pytest.raises(Eagle3Error, match="engine.chunked_prefill_size=-1"):
        sg.render_launch_command(m, e, model_path="x", port=1, speculative=dict(sg.CAPTURE_SPEC, draft_model_path="d"), capture=True)


def test_unknown_flags_respects_argparse_prefixes():
    flags = {"--tp-size", "--port", "--speculative-num-steps", "--speculative-num-draft-tokens"}
    assert sg.unknown_flags(["--tp", "8", "--port=3", "--speculative-num", "--bogus"], flags) == ["--speculative-num", "--bogus"]


@pytest.fixture
def fake_sglang_package(tmp_path, monkeypatch):
    """A ``sglang.launch_server`` module that runs the fake server, on PYTHONPATH."""
    monkeypatch.setenv("PYTHONPATH", write_launch_shim(tmp_path / "shim"))
    monkeypatch.setenv("FAKE_SGLANG_HIDDEN", str(H))
    monkeypatch.setenv("FAKE_SGLANG_VOCAB", str(V))
    return tmp_path


def test_launch_writes_bootstrap_waits_and_captures(fake_sglang_package, monkeypatch):
    tmp = fake_sglang_package
    monkeypatch.setenv("FAKE_SGLANG_STARTUP_S", "0.6")
    port = sg.free_port()
    cfg = engine_cfg(python=sys.executable, port=port, launch_timeout_s=60, device="cuda")
    eng = sg.SGLangEngine.from_config(model_cfg(), cfg, tmp / "cache", tmp / "run")
    try:
        info = eng.info()
        flags = info["launch_flags"]
        assert "--cuda-graph-max-bs-decode" in flags  # the installed server's --help decided the spelling
        assert flags[flags.index("--speculative-draft-model-path") + 1] == eng.bootstrap_dir
        boot = Path(eng.bootstrap_dir)
        import json

        conf = json.loads((boot / "config.json").read_text())
        assert conf["architectures"] == ["LlamaForCausalLMEagle3"]
        assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # HF [2, 4, 5], llama rule
        assert (boot / "model.safetensors").is_file()
        from eagle3.export import load_sglang_export

        drafter, meta = load_sglang_export(boot)  # read back as the server would
        assert meta["aux_layer_ids"] == [2, 4, 5] and drafter.arch.target_hidden_size == H
        log_text = (tmp / "run" / "sglang-capture.log").read_text()
        assert "Load weight step" in log_text and "fired up" in log_text
        assert (tmp / "run" / "sglang-capture.cmd").read_text().strip() == shlex.join(eng.launch_command)
        seq = [4, 9, 33, 7]
        cap = eng.capture([seq], top_k=2)[0]
        assert torch.equal(cap.aux_hidden_states.float(), expected_capture(seq, 2)[0])
        proc = eng.launched[0].proc
    finally:
        eng.close()
    assert proc.poll() is not None  # the server we started is gone


def test_launch_failure_reports_the_log_tail(fake_sglang_package, monkeypatch):
    tmp = fake_sglang_package
    monkeypatch.setenv("FAKE_SGLANG_EXIT", "3")
    cfg = engine_cfg(python=sys.executable, port=sg.free_port(), launch_timeout_s=60)
    with pytest.raises(Eagle3Error, match=r"(?s)exited with code 3.*Not enough memory"):
        sg.SGLangEngine.from_config(model_cfg(), cfg, tmp / "cache", tmp / "run")


def test_launch_timeout_stops_the_server(fake_sglang_package, monkeypatch):
    tmp = fake_sglang_package
    monkeypatch.setenv("FAKE_SGLANG_STARTUP_S", "60")
    cfg = engine_cfg(python=sys.executable, port=sg.free_port(), launch_timeout_s=1.0)
    with pytest.raises(Eagle3Error, match=r"(?s)did not answer .*/health within 1 s.*engine.launch_timeout_s.*Load weight step"):
        sg.SGLangEngine.from_config(model_cfg(), cfg, tmp / "cache", tmp / "run")


def test_launch_refuses_a_flag_the_server_lacks(fake_sglang_package):
    tmp = fake_sglang_package
    cfg = engine_cfg(python=sys.executable, port=sg.free_port(), extra_args=["--enable-bogus-feature"])
    with pytest.raises(Eagle3Error, match=r"does not accept \['--enable-bogus-feature'\]"):
        sg.SGLangEngine.from_config(model_cfg(), cfg, tmp / "cache", tmp / "run")


@pytest.mark.parametrize("tp,family,sglang_ids", [(1, "llama", [2, 3, 4]), (8, "deepseek_v2", [3, 4, 5])])
def test_bootstrap_drafter_has_the_config_and_tensors_sglang_loads(tmp_path, tp, family, sglang_ids):
    """The bootstrap drafter goes through the SGLang exporter: ``LlamaForCausalLMEagle3``
    config fields, and exactly the tensors (names, shapes, dtypes) of SGLang's loader."""
    import json

    from safetensors import safe_open

    dims = {"hidden_size": H, "vocab_size": 5000, "rms_norm_eps": 1e-5, "rope_theta": 5e5,
            "max_position_embeddings": 4096}
    arch = sg.bootstrap_arch(dims, tp)
    boot = sg.write_bootstrap_drafter(tmp_path / "boot", arch, [3, 4, 5], family, {"purpose": "test"})  # HF ids
    nh, hd, inter, Vd = arch["num_attention_heads"], arch["head_dim"], arch["intermediate_size"], sg.BOOTSTRAP_DRAFT_VOCAB
    assert nh % tp == 0 and nh >= 8 and inter % tp == 0 and arch["draft_vocab_size"] == Vd
    conf = json.loads((boot / "config.json").read_text())
    want = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H, "target_hidden_size": H,
        "num_attention_heads": nh, "num_key_value_heads": nh, "head_dim": hd, "intermediate_size": inter,
        "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 5e5,
        "max_position_embeddings": 4096, "vocab_size": 5000, "draft_vocab_size": Vd, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True},
    }
    assert {k: conf.get(k) for k in want} == want
    bf16 = "torch.bfloat16"
    shapes = {
        "fc.weight": ([H, 3 * H], bf16),
        "midlayer.hidden_norm.weight": ([H], bf16),
        "midlayer.input_layernorm.weight": ([H], bf16),
        "midlayer.post_attention_layernorm.weight": ([H], bf16),
        "midlayer.self_attn.q_proj.weight": ([nh * hd, 2 * H], bf16),
        "midlayer.self_attn.k_proj.weight": ([nh * hd, 2 * H], bf16),
        "midlayer.self_attn.v_proj.weight": ([nh * hd, 2 * H], bf16),
        "midlayer.self_attn.o_proj.weight": ([H, nh * hd], bf16),
        "midlayer.mlp.gate_proj.weight": ([inter, H], bf16),
        "midlayer.mlp.up_proj.weight": ([inter, H], bf16),
        "midlayer.mlp.down_proj.weight": ([H, inter], bf16),
        "norm.weight": ([H], bf16),
        "lm_head.weight": ([Vd, H], bf16),
        "d2t": ([Vd], "torch.int64"),
        "t2d": ([5000], "torch.bool"),
    }  # no embed_tokens.weight: H is the target's, so SGLang shares the target's table
    with safe_open(str(boot / "model.safetensors"), framework="pt") as f:
        got = {k: (list(f.get_tensor(k).shape), str(f.get_tensor(k).dtype)) for k in f.keys()}
        assert torch.equal(f.get_tensor("d2t"), torch.zeros(Vd, dtype=torch.int64))  # draft id i is target id i
        assert torch.equal(f.get_tensor("t2d"), torch.arange(5000) < Vd)
    assert got == shapes
    meta = json.loads((boot / "eagle3_meta.json").read_text())
    assert meta["aux_layer_ids"] == [3, 4, 5] and meta["target"]["architecture"] == family


def test_cli_prints_the_capture_command_with_a_bootstrap_drafter(tmp_path, capsys):
    rc = sg.main(["capture", "model=kimi-k25-int4", "model.hidden_size=8", "model.vocab_size=512",
                  f"cache_dir={tmp_path}", "engine.port=31000", f"engine.python={sys.executable}"])
    out = capsys.readouterr()
    assert rc == 0
    boot = out.err.split("# bootstrap drafter: ")[1].split()[0]
    import json

    conf = json.loads((Path(boot) / "config.json").read_text())
    # Kimi is deepseek_v2: HF ids [2, 30, 58] are written [1, 29, 57] (first id 1 -> +1 on all)
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert conf["num_attention_heads"] % 8 == 0 and conf["target_hidden_size"] == 8
    line = out.out.strip()
    assert line.startswith(f"{sys.executable} -m sglang.launch_server --model-path moonshotai/Kimi-K2.5 --tp 8")
    assert f"--speculative-draft-model-path {Path(boot).resolve()}" in line and "--port 31000" in line


def test_cli_speculative_serves_the_sglang_export_of_a_training_run(tmp_path, capsys):
    """``speculative drafter_dir=<run>``: the command serves ``<run>/export/sglang``, not the run folder."""
    run = tmp_path / "run"
    (run / "export" / "sglang").mkdir(parents=True)
    (run / "export" / "vllm").mkdir()
    rc = sg.main(["speculative", "model=kimi-k25-int4", f"drafter_dir={run}", f"cache_dir={tmp_path}",
                  "engine.port=31002", f"engine.python={sys.executable}"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert f"--speculative-draft-model-path {(run / 'export' / 'sglang').resolve()} " in out.out


def test_package_runs_as_the_cli(tmp_path):
    """``python -m eagle3.engines.sglang baseline ...`` prints the command (from any folder)."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "eagle3.engines.sglang", "baseline",
         "model=kimi-k25-int4", "engine.python=/no/python", "engine.port=31001"],
        capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(root)},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert line.startswith("/no/python -m sglang.launch_server --model-path moonshotai/Kimi-K2.5 --tp 8")
    assert "--port 31001" in line and "--speculative-algorithm" not in line


# ------------------------------------------------------------------ the extract stage end to end
def _compose_extract(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose(config_name="extract", overrides=overrides)


def test_extract_kimi_without_server_or_sglang_is_one_line(tmp_path, capsys):
    from eagle3.cli import run_stage
    from eagle3.extract.run import run_extract

    cfg = _compose_extract(["model=kimi-k25-int4", f"engine.python={sys.executable}", f"output_dir={tmp_path / 'f'}"])
    with pytest.raises(SystemExit) as e:
        run_stage(run_extract, cfg)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no SGLang server is configured (engine.url)")
    assert "engine.url=http://HOST:PORT" in err[0]


def test_extract_kimi_against_the_loopback_server(tmp_path):
    """``python extract.py model=kimi-k25-int4 engine.url=...`` with Kimi's sizes shrunk
    to the fake's (hidden 8) and a small local word-level ChatML tokenizer (512 tokens,
    EOS ``<|im_end|>`` = 2), since Kimi's own tokenizer is not available here."""
    import json as _json

    from eagle3.cli import run_stage
    from eagle3.extract.run import run_extract
    from eagle3.features import FeatureDataset, load_manifest

    tokenizer_dir = write_tiny_chat_tokenizer(tmp_path / "tok", V)
    vocab, eos = V, 2
    data = tmp_path / "chats.jsonl"
    with open(data, "w") as f:
        for i in range(5):
            f.write(_json.dumps({"messages": [{"role": "user", "content": f"w{100 + i} w{200 + 2 * i} w17"},
                                              {"role": "assistant", "content": "w9 w9"}]}) + "\n")
    srv = FakeSGLang(FakeConfig(hidden_size=H, vocab_size=vocab, eos_token_id=eos, model_path="moonshotai/Kimi-K2.5"))
    srv.start()
    try:
        out = tmp_path / "features"
        cfg = _compose_extract([
            "model=kimi-k25-int4", f"engine.url={srv.url}", f"model.tokenizer={tokenizer_dir}",
            f"model.hidden_size={H}", f"model.vocab_size={vocab}", "data=jsonl", f"data.path={data}",
            "data.validation_fraction=0", "data.test_fraction=0", "sampling.max_new_tokens=12", "capture.top_k=4",
            f"output_dir={out}", f"cache_dir={tmp_path / 'cache'}",
        ])
        summary = run_stage(run_extract, cfg)
    finally:
        srv.stop()
    assert summary["samples"] == 5
    man = load_manifest(out)
    eng = man["metadata"]["engine"]
    assert eng["name"] == "sglang" and eng["server_version"] == "0.5.23"
    assert eng["effective"]["speculative_algorithm"] == "EAGLE3" and eng["effective"]["disable_radix_cache"] is True
    assert man["metadata"]["aux_layer_ids"] == [2, 30, 58]
    ds = FeatureDataset(out, splits=("train",))
    assert len(ds) == 5
    for i in range(len(ds)):
        rec = ds[i]
        seq = rec["input_ids"].tolist()
        T = len(seq)
        assert rec["aux_hidden_states"].shape == (T, 3, H)
        aux = torch.tensor([[[aux_value(seq[t], t, j, c) for c in range(H)] for j in range(3)] for t in range(T)])
        assert torch.equal(rec["aux_hidden_states"].float(), aux)
        want = torch.tensor([[tid for _, tid in topk_after(seq[t], 4, vocab)] for t in range(T)], dtype=torch.int32)
        assert torch.equal(rec["topk_ids"], want)
        assert 0 < int(rec["loss_mask"].sum()) < T


def test_cpu_command_has_the_flags_the_cpu_build_runs_with():
    m = model_cfg()
    e = engine_cfg(device="cpu", max_running_requests=None)
    cmd = sg.render_launch_command(m, e, model_path="m", port=30100, device=sg.server_device(e),
                                   speculative={"draft_model_path": "d", "num_steps": 3, "topk": 1, "num_draft_tokens": 4})
    line = shlex.join(cmd)
    assert "--device cpu --disable-overlap-schedule --max-total-tokens 8192 --mem-fraction-static 0.5" in line
    assert "--max-running-requests" not in line and "--cuda-graph" not in line  # the server then caps itself at 48
    assert sg.unknown_flags(cmd, set(sg.VERIFIED_FLAGS)) == []
    e2 = engine_cfg(device="cuda", max_total_tokens=4096)
    line2 = shlex.join(sg.render_launch_command(m, e2, model_path="m", port=1, device=sg.server_device(e2)))
    assert "--device" not in line2 and "--max-total-tokens 4096" in line2 and "--max-running-requests 128" in line2
    with pytest.raises(Eagle3Error, match="engine.device=tpu"):
        sg.server_device(engine_cfg(device="tpu"))


def test_server_env_sources_the_script_then_applies_engine_env(tmp_path, monkeypatch):
    script = tmp_path / "env.sh"
    script.write_text('_v=${1:?usage}\nexport FROM_SCRIPT="$_v"\nexport OVERRIDDEN=script\n')
    monkeypatch.setenv("FROM_PARENT", "kept")
    env = sg.server_env(engine_cfg(env_script=f"{script} venv-a", env={"OVERRIDDEN": "engine", "NUM": 3}))
    assert env["FROM_SCRIPT"] == "venv-a" and env["OVERRIDDEN"] == "engine" and env["NUM"] == "3"
    assert env["FROM_PARENT"] == "kept"
    assert sg.server_env(engine_cfg()) is None
    with pytest.raises(Eagle3Error, match="engine.env_script"):
        sg.server_env(engine_cfg(env_script=str(script)))  # ${1:?usage} fails without its argument


def test_free_port_count_gives_a_run_of_ports_that_all_bind():
    """Evaluation launches two servers on port and port + 1; the helper's run must bind
    whole, even while the port just above an OS-picked one is held by someone else."""
    import socket

    for count in (1, 2, 3):
        first = sg.free_port(count=count)
        socks = []
        try:
            for k in range(count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", first + k))  # raises if any port of the run is taken
        finally:
            for s in socks:
                s.close()
