"""engine=vllm against real vLLM servers (slow: two servers start, 2-4 minutes each on a CPU).

Skipped unless ``EAGLE3_VLLM_PYTHON`` names the python of a vLLM installation. The target
is the W4A16 SmolLM2-135M-Instruct built by ``eagle3.target.resolve_target``; the
drafter is an untrained one exported for vLLM (its acceptance is whatever it is: the
test checks that the counters come back and add up, and that speculative greedy output
equals the baseline's, which holds for any drafter). ``EAGLE3_VLLM_PORT`` (default 8180)
and the next port are used.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from eagle3.config import VLLMEngineConfig
from eagle3.engines.vllm import spec_counters, speculative_config, start_vllm
from eagle3.export import export_vllm, read_vllm_export
from eagle3.train.drafter import DrafterArch, Eagle3Drafter

PY = os.environ.get("EAGLE3_VLLM_PYTHON")
pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(not PY, reason="set EAGLE3_VLLM_PYTHON to vLLM's python to run live vLLM tests"),
]
ROOT = Path(__file__).resolve().parents[1]
PORT = int(os.environ.get("EAGLE3_VLLM_PORT", "8180"))
PROMPTS = ["What is 2+2? Answer briefly.", "Name three colours.", "Write a haiku about rain."]


@pytest.fixture(scope="module")
def target():
    from hydra import compose, initialize_config_dir

    from eagle3.target import load_tokenizer, resolve_target

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="evaluate", overrides=["model=smollm2-135m-int4"])
    cache = str(ROOT / "data" / "models")
    info = resolve_target(cfg.model, cache)
    return info, load_tokenizer(cfg.model, cache, info)


def _drafter_export(info, out):
    torch.manual_seed(0)
    arch = DrafterArch(hidden_size=info.hidden_size, num_attention_heads=info.num_attention_heads,
                       num_key_value_heads=info.num_key_value_heads, head_dim=info.head_dim,
                       intermediate_size=info.intermediate_size, num_layers=1, target_hidden_size=info.hidden_size,
                       vocab_size=info.vocab_size, draft_vocab_size=info.vocab_size)
    d = Eagle3Drafter(arch)
    d.set_draft_vocab(torch.zeros(info.vocab_size, dtype=torch.int64), torch.ones(info.vocab_size, dtype=torch.bool))
    meta = {"target": {"name": info.name, "architecture": info.architecture}, "aux_layer_ids": info.aux_layer_ids}
    return export_vllm(d.eval(), out, meta)


def test_speculative_greedy_equals_baseline_and_counters_add_up(tmp_path, target):
    from eagle3.engines.vllm import VLLMClient
    from eagle3.target import render_prompt

    info, tok = target
    export = _drafter_export(info, tmp_path / "export" / "vllm")
    assert read_vllm_export(export).written_aux_ids == info.aux_layer_ids
    e = VLLMEngineConfig(python=PY, port=PORT, max_num_seqs=4, launch_timeout_s=1200)
    started = []
    try:
        for i, spec in enumerate((None, speculative_config(str(export.resolve()), 3))):  # both start at once
            proc, _ = start_vllm(e, model_path=str(info.path), dtype="bfloat16", seed=0, port=PORT + i,
                                 run_dir=tmp_path, name=f"s{i}", speculative=spec)
            started.append(proc)
        for proc in started:
            proc.wait_healthy(e.launch_timeout_s, e.health_poll_s)
        base, spec = (VLLMClient(p.url) for p in started)
        assert not spec_counters(base.metrics_text()).present
        for text in PROMPTS:
            body = {"model": e.served_model_name, "prompt": render_prompt(tok, [{"role": "user", "content": text}]),
                    "max_tokens": 32, "temperature": 0.0, "stop_token_ids": [tok.eos_token_id]}
            a = base.complete(body)
            before = spec_counters(spec.metrics_text())
            b = spec.complete(body)
            delta = spec_counters(spec.metrics_text()) - before
            assert b.output_ids == a.output_ids
            assert delta.present and delta.drafts > 0
            assert delta.draft_tokens == 3 * delta.drafts
            assert sum(delta.per_position) == delta.accepted
            # one token from the prefill, then 1 + accepted per verify pass (max_tokens may cut the last one short)
            assert b.completion_tokens <= 1 + delta.drafts + delta.accepted
            assert b.completion_tokens >= delta.drafts
    finally:
        for p in started:
            p.stop()
