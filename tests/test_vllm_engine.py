"""engine=vllm without a server: the per-engine exports, /metrics parsing on recorded real
text, the launch command, read-back of effective settings, and the served measures."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagle3.engines.vllm import (
    Completion,
    SpecCounters,
    VLLMClient,
    effective_settings,
    info_labels,
    max_num_seqs_from_log,
    parse_prometheus,
    render_vllm_command,
    spec_counters,
    speculative_config,
    vllm_env,
)
from eagle3.errors import Eagle3Error
from loopback_http import QuietHandler, serve
from eagle3.evaluate.vllm.measure import Pair
from eagle3.evaluate.vllm.results import bootstrap_median_ci, lossless, pair_summary, speedup_statement
from eagle3.evaluate.vllm.servers import check_servers
from eagle3.export import export_sglang, export_vllm, load_sglang_export, read_sglang_export, read_vllm_export
from eagle3.target import engine_captured_ids
from eagle3.model.drafter import DrafterArch, Eagle3Drafter

pytestmark = pytest.mark.usefixtures("one_thread")

FIX = Path(__file__).parent / "fixtures"
V, VD, H = 64, 16, 16
ARCH = DrafterArch(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=4, intermediate_size=32,
                   num_layers=1, target_hidden_size=H, vocab_size=V, draft_vocab_size=VD)
TRAINED = [2, 5, 8]  # HF output_hidden_states ids the drafter was trained on


def _drafter() -> Eagle3Drafter:
    torch.manual_seed(0)
    m = Eagle3Drafter(ARCH)
    ids = torch.arange(0, 2 * VD, 2)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    m.set_draft_vocab(ids - torch.arange(VD), t2d)
    return m.eval()


META = {"target": {"name": "tiny", "architecture": "llama", "content_hash": "sha256:abc"},
        "aux_layer_ids": TRAINED, "features_manifest_sha256": "f" * 64}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("run") / "export"
    d = _drafter()
    return export_sglang(d, root / "sglang", dict(META)), export_vllm(d, root / "vllm", dict(META))


# --------------------------------------------------------------------------- exports


def test_vllm_export_writes_hf_ids_that_vllm_captures_as_the_trained_layers(exports):
    sg, vl = exports
    sg_ids = json.loads((sg / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    vl_ids = json.loads((vl / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert vl_ids == TRAINED and sg_ids == [1, 4, 7]  # SGLang's Llama rule: captured = written + 1
    assert engine_captured_ids(vl_ids, "vllm", "llama") == TRAINED
    assert engine_captured_ids(sg_ids, "sglang", "llama") == TRAINED
    # the SGLang export served by vLLM would feed the drafter the layer below each trained one
    assert engine_captured_ids(sg_ids, "vllm", "llama") == [i - 1 for i in TRAINED]
    assert json.loads((vl / "eagle3_meta.json").read_text())["aux_id_convention"] == "vllm"
    assert json.loads((sg / "eagle3_meta.json").read_text())["aux_id_convention"] == "sglang"


def test_the_two_exports_differ_only_in_the_aux_ids(exports):
    sg, vl = exports
    assert (sg / "model.safetensors").read_bytes() == (vl / "model.safetensors").read_bytes()
    a, b = json.loads((sg / "config.json").read_text()), json.loads((vl / "config.json").read_text())
    a["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")
    b["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")
    assert a == b


def test_each_engine_refuses_the_other_engines_export_naming_the_right_folder(exports):
    sg, vl = exports
    with pytest.raises(Eagle3Error, match=r"export/sglang instead"):
        load_sglang_export(vl)
    with pytest.raises(Eagle3Error, match=r"export/vllm instead"):
        read_vllm_export(sg)
    assert read_vllm_export(vl).convention == "vllm"
    assert read_sglang_export(sg).convention == "sglang"


def test_an_old_export_without_convention_reads_as_sglang(tmp_path, exports):
    sg, _ = exports
    old = tmp_path / "export" / "sglang"
    old.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        (old / f).write_bytes((sg / f).read_bytes())
    meta = json.loads((sg / "eagle3_meta.json").read_text())
    meta.pop("aux_id_convention")
    (old / "eagle3_meta.json").write_text(json.dumps(meta))
    drafter, m = load_sglang_export(old)
    assert m["aux_layer_ids"] == TRAINED
    with pytest.raises(Eagle3Error, match="export/vllm"):
        read_vllm_export(old)


def test_a_vllm_export_whose_ids_were_edited_is_refused(tmp_path, exports):
    _, vl = exports
    bad = tmp_path / "vllm"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((vl / "model.safetensors").read_bytes())
    (bad / "eagle3_meta.json").write_bytes((vl / "eagle3_meta.json").read_bytes())
    cfg = json.loads((vl / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 4, 7]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Eagle3Error, match=r"capture HF layers \[1, 4, 7\].*trained on \[2, 5, 8\]"):
        read_vllm_export(bad)


def test_a_full_vocabulary_drafter_is_written_for_vllm_without_d2t(tmp_path):
    from safetensors import safe_open

    arch = DrafterArch(**{**ARCH.__dict__, "draft_vocab_size": V})
    torch.manual_seed(0)
    m = Eagle3Drafter(arch)
    m.set_draft_vocab(torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool))
    out = export_vllm(m.eval(), tmp_path / "vllm", dict(META))
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "d2t" not in keys and "t2d" not in keys and "lm_head.weight" in keys  # vLLM refuses a d2t here
    exp = read_vllm_export(out)
    assert torch.equal(exp.d2t, torch.zeros(V, dtype=torch.int64)) and bool(exp.t2d.all())
    sg = export_sglang(m.eval(), tmp_path / "sglang", dict(META))
    with safe_open(str(sg / "model.safetensors"), framework="pt") as f:
        assert "d2t" in set(f.keys())  # the SGLang file keeps its tensors
    perm = torch.roll(torch.arange(V), 1) - torch.arange(V)
    m.set_draft_vocab(perm, torch.ones(V, dtype=torch.bool))
    with pytest.raises(Eagle3Error, match="permutes"):
        export_vllm(m.eval(), tmp_path / "vllm2", dict(META))


def test_converting_an_sglang_export_gives_the_vllm_export_of_the_same_drafter(tmp_path, exports):
    from safetensors.torch import load_file

    from eagle3.export.convert import main

    sg, vl = exports
    out = tmp_path / "converted"
    assert main([str(sg), str(out)]) == 0
    assert (out / "config.json").read_text() == (vl / "config.json").read_text()
    a, b = load_file(str(out / "model.safetensors")), load_file(str(vl / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((out / "eagle3_meta.json").read_text())
    assert meta["aux_id_convention"] == "vllm" and "sglang_aux_layer_ids" not in meta
    assert main([str(vl), str(tmp_path / "again")]) == 2  # a vLLM export is not an SGLang one


def test_a_speculative_server_serving_the_sglang_export_is_refused(exports):
    sg, vl = exports
    exp = read_vllm_export(vl)
    cfg = SimpleNamespace(speculative=SimpleNamespace(num_steps=3))
    desc = {"baseline": {"url": "b", "effective": {"speculative_config": None}},
            "speculative": {"url": "s", "effective": {"speculative_config": speculative_config(str(sg), 3),
                                                      "server_info_available": True}}}
    with pytest.raises(Eagle3Error, match="export/vllm instead"):
        check_servers(desc, cfg, exp)
    desc["speculative"]["effective"]["speculative_config"] = speculative_config(str(vl), 3)
    assert check_servers(desc, cfg, exp) == []
    desc["baseline"]["effective"]["speculative_config"] = speculative_config(str(vl), 3)
    with pytest.raises(Eagle3Error, match="baseline .* speculates"):
        check_servers(desc, cfg, exp)


# --------------------------------------------------------------------------- launch command


def _engine(**kw):
    from eagle3.config import VLLMEngineConfig

    e = VLLMEngineConfig(python="/venv/bin/python", port=8100, max_num_seqs=8, served_model_name="target")
    for k, v in kw.items():
        setattr(e, k, v)
    return e


def test_launch_command_has_every_flag_explicit():
    e = _engine()
    spec = speculative_config("/runs/d/export/vllm", 3)
    cmd = render_vllm_command(e, python=e.python, model_path="/m/int4", dtype="bfloat16", seed=7, port=8101,
                              device="cpu", speculative=spec)
    assert cmd == [
        "/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/int4", "--host", "127.0.0.1",
        "--port", "8101", "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "8",
        "--served-model-name", "target", "--seed", "7", "--tensor-parallel-size", "1", "--speculative-config",
        '{"method": "eagle3", "model": "/runs/d/export/vllm", "num_speculative_tokens": 3}',
    ]
    gpu = render_vllm_command(_engine(enforce_eager=True, max_num_batched_tokens=4096, extra_args=["--x", "1"]),
                              python="p", model_path="m", dtype="float16", seed=0, port=1, device="cuda")
    assert gpu[-7:] == ["--max-num-batched-tokens", "4096", "--gpu-memory-utilization", "0.9", "--enforce-eager",
                        "--x", "1"]
    assert "--speculative-config" not in gpu


def test_server_environment_sets_the_cpu_kv_cache_only_on_cpu():
    env = vllm_env(_engine(kv_cache_space_gb=3), "cpu", base={"PATH": "/bin"})
    assert env == {"PATH": "/bin", "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "3"}
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_env(_engine(), "cuda", base={})


# --------------------------------------------------------------------------- measures


def _c(ids, lat=1.0, ttft=0.1):
    return Completion(list(ids), ttft, lat, "stop", {"completion_tokens": len(ids)})


def _pair(sid, base, spec, drafts=0, acc=0, per=(), turn=0):
    return Pair("b", sid, turn, [1, 2], base, spec, SpecCounters(drafts, 3 * drafts, acc, list(per), True))


def test_lossless_counts_prompts_and_reports_the_first_mismatch():
    pairs = [_pair("a", _c([5, 6, 7]), _c([5, 6, 7])), _pair("b", _c([5, 6, 7]), _c([5, 9, 7])),
             _pair("c", _c([5, 6]), _c([5, 6, 8])), _pair("a", _c([1]), _c([1]), turn=1)]
    matches, n, first, ties = lossless(pairs)
    assert (matches, n, ties) == (1, 3, 0)
    assert first == {"sample_id": "b", "turn": 0, "position": 1, "baseline_token": 6, "speculative_token": 9,
                     "baseline_len": 3, "speculative_len": 3}
    # with the diagnosis: b's first mismatch is a tie, c's (one output ended first) is not
    diag = {("b", "b", 0): {"position": 1, "logit_gap": 0.125, "tie": True},
            ("b", "c", 0): {"position": 2, "logit_gap": None, "tie": False}}
    matches, n, first, ties = lossless(pairs, diag)
    assert (matches, n, ties) == (1, 3, 1) and first["logit_gap"] == 0.125 and first["tie"] is True


class _PromptLogprobs(QuietHandler):
    """Answers /v1/completions with prompt_logprobs in vLLM's shape (entry 0 null; each later
    entry {token id: {logprob, rank, decoded_token}}, the top alternatives plus the prompt's own
    token): at the last position token 6 at -0.70, token 9 at -0.82, token 4 at -3.0."""

    bodies: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        n = len(body["prompt"])
        last = {"6": {"logprob": -0.70, "rank": 1, "decoded_token": "a"},
                "9": {"logprob": -0.82, "rank": 2, "decoded_token": "b"},
                "4": {"logprob": -3.0, "rank": 3, "decoded_token": "c"}}
        entries = [None] + [{"1": {"logprob": -1.0, "rank": 1, "decoded_token": "x"}}] * (n - 2) + [last]
        self.send_text(json.dumps({"choices": [{"index": 0, "text": "", "token_ids": [6],
                                                "prompt_logprobs": entries}]}))


class _Refuses(QuietHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_text(json.dumps({"error": {"message": "Requested prompt logprobs of 20, which is greater than max allowed: 5"}}), 400)


def test_a_failed_diagnosis_is_recorded_not_raised():
    """A server that refuses prompt_logprobs (``--max-logprobs`` below 20) must not end the
    evaluation: the mismatch keeps no gap, counts as changed, and says why."""
    from eagle3.evaluate.vllm.measure import diagnose_mismatches

    with serve(_Refuses) as url:
        d = diagnose_mismatches(VLLMClient(url, max_retries=0), "target", {"b": [_pair("t", _c([5, 6]), _c([5, 9]))]})
    row = d[("b", "t", 0)]
    assert row["logit_gap"] is None and row["tie"] is False and "--max-logprobs 20" in row["error"]


def test_diagnosis_asks_the_baseline_for_the_gap_at_each_mismatching_turn():
    from eagle3.evaluate.vllm.measure import diagnose_mismatches
    from eagle3.evaluate.vllm.results import pair_summary

    _PromptLogprobs.bodies = []
    pairs = {"b": [_pair("t", _c([5, 6, 7]), _c([5, 9, 7])),          # gap |-0.70 - -0.82| = 0.12: a tie
                   _pair("t", _c([5, 6]), _c([5, 6]), turn=1),          # same prompt, later turn, equal
                   _pair("w", _c([5, 6, 7]), _c([5, 4, 7])),          # gap 2.30: a changed output
                   _pair("x", _c([5, 6]), _c([5, 6, 8])),              # one output ended first: no request
                   _pair("m", _c([1, 2]), _c([1, 2]))]}                # equal: nothing
    with serve(_PromptLogprobs) as url:
        diag = diagnose_mismatches(VLLMClient(url, max_retries=0), "target", pairs)
    assert diag[("b", "t", 0)]["logit_gap"] == pytest.approx(0.12) and diag[("b", "t", 0)]["tie"] is True
    assert diag[("b", "w", 0)]["logit_gap"] == pytest.approx(2.30) and diag[("b", "w", 0)]["tie"] is False
    assert diag[("b", "x", 0)] == {"position": 2, "logit_gap": None, "tie": False}
    assert set(diag) == {("b", "t", 0), ("b", "w", 0), ("b", "x", 0)}
    # one request per diagnosable turn: the turn's prompt ids, then the baseline's output through the mismatch
    assert [b["prompt"] for b in _PromptLogprobs.bodies] == [[1, 2, 5, 6], [1, 2, 5, 6]]
    assert all(b["prompt_logprobs"] == 20 and b["max_tokens"] == 1 and b["temperature"] == 0.0
               for b in _PromptLogprobs.bodies)
    s = pair_summary(pairs["b"], depth=3, seed=0, diagnosis=diag)
    assert (s["lossless_matches"], s["lossless_checked"], s["lossless_near_ties"]) == (1, 4, 1)
    # a prompt counts as a tie only when every differing turn is one (as the in-process check)
    two = [_pair("t", _c([5, 6, 7]), _c([5, 9, 7])), _pair("t", _c([5, 6, 7]), _c([5, 4, 7]), turn=1)]
    with serve(_PromptLogprobs) as url:
        d2 = diagnose_mismatches(VLLMClient(url, max_retries=0), "target", {"b": two})
    assert [d2[("b", "t", t)]["tie"] for t in (0, 1)] == [True, False] and lossless(two, d2)[3] == 0
    # the verdict: one prompt changed beyond a tie is not lossless; ties alone are
    from eagle3.evaluate.metrics import verdict

    assert "not-lossless" in verdict(s)[0]
    assert "not-lossless" not in verdict({**s, "lossless_near_ties": 3})[0]


def test_pair_summary_tau_and_speedup_from_hand_computed_counters():
    # prompt a: 10 tokens in 1 s spec vs 2 s base -> ratio 2; prompt b: 10 tokens in 2 s vs 2 s -> 1
    pairs = [_pair("a", _c(range(10), lat=2.0), _c(range(10), lat=1.0), drafts=4, acc=5, per=[3, 2, 0]),
             _pair("b", _c(range(10), lat=2.0), _c(range(10), lat=2.0), drafts=6, acc=3, per=[2, 1, 0])]
    s = pair_summary(pairs, depth=3, seed=0)
    assert s["acceptance_length"] == pytest.approx(1 + 8 / 10)
    # tau over prompts: a alone 1 + 5/4, b alone 1 + 3/6 (each a quarter of the resamples), both 1.8
    assert s["acceptance_length_interval"] == pytest.approx([1.5, 2.25])
    assert s["acceptance_rate"] == pytest.approx(8 / 30)
    assert s["per_position_acceptance"] == pytest.approx([5 / 10, 3 / 10, 0.0])
    assert s["speedup_per_prompt"] == pytest.approx([2.0, 1.0])
    assert s["speedup"] == pytest.approx(1.5)
    assert s["lossless_matches"] == 2 and s["lossless_checked"] == 2
    # 1 prefill token + drafts + accepted = 10 for a (1 + 4 + 5), not for b (1 + 6 + 3 = 10 too)
    assert s["requests_where_counters_differ_from_tokens"] == 0


def test_a_claimed_speed_up_is_no_warning_but_an_unclaimable_one_and_a_changed_output_are():
    from eagle3.evaluate.vllm.results import benchmark_warnings

    # every prompt 2x faster (interval [2, 2]): a result, not a warning
    fast = [_pair(s, _c(range(10), lat=2.0), _c(range(10), lat=1.0), drafts=4, acc=5, per=[3, 2, 0]) for s in "abcd"]
    assert benchmark_warnings("x", pair_summary(fast, depth=3, seed=0)) == []
    # ratios 2, 0.5, 2, 0.5: the interval contains 1.0; and prompt d's output differs at position 1
    mixed = [_pair("a", _c(range(10), lat=2.0), _c(range(10), lat=1.0)),
             _pair("b", _c(range(10), lat=1.0), _c(range(10), lat=2.0)),
             _pair("c", _c(range(10), lat=2.0), _c(range(10), lat=1.0)),
             _pair("d", _c([5, 6, 7], lat=1.0), _c([5, 9, 7], lat=2.0))]
    w = benchmark_warnings("y", pair_summary(mixed, depth=3, seed=0))
    assert len(w) == 2
    assert w[0].startswith("y: 1 of 4 prompts differ from the baseline's greedy output; first mismatch")
    assert w[1].startswith("y: no measurable speed-up: x") and w[1].endswith("at batch 1 over 4 prompts")


def test_the_batch1_pairs_are_the_concurrency_1_row():
    # two benchmarks; baseline: (10 + 6) tokens in (2.0 + 1.0) s; speculative: (10 + 6) in (1.0 + 1.5) s
    from eagle3.evaluate.vllm.measure import pairs_as_sweep
    from eagle3.evaluate.vllm.results import concurrency_table

    pairs = {"x": [_pair("a", _c(range(10), lat=2.0), _c(range(10), lat=1.0), drafts=4, acc=5, per=[3, 2, 0]),
                   _pair("b", _c(range(6), lat=1.0), _c(range(6), lat=1.5), drafts=3, acc=2, per=[2, 0, 0])],
             "y": [_pair("c", _c(range(4), lat=0.5), _c(range(4), lat=0.25), drafts=1, acc=2, per=[1, 1, 0])]}
    sweep = pairs_as_sweep(pairs)
    assert sweep["baseline"]["x"].duration_s == pytest.approx(3.0) and sweep["speculative"]["x"].duration_s == 2.5
    assert sweep["baseline"]["x"].counters is None
    assert sweep["speculative"]["x"].counters.tau == pytest.approx(1 + 7 / 7)
    per, pooled = concurrency_table({r: {1: by_b} for r, by_b in sweep.items()}, ["x", "y"], [1], depth=3)
    (row,) = per["x"]
    assert row["concurrency"] == 1 and row["effective_concurrency"] == 1
    assert row["baseline"]["output_tokens_per_s"] == pytest.approx(16 / 3.0)
    assert row["speculative"]["output_tokens_per_s"] == pytest.approx(16 / 2.5)
    assert row["speedup"] == pytest.approx((16 / 2.5) / (16 / 3.0))
    assert row["speculative"]["acceptance_length"] == pytest.approx(2.0)
    assert row["speculative"]["per_position_acceptance"] == pytest.approx([5 / 7, 2 / 7, 0.0])
    assert row["baseline"]["ran_first"] is None  # interleaved prompt by prompt, not one server's run
    (all_,) = pooled
    assert all_["baseline"]["output_tokens_per_s"] == pytest.approx(20 / 3.5)
    assert all_["speculative"]["output_tokens_per_s"] == pytest.approx(20 / 2.75)
    assert all_["speculative"]["acceptance_length"] == pytest.approx(1 + 9 / 8)


def test_bootstrap_interval_and_the_no_speedup_wording():
    lo, hi = bootstrap_median_ci([1.2] * 5, seed=0)
    assert lo == pytest.approx(1.2) and hi == pytest.approx(1.2)
    vals = [0.8, 0.9, 1.0, 1.1, 1.3, 1.2, 0.95]
    a, b = bootstrap_median_ci(vals, seed=3), bootstrap_median_ci(vals, seed=3)
    assert a == b and min(vals) <= a[0] <= a[1] <= max(vals)
    assert speedup_statement(1.05, (0.9, 1.2)).startswith("no measurable speed-up")
    assert speedup_statement(1.3, (1.1, 1.4)).startswith("speed-up x1.30")
    assert speedup_statement(0.7, (0.6, 0.8)).startswith("slower")
    assert bootstrap_median_ci([0.5, 0.6], seed=0) is None  # two prompts: no interval
    assert speedup_statement(0.55, None).startswith("no measurable speed-up: x0.55 from fewer than 3")


def test_served_verdict_codes_an_interval_across_one_no_speedup_never_slower():
    from eagle3.evaluate.vllm.results import benchmark_verdict

    base = {"acceptance_length": 1.9, "lossless_matches": 20, "lossless_checked": 20, "diversity": {"loops": False}}
    ci, stmt = (0.93, 1.04), speedup_statement(0.98, (0.93, 1.04))
    v, notes = benchmark_verdict({**base, "speedup": 0.98, "speedup_ci95": ci, "speedup_statement": stmt}, None)
    assert v == "no-speedup" and notes[-1].startswith("no measurable speed-up") and "at batch 1" in notes[-1]
    # other codes stay beside it: a drafter that accepts nothing
    v, _ = benchmark_verdict({**base, "acceptance_length": 1.01, "speedup": 0.98, "speedup_ci95": ci,
                              "speedup_statement": stmt}, None)
    assert v == "accepts-nothing, no-speedup"
    # an interval wholly below 1 is slower, wholly above 1 is OK
    assert benchmark_verdict({**base, "speedup": 0.8, "speedup_ci95": (0.7, 0.9)}, None)[0] == "slower"
    assert benchmark_verdict({**base, "speedup": 1.4, "speedup_ci95": (1.2, 1.6)}, None)[0] == "OK"


# --------------------------------------------------------------------------- recorded real answers
# tests/fixtures/vllm_*: answers of vllm-cpu 0.32.0 serving the W4A16 SmolLM2-135M-Instruct on a
# 2-core CPU machine, one /v1/completions request (vllm_request.json) to a baseline and to a
# speculative server (EAGLE-3, 3 speculative tokens), /metrics read just before and after the
# speculative request; absolute paths made relative to the repository root, server_info trimmed
# to the fields read.


def _counter_lines(text: str, name: str) -> list[float]:
    """The values of ``name``'s samples, read line by line without the parser under test."""
    return [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{") or ln.startswith(name + " ")]


def test_recorded_metrics_delta_is_the_requests_own_counters():
    before, after = (FIX / "vllm_metrics_before.txt").read_text(), (FIX / "vllm_metrics_after.txt").read_text()
    answer = json.loads((FIX / "vllm_completion_spec.json").read_text())
    d = spec_counters(after) - spec_counters(before)
    for attr, name in (("drafts", "vllm:spec_decode_num_drafts_total"),
                       ("draft_tokens", "vllm:spec_decode_num_draft_tokens_total"),
                       ("accepted", "vllm:spec_decode_num_accepted_tokens_total")):
        assert getattr(d, attr) == sum(_counter_lines(after, name)) - sum(_counter_lines(before, name))
    assert d.present and d.drafts > 0
    assert d.draft_tokens == 3 * d.drafts  # 3 speculative tokens per verify pass
    assert sum(d.per_position) == d.accepted and len(d.per_position) == 3
    # the answer stopped on its own: 1 token from the prefill, then 1 + accepted per verify pass
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 1 + d.drafts + d.accepted
    assert d.tau == pytest.approx(1 + d.accepted / d.drafts)
    assert d.per_position_acceptance(3) == pytest.approx([v / d.drafts for v in d.per_position])


def test_recorded_baseline_metrics_carry_no_spec_counters_but_the_cache_config():
    text = (FIX / "vllm_metrics_baseline.txt").read_text()
    assert not spec_counters(text).present
    labels = info_labels(text)
    assert labels["block_size"] == "128" and labels["enable_prefix_caching"] == "True"


def test_prometheus_parser_on_escaped_labels_and_special_values():
    text = '# HELP x y\nm_total{a="q\\"x",position="1"} 2.0\nm_total{position="0"} NaN\nbad line\nn 3e2 1700\n'
    assert parse_prometheus(text)[0] == ("m_total", {"a": 'q"x', "position": "1"}, 2.0)
    assert parse_prometheus(text)[2] == ("n", {}, 300.0)
    assert len(parse_prometheus(text)) == 3


class _Replay(QuietHandler):
    """Answers with the recorded files: GET /v1/models, /metrics, /server_info, /health; POST /v1/completions."""

    routes = {
        "/v1/models": ("application/json", lambda: json.dumps({"object": "list", "data": json.loads(
            (FIX / "vllm_models.json").read_text())["data"]})),
        "/metrics": ("text/plain", lambda: (FIX / "vllm_metrics_after.txt").read_text()),
        "/server_info?config_format=json": ("application/json", lambda: (FIX / "vllm_server_info_spec.json").read_text()),
        "/health": ("text/plain", lambda: ""),
    }

    def do_GET(self):
        if self.path in self.routes:
            ctype, fn = self.routes[self.path]
            return self.send_text(fn(), ctype=ctype)
        self.send_text('{"detail":"Not Found"}', 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["return_token_ids"] is True
        self.send_text((FIX / "vllm_completion_spec.json").read_text())


@pytest.fixture()
def replay():
    with serve(_Replay) as url:
        yield url


def test_effective_settings_read_back_from_recorded_answers(replay):
    eff = effective_settings(VLLMClient(replay))
    assert eff["max_model_len"] == 2048 and eff["served_model_names"] == ["target"]
    assert eff["max_num_seqs"] == 8 and eff["max_num_seqs_source"] == "server_info"
    assert eff["speculative_config"]["method"] == "eagle3"
    assert eff["speculative_config"]["num_speculative_tokens"] == 3
    assert eff["cache_config"]["block_size"] == "128"


def test_client_reads_the_recorded_completion(replay):
    want = json.loads((FIX / "vllm_completion_spec.json").read_text())
    res = VLLMClient(replay).complete(json.loads((FIX / "vllm_request.json").read_text()), stream=False)
    assert res.output_ids == want["choices"][0]["token_ids"]
    assert res.completion_tokens == want["usage"]["completion_tokens"] == len(res.output_ids)
    base = json.loads((FIX / "vllm_completion_base.json").read_text())
    assert base["choices"][0]["token_ids"] == res.output_ids  # greedy speculation was lossless on this prompt


def test_an_unreachable_server_is_one_clear_error():
    from eagle3.engines.vllm import VLLMUnavailable

    with pytest.raises(VLLMUnavailable, match="failed GET /v1/models 2 times"):
        VLLMClient("http://127.0.0.1:9", max_retries=1, backoff_s=0.01).models()


def test_max_num_seqs_from_a_recorded_launch_log_line(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text((FIX / "vllm_launch_log.txt").read_text())
    assert max_num_seqs_from_log(log) == 8
    (tmp_path / "empty.log").write_text("nothing\n")
    assert max_num_seqs_from_log(tmp_path / "empty.log") is None


def test_the_default_sglang_drafter_dir_resolves_to_the_vllm_export_beside_it(tmp_path, exports):
    from eagle3.export import export_dir

    sg, vl = exports
    assert export_dir(sg, "vllm") == vl  # both written by one training run
    lone = tmp_path / "run" / "export" / "sglang"
    lone.mkdir(parents=True)
    assert export_dir(lone, "vllm") == lone  # no vLLM export beside it: given as is, refused later with the fix
    assert export_dir(vl, "vllm") == vl


# ------------------------------------------------------------ CPU instruction-set preflight
def _folder(tmp_path, quantized: bool):
    import json

    cfg = {"architectures": ["LlamaForCausalLM"]}
    if quantized:  # the shape of a compressed-tensors W4A16 config (as eagle3.target.quantize writes it)
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                      "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                                                    "weights": {"num_bits": 4, "type": "int"}}}}
    d = tmp_path / ("int4" if quantized else "dense")
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_a_w4a16_target_on_a_cpu_without_avx512_is_refused_before_the_server_starts(tmp_path):
    from eagle3.engines.vllm.launch import check_cpu_can_serve

    int4, dense = _folder(tmp_path, True), _folder(tmp_path, False)
    avx2 = {"fpu", "sse4_2", "avx", "avx2", "fma"}
    with pytest.raises(Eagle3Error, match="no AVX-512.*cpu_gemm_wna16.*model=smollm2-135m-int4-dequant"):
        check_cpu_can_serve(int4, "cpu", flags=avx2)
    check_cpu_can_serve(int4, "cpu", flags=avx2 | {"avx512f", "avx512_bf16"})  # the kernel's build
    check_cpu_can_serve(dense, "cpu", flags=avx2)  # a dense bf16 model needs no INT4 kernel
    check_cpu_can_serve(int4, "cuda", flags=avx2)  # a GPU build runs Marlin, not the CPU kernel


def test_cpu_flags_are_read_from_the_flags_line(tmp_path):
    from eagle3.engines.vllm.launch import cpu_flags

    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx avx2 fma\n\nprocessor\t: 1\n")
    assert cpu_flags(str(f)) == {"fpu", "avx", "avx2", "fma"}
    assert cpu_flags(str(tmp_path / "missing")) is None


class _FakeVLLM:
    """A client answering every completion with two tokens and exposing no spec counters."""

    def __init__(self):
        self.prompts = []

    def complete(self, body):
        from eagle3.engines.vllm import Completion

        self.prompts.append(list(body["prompt"]))
        return Completion(output_ids=[7, 8], ttft_s=0.01, latency_s=0.02, finish_reason="length",
                          usage={"completion_tokens": 2})

    def metrics_text(self):
        return ""


def test_prompt_limit_is_the_servers_context_less_the_reply_or_max_prompt_tokens():
    from eagle3.evaluate.measures import prompt_limit

    assert prompt_limit([2048, 2048], 128, 2048) == (1920, "the servers' max_model_len 2048 less max_new_tokens 128")
    assert prompt_limit([4096, 2048], 128, 1000) == (1000, "max_prompt_tokens=1000")
    assert prompt_limit([None], 64, None) == (None, "")


def test_turns_too_long_for_the_servers_are_skipped_not_sent():
    """A ShareGPT prompt of 2,364 tokens against max_model_len 2048 stopped a served run with
    HTTP 400; such turns are now skipped (counted) and end their conversation."""
    from eagle3.errors import Eagle3Error
    from eagle3.evaluate.vllm.measure import Servers, measure_pairs

    render = lambda msgs: [1] * sum(len(m["content"]) for m in msgs)  # one token per character
    decode = lambda ids: "x" * len(ids)
    rows = {"bench": [
        {"id": "a", "messages": [{"role": "user", "content": "a" * 5}]},
        {"id": "b", "messages": [{"role": "user", "content": "b" * 50}]},  # 50 > 20: skipped
        {"id": "c", "messages": [{"role": "user", "content": "c" * 10}, {"role": "assistant", "content": "r"},
                                 {"role": "user", "content": "d" * 10}]},  # turn 2: 10 + 2 + 10 = 22 > 20
    ], "none_fit": [{"id": "e", "messages": [{"role": "user", "content": "e" * 21}]}]}
    base, spec = _FakeVLLM(), _FakeVLLM()
    warnings = []
    pairs = measure_pairs(Servers(base, spec), rows, render, decode, 20, "the servers' max_model_len", warnings)
    assert list(pairs) == ["bench"]  # a benchmark none of whose prompts fits is left out
    assert [(p.sample_id, p.turn) for p in pairs["bench"]] == [("a", 0), ("c", 0)]
    assert [len(x) for x in base.prompts] == [5, 10] and [len(x) for x in spec.prompts] == [5, 10]
    assert warnings[0].startswith("bench: 2 prompts longer than 20 tokens (the servers' max_model_len) were skipped")
    assert warnings[1].startswith("none_fit: 1 prompts longer than 20 tokens")
    with pytest.raises(Eagle3Error, match="no benchmark prompt is 20 tokens or shorter"):
        measure_pairs(Servers(_FakeVLLM(), _FakeVLLM()), {"none_fit": rows["none_fit"]}, render, decode, 20, "x")


# ------------------------------------------------------------ failed starts that eagle3 explains
#: The end of a real speculative server's log (vllm-cpu 0.32, 2-core AVX-512 CPU): an EAGLE-3 drafter
#: beside a DeepseekV3 (MLA) target; the site-packages paths shortened.
MLA_SPEC_LOG = """\
(Worker pid=10452) ERROR 12-07 14:45:29 [multiproc_executor.py:1063]   File "/venv/lib/python3.11/site-packages/vllm/v1/worker/utils.py", line 554, in select_common_block_size
(Worker pid=10452) ERROR 12-07 14:45:29 [multiproc_executor.py:1063]     raise ValueError(
(Worker pid=10452) ERROR 12-07 14:45:29 [multiproc_executor.py:1063] ValueError: No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)]).
(EngineCore pid=10401) ERROR 12-07 14:45:29 [core.py:1510] RuntimeError: Worker failed with error 'No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)]).', please check the stack trace above for the root cause
(EngineCore pid=10401) ERROR 12-07 14:45:33 [multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly (exit code: None), shutting down executor.
  File "/venv/lib/python3.11/site-packages/vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""
MLA_SPEC_EXPLAINED = "vLLM's CPU build cannot run EAGLE-3 speculation for an MLA target"


def test_the_cpu_mla_block_size_line_is_recognised_and_nothing_else():
    from eagle3.engines.vllm.launch import explain_failed_start

    msg = explain_failed_start(MLA_SPEC_LOG.splitlines())
    assert msg is not None and msg.startswith(MLA_SPEC_EXPLAINED)
    assert "vllm/v1/attention/backends/mla/cpu_mla.py" in msg and "vllm/v1/attention/backends/cpu_attn.py" in msg
    assert "'No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])'" in msg
    assert "SGLang" in msg and "engine=sglang" in msg and "export/sglang" in msg
    # the same failure between two backends that are not the CPU MLA one, and other failures, are not it
    assert explain_failed_start(["ValueError: No common block size for 16 (FLASH_ATTN: [16]; CPU_ATTN: "
                                 "[MultipleOf(32)])."]) is None
    assert explain_failed_start([ln for ln in MLA_SPEC_LOG.splitlines() if "block size" not in ln]) is None


def test_a_server_that_dies_on_the_cpu_mla_block_size_is_one_clear_error(tmp_path):
    import socket
    import sys

    from eagle3.engines.vllm.launch import VLLMServer

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = f"import sys; sys.stdout.write({MLA_SPEC_LOG!r}); sys.exit(1)"
    server = VLLMServer([sys.executable, "-c", script], tmp_path / "vllm-spec.log", f"http://127.0.0.1:{port}")
    server.start()
    try:
        with pytest.raises(Eagle3Error) as err:
            server.wait_healthy(60, poll_s=0.1)
    finally:
        server.stop()
    msg = str(err.value)
    assert msg.startswith(MLA_SPEC_EXPLAINED) and "exited with code 1" in msg
    assert f"full log {tmp_path / 'vllm-spec.log'}" in msg and "Engine core initialization failed" in msg


def test_an_mla_target_of_another_latent_size_is_refused_on_cpu_before_the_server_starts(tmp_path):
    from eagle3.engines.vllm.launch import check_cpu_can_serve

    def folder(name, cfg):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        return str(d)

    mini = folder("mini", {"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 32, "qk_rope_head_dim": 16})
    kimi = folder("kimi", {"architectures": ["KimiK25ForConditionalGeneration"],
                           "text_config": {"kv_lora_rank": 512, "qk_rope_head_dim": 64}})
    nested = folder("nested", {"text_config": {"kv_lora_rank": 256, "qk_rope_head_dim": 64}})
    with pytest.raises(Eagle3Error, match=r"latent head of 48 \(kv_lora_rank 32 \+ qk_rope_head_dim 16\).*576 only"
                                          r".*cpu_mla\.py.*SGLang"):
        check_cpu_can_serve(mini, "cpu", flags={"avx512f"})
    with pytest.raises(Eagle3Error, match="latent head of 320"):
        check_cpu_can_serve(nested, "cpu", flags={"avx512f"})
    check_cpu_can_serve(kimi, "cpu", flags={"avx512f"})  # 512 + 64: the kernel's size
    check_cpu_can_serve(mini, "cuda", flags={"avx512f"})  # GPU builds have other MLA kernels
    check_cpu_can_serve(_folder(tmp_path, False), "cpu", flags={"avx512f"})  # no MLA
