"""``extract.py engine=vllm`` against a loopback vLLM server: the replies are the server's,
the features are the in-process capture of exactly those ids.

The fake answers ``/v1/completions`` with a reply computed from the prompt ids by a rule
(:func:`rule_reply`), shaped like the recorded real answers (``tests/fixtures/vllm_*``:
``token_ids`` end with the stop token when ``finish_reason`` is ``stop``); the test checks
the written shards against that rule and against an independent ``HFEngine.capture`` of
the same sequences.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3 import features
from eagle3.config import CaptureConfig, DataConfig, ExtractConfig, HFEngineConfig, ModelConfig, SamplingConfig, VLLMEngineConfig
from eagle3.engines.vllm.engine import reply_ids
from eagle3.errors import Eagle3Error
from eagle3.extract.run import run_extract
from loopback_http import QuietHandler, serve

pytestmark = pytest.mark.usefixtures("one_thread")
FIX = Path(__file__).resolve().parent / "fixtures"
STOP = 2  # SmolLM2's <|im_end|>
CHATS = [
    {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"},
                  {"role": "user", "content": "How are you?"}]},
    {"messages": [{"role": "user", "content": "Name a colour."}]},
    {"messages": [{"role": "user", "content": "Why is the sky blue?"}]},
    {"messages": [{"role": "user", "content": "Count to three."}]},
]


def rule_reply(prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    """The fake server's greedy reply: ``3 + len(prompt) % 5`` content ids then the stop
    token, or ``max_tokens`` ids and ``length`` when that does not fit."""
    k = 3 + len(prompt) % 5
    body = [100 + (sum(prompt) + 7 * i) % 900 for i in range(k)]
    if k + 1 <= max_tokens:
        return body + [STOP], "stop"
    return body[:max_tokens], "length"


class _FakeVLLM(QuietHandler):
    requests: list = []

    def do_GET(self):
        if self.path == "/health":
            return self.send_text("")
        if self.path == "/v1/models":
            return self.send_text(json.dumps({"object": "list", "data": [{"id": "target", "max_model_len": 2048}]}))
        if self.path == "/metrics":
            return self.send_text((FIX / "vllm_metrics_baseline.txt").read_text(), ctype="text/plain")
        self.send_text('{"detail":"Not Found"}', 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        ids, finish = rule_reply(body["prompt"], int(body["max_tokens"]))
        self.send_text(json.dumps({"object": "text_completion", "model": body["model"], "choices": [
            {"index": 0, "text": "", "finish_reason": finish, "token_ids": ids}],
            "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids)}}))


@pytest.fixture()
def fake_vllm():
    _FakeVLLM.requests = []
    with serve(_FakeVLLM) as url:
        yield url, _FakeVLLM.requests


def _cfg(tiny_target_dir, tmp_path, url, **engine_kw):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    return ExtractConfig(
        model=ModelConfig(name="tiny", source=str(tiny_target_dir)),
        engine=VLLMEngineConfig(url=url, capture="hf", capture_device="cpu", concurrency=2, max_retries=1, backoff_s=0.01,
                                **engine_kw),
        data=DataConfig(name="chats", source="jsonl", path=str(data), validation_fraction=0.0, test_fraction=0.0),
        sampling=SamplingConfig(max_new_tokens=6),
        capture=CaptureConfig(top_k=4, max_length=128, max_turns=None),
        output_dir=str(tmp_path / "out"),
        cache_dir=str(tmp_path / "cache"),
    )


def test_replies_are_the_servers_and_features_the_in_process_capture_of_them(tiny_target_dir, tmp_path, fake_vllm):
    from eagle3.engines.hf.engine import HFEngine

    url, requests = fake_vllm
    summary = run_extract(_cfg(tiny_target_dir, tmp_path, url))
    assert summary["samples"] == 4

    # every request: the rendered prompt as ids, greedy, the stop token named, token ids asked for
    assert len(requests) == 5  # 4 first turns + the second turn of the two-turn chat
    for b in requests:
        assert b["return_token_ids"] is True and b["stop_token_ids"] == [STOP]
        assert b["temperature"] == 0.0 and b["max_tokens"] == 6 and b["model"] == "target" and "seed" not in b
    second = [b for b in requests if any(b["prompt"][:len(a["prompt"])] == a["prompt"] and a is not b for a in requests)]
    assert len(second) == 1  # the second turn's prompt starts with the first turn's prompt and reply
    first = next(a for a in requests if second[0]["prompt"][:len(a["prompt"])] == a["prompt"] and a is not second[0])
    r1, _ = rule_reply(first["prompt"], 6)
    assert second[0]["prompt"][len(first["prompt"]):len(first["prompt"]) + len(r1)] == r1

    m = features.load_manifest(tmp_path / "out")
    eng = m["metadata"]["engine"]
    assert eng["name"] == "vllm" and eng["capture"]["name"] == "hf" and eng["generation"]["max_model_len"] == 2048
    capture = HFEngine.from_config(ModelConfig(name="tiny", source=str(tiny_target_dir)), HFEngineConfig(device="cpu"),
                                   str(tmp_path / "cache"))
    prompts = {tuple(b["prompt"]) for b in requests}
    checked = 0
    for s in m["shards"]:
        t = load_file(str(tmp_path / "out" / s["file"]))
        off = t["offsets"].tolist()
        for a, b in zip(off, off[1:]):
            ids = t["input_ids"][a:b].tolist()
            mask = t["loss_mask"][a:b].tolist()
            # the loss-masked (generated) runs are the fake's replies to the prompts in front of them
            i = 0
            while i < len(ids):
                if mask[i]:
                    j = i
                    while j < len(ids) and mask[j]:
                        j += 1
                    assert tuple(ids[:i]) in prompts
                    assert ids[i:j] == rule_reply(ids[:i], 6)[0]
                    i = j
                else:
                    i += 1
            # one sequence alone, unpadded: equal to bf16 rounding of the batched capture
            ref = capture.capture([ids], 4)[0]
            cos = torch.nn.functional.cosine_similarity(t["aux_hidden_states"][a:b].float(),
                                                        ref.aux_hidden_states.float(), dim=-1)
            assert cos.min() > 0.999
            top1 = (t["topk_ids"][a:b, 0].long() == ref.topk_ids[:, 0].long()).float().mean()
            assert top1 > 0.9
            checked += 1
    assert checked == 4


def test_reply_contract_stop_token_and_length():
    assert reply_ids([5, 6, STOP], "stop", [STOP], 6) == [5, 6, STOP]
    assert reply_ids([5, 6], "stop", [STOP], 6) == [5, 6, STOP]  # a server that leaves the stop token out
    assert reply_ids([5, 6, 7], "length", [STOP], 3) == [5, 6, 7]
    with pytest.raises(Eagle3Error, match="max_model_len"):
        reply_ids([5], "length", [STOP], 3)
    with pytest.raises(Eagle3Error, match="4 tokens for max_tokens=3"):
        reply_ids([5, 6, 7, 8], "length", [STOP], 3)


def test_no_server_and_two_urls_are_clear_errors(tiny_target_dir, tmp_path):
    with pytest.raises(Eagle3Error, match="no vLLM server answers /health"):
        run_extract(_cfg(tiny_target_dir, tmp_path, "http://127.0.0.1:9", connect_timeout_s=0.5))
    cfg = _cfg(tiny_target_dir, tmp_path, None, baseline_url="http://127.0.0.1:9")
    with pytest.raises(Eagle3Error, match="engine.url=http://HOST:PORT"):
        run_extract(cfg)


def test_a_server_serving_another_model_name_is_named(tiny_target_dir, tmp_path, fake_vllm):
    url, _ = fake_vllm
    with pytest.raises(Eagle3Error, match=r"serves \['target'\].*engine.served_model_name=target"):
        run_extract(_cfg(tiny_target_dir, tmp_path, url, served_model_name="smol"))


# ------------------------------------------------------------------ capture on the server
def _answer(seq, k, vocab=50, seed=0):
    """A capture answer shaped like vLLM 0.32's: prompt_logprobs (None first, then per
    position a dict id -> {logprob, rank} with the k best and the actual token), and the
    generated token's top_logprobs keyed "token_id:N"; plus the dense log-probs it came from."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(len(seq), vocab, generator=g), -1)
    prompt_lp = [None]
    for t in range(1, len(seq)):
        row = logp[t - 1]
        order = sorted(range(vocab), key=lambda i: (-row[i].item(), i))
        entry = {str(i): {"logprob": row[i].item(), "rank": r + 1} for r, i in enumerate(order[:k])}
        actual = seq[t]
        entry.setdefault(str(actual), {"logprob": row[actual].item(), "rank": order.index(actual) + 1})
        prompt_lp.append(entry)
    last = logp[len(seq) - 1]
    order = sorted(range(vocab), key=lambda i: (-last[i].item(), i))
    top = {f"token_id:{i}": last[i].item() for i in order[:k]}
    answer = {"choices": [{"token_ids": [order[0]], "prompt_logprobs": prompt_lp,
                           "logprobs": {"top_logprobs": [top], "tokens": [f"token_id:{order[0]}"]}}],
              "kv_transfer_params": {"hidden_states_path": None}}
    return answer, logp


