"""The loopback fake against answers recorded from a real SGLang server.

``tests/fixtures/sglang_*.json`` were recorded (``tests/test_sglang_live.py`` with
``EAGLE3_SGLANG_RECORD=1`` writes them) from the CPU build of SGLang 0.5.23 serving
SmolLM2-135M-Instruct (bf16, H = 576), started by the project's launch code; hidden-state
rows and log-prob lists are cut to their first 2 entries (``fake_sglang.truncate_meta``)
and paths of the recording machine are removed. Each test sends the recorded request to
the fake in the same mode and requires the same JSON shape (keys, nesting, leaf types),
and reads the recorded answers with the engine's own parsers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_sglang import FakeConfig, FakeSGLang, load_fixture, signature, truncate_meta  # noqa: E402

from eagle3.engines import sglang as sg  # noqa: E402

H_REAL = 576  # SmolLM2-135M hidden size

#: fixture -> the fake's mode for the same request
MODES = {
    "generate_speculative": dict(speculative=True, num_steps=1, num_draft_tokens=2),
    "generate_baseline": dict(speculative=False, disable_radix_cache=False),  # a server with its prefix cache
    "generate_hidden_speculative": dict(speculative=True, num_steps=1, num_draft_tokens=2),
    "generate_capture": dict(speculative=True, num_steps=1, num_draft_tokens=2),
}


def _request(fx: dict, vocab: int) -> dict:
    body = {k: v for k, v in fx["request"].items() if k != "input_ids_len"}
    body["input_ids"] = [(5 + 3 * i) % vocab for i in range(fx["request"]["input_ids_len"])]
    return body


def _meta_shape(meta: dict) -> dict:
    """Signature of ``meta_info`` without ``finish_reason`` (stop or length depends on the
    text), which is checked on its own."""
    return signature({k: v for k, v in meta.items() if k != "finish_reason"})


def _finish_ok(reason: dict) -> bool:
    return (reason.get("type") == "stop" and isinstance(reason.get("matched"), int)) or (
        reason.get("type") == "length" and isinstance(reason.get("length"), int))


@pytest.mark.parametrize("name", sorted(MODES))
def test_fake_generate_answers_in_the_recorded_shape(name):
    fx = load_fixture(name)
    rec = fx["answer"]
    with FakeSGLang(FakeConfig(**MODES[name])) as fake:
        client = sg.SGLangClient(fake.url, 10.0, 0)
        client.generate(_request(fx, fake.cfg.vocab_size))  # recorded after the prompt had been seen once
        out = client.generate(_request(fx, fake.cfg.vocab_size))
    assert set(out) == set(rec) == {"text", "output_ids", "meta_info"}
    got = truncate_meta(out["meta_info"])
    assert sorted(got) == sorted(rec["meta_info"]), name
    assert _meta_shape(got) == _meta_shape(rec["meta_info"]), name
    assert _finish_ok(got["finish_reason"]) and _finish_ok(rec["meta_info"]["finish_reason"])
    assert signature(out["output_ids"]) == signature(rec["output_ids"]) == ["list", ["int"]]


def test_fake_stream_chunks_have_the_recorded_shape():
    import json
    import urllib.request

    fx = load_fixture("stream_speculative")
    with FakeSGLang(FakeConfig(speculative=True, num_steps=1, num_draft_tokens=2)) as fake:
        body = _request(fx, fake.cfg.vocab_size)
        res = sg.SGLangClient(fake.url, 10.0, 0).generate_stream(dict(body))
        req = urllib.request.Request(fake.url + "/generate", data=json.dumps(dict(body, stream=True)).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            first = json.loads(next(x for x in r.read().decode().split("\n") if x.startswith("data:"))[5:])
    assert sorted(res.meta_info) == sorted(fx["answer"]["meta_info"])
    assert _meta_shape(res.meta_info) == _meta_shape(fx["answer"]["meta_info"])
    rec_first = fx["answer"]["first"]
    assert sorted(first) == sorted(rec_first) and signature(first["meta_info"]) == signature(rec_first["meta_info"])


@pytest.mark.parametrize("name,spec", [("server_info_speculative", True), ("server_info_baseline", False),
                                       ("server_info_capture", True)])
def test_fake_server_info_has_the_recorded_keys_and_types(name, spec):
    rec = load_fixture(name)["answer"]
    with FakeSGLang(FakeConfig(speculative=spec)) as fake:
        got = sg.SGLangClient(fake.url, 10.0, 0).server_info()
    for a, b in ((got, rec), (got["internal_states"][0], rec["internal_states"][0])):
        assert set(b) <= set(a)
        mismatched = [k for k in b if a[k] is not None and b[k] is not None and type(a[k]) is not type(b[k])]
        assert mismatched == [], mismatched


def test_recorded_server_info_is_read_as_the_real_server_runs():
    spec = sg.effective_settings(load_fixture("server_info_speculative")["answer"])
    base = sg.effective_settings(load_fixture("server_info_baseline")["answer"])
    cap = sg.effective_settings(load_fixture("server_info_capture")["answer"])
    # launched without --max-running-requests: EAGLE3 resets the cap to 48
    assert spec["max_running_requests"] == spec["effective_max_running_requests"] == 48
    assert spec["speculative_algorithm"] == "EAGLE3" and spec["speculative_num_steps"] == 3
    assert base["speculative_algorithm"] is None and base["effective_max_running_requests"] > 48
    assert cap["max_running_requests"] == cap["effective_max_running_requests"] == 128
    assert sg.capture_setting_problems(load_fixture("server_info_capture")["answer"]) == []
    assert "--disable-radix-cache" in sg.capture_setting_problems(load_fixture("server_info_speculative")["answer"])
    for eff in (spec, base, cap):  # a CPU server captures no CUDA graphs
        assert eff["device"] == "cpu" and eff["cuda_graph_max_bs"] is None
    assert sg.server_version(load_fixture("server_info_capture")["answer"]).startswith("0.5.23")


def test_recorded_capture_answer_parses_into_a_capture():
    import torch

    ans = load_fixture("generate_capture")["answer"]
    meta = ans["meta_info"]
    rows = meta["hidden_states"][0]
    assert len(rows[0]) == 3 * H_REAL  # the three aux layers concatenated
    hs = load_fixture("generate_hidden_speculative")["answer"]["meta_info"]["hidden_states"]
    # a plain generate on an EAGLE3 server: the prefill block, then one row per decoded token
    assert len(hs[0][0]) == 3 * H_REAL and all(len(r) == 3 * H_REAL and isinstance(r[0], float) for r in hs[1:])
    assert meta["input_top_logprobs"][0] is None and meta["cached_tokens"] == 0
    # the stored answer holds 2 rows of everything: parse it as a 2-token capture
    cap = sg.parse_capture(ans, [0, 0], H_REAL, 4)
    assert cap.aux_hidden_states.shape == (2, 3, H_REAL)
    want = torch.tensor(rows[1], dtype=torch.float32).to(torch.bfloat16).view(3, H_REAL)
    assert torch.equal(cap.aux_hidden_states[1], want)
    top = sorted(meta["input_top_logprobs"][1], key=lambda e: -e[0])
    assert cap.topk_ids[0].tolist() == [e[1] for e in top]
    assert cap.topk_logprobs[0].tolist() == pytest.approx([e[0] for e in top])
    assert cap.topk_ids[1].tolist() == [e[1] for e in meta["output_top_logprobs"][0]]


def test_recorded_speculative_counters_give_tau():
    from eagle3.evaluate.measures import RequestRecord, summarize

    meta = load_fixture("generate_speculative")["answer"]["meta_info"]
    n, ct = meta["completion_tokens"], meta["spec_verify_ct"]
    assert meta["spec_accept_length"] == pytest.approx(n / ct)  # SGLang's tau: the prefill token counts
    r = RequestRecord("b", "s", 0, meta["prompt_tokens"], n, 0.1, 1.0, [], ct, meta["spec_num_correct_drafts"],
                      meta["spec_num_proposed_drafts"], meta["spec_correct_drafts_histogram"])
    s = summarize([r], 1.0, positions=3)
    assert s["acceptance_length"] == pytest.approx(meta["spec_accept_length"])
    assert s["acceptance_rate"] == pytest.approx(meta["spec_accept_rate"])
    assert sum(s["accept_histogram"]) == ct