def test_server_capture_answer_parses_to_the_dense_top_k_at_every_position():
    from eagle3.engines.vllm.capture import parse_capture

    seq, k = [5, 9, 3, 3, 17, 2], 4
    answer, logp = _answer(seq, k)
    hs = torch.randn(len(seq), 3, 8).to(torch.bfloat16)
    cap = parse_capture(answer, seq, {"hidden_states": hs, "token_ids": torch.tensor(seq)}, k, 3, 8)
    assert torch.equal(cap.aux_hidden_states, hs)
    ref_lp, ref_ids = logp.topk(k, dim=-1)  # position t: the distribution of token t + 1
    assert torch.equal(cap.topk_ids, ref_ids.to(torch.int32))
    assert torch.allclose(cap.topk_logprobs, ref_lp, atol=1e-6)
    assert cap.topk_ids.dtype == torch.int32 and cap.topk_logprobs.dtype == torch.float32


def test_server_capture_refuses_other_tokens_shapes_and_missing_logprobs():
    from eagle3.engines.vllm.capture import parse_capture, read_hidden_states

    seq, k = [5, 9, 3], 2
    answer, _ = _answer(seq, k)
    ok = {"hidden_states": torch.zeros(3, 3, 8), "token_ids": torch.tensor(seq)}
    with pytest.raises(Eagle3Error, match="other tokens"):
        parse_capture(answer, seq, dict(ok, token_ids=torch.tensor([5, 9, 4])), k, 3, 8)
    with pytest.raises(Eagle3Error, match=r"expected \[3, 3, 8\]"):
        parse_capture(answer, seq, dict(ok, hidden_states=torch.zeros(3, 2, 8)), k, 3, 8)
    del answer["choices"][0]["prompt_logprobs"]
    with pytest.raises(Eagle3Error, match="--max-logprobs 2"):
        parse_capture(answer, seq, ok, k, 3, 8)
    with pytest.raises(Eagle3Error, match="no hidden_states_path"):
        read_hidden_states({"choices": []})


def test_a_written_hidden_states_file_is_read_after_its_lock_and_removed(tmp_path):
    from safetensors.torch import save_file

    from eagle3.engines.vllm.capture import read_hidden_states

    path = tmp_path / "req-1.safetensors"
    save_file({"hidden_states": torch.ones(2, 3, 4), "token_ids": torch.tensor([1, 2])}, str(path))
    (tmp_path / "req-1.safetensors.lock").write_text("")
    got = read_hidden_states({"kv_transfer_params": {"hidden_states_path": str(path)}})
    assert got["token_ids"].tolist() == [1, 2] and got["hidden_states"].shape == (2, 3, 4)
    assert not path.exists() and not (tmp_path / "req-1.safetensors.lock").exists()


def test_capture_server_launch_flags_name_the_aux_ids_and_the_cpu_connector(tmp_path):
    from eagle3.engines.vllm.capture import PLUGIN_DIR, capture_speculative_config, kv_transfer_config

    spec = capture_speculative_config([2, 15, 27])
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    cpu = kv_transfer_config(tmp_path, "cpu")
    assert cpu["kv_connector"] == "CPUHiddenStatesConnector" and cpu["kv_role"] == "kv_producer"
    assert (PLUGIN_DIR / f"{cpu['kv_connector_module_path']}.py").is_file()
    assert kv_transfer_config(tmp_path, "cuda")["kv_connector"] == "ExampleHiddenStatesConnector"


def test_a_generation_requests_hidden_states_file_is_discarded(tmp_path):
    from eagle3.engines.vllm.capture import discard_hidden_states

    path = tmp_path / "gen-1.safetensors"
    path.write_bytes(b"x")
    (tmp_path / "gen-1.safetensors.lock").write_text("")
    discard_hidden_states({"choices": [], "kv_transfer_params": {"hidden_states_path": str(path)}})
    assert list(tmp_path.iterdir()) == []
    discard_hidden_states({"choices": []})  # a plain server's answer: nothing to do
    discard_hidden_states([{"choices": []}, {"kv_transfer_params": None}])
