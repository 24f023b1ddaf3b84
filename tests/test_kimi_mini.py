"""model=kimi-k25-mini: the Kimi-K2.5-shaped test target built on first use (eagle3/target/kimi_mini.py).

Checked here: the three stages compose with it and it differs from conf/model/kimi-k25-int4.yaml
only in its size; the build is quick, atomic (build record) and gives the same bytes twice;
config.json carries Kimi's router and yarn rope and the fields SGLang's ``deepseek_v2.py`` reads;
transformers loads the folder with its own DeepseekV3 classes; the in-process hf engine captures
exactly HF ``output_hidden_states`` at the aux ids (and not at their neighbours); greedy text
differs between prompts and is no single repeated token.

The expected values are written out here from Kimi's config (384 experts, 8 per token, one group,
``noaux_tc``, ``sigmoid``, scaling 2.827; yarn factor 64 over 4096, theta 50000), not read from
the builder's constants.
"""

import dataclasses
import filecmp
import hashlib
import json
import math
import re
import time
from pathlib import Path

import pytest
import torch

from test_cli import CONF, _compose

MINI, KIMI = "kimi-k25-mini", "kimi-k25-int4"
ENGINE_HF = ["engine=hf", "engine.device=cpu"]
PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves.", "How do I sort a list in Python?"]
KIMI_ROUTER = {"n_routed_experts": 384, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
               "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
               "routed_scaling_factor": 2.827, "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1}
KIMI_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
MLA = {"num_attention_heads": 4, "q_lora_rank": 96, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
       "qk_nope_head_dim": 32, "v_head_dim": 32, "moe_intermediate_size": 32}


@pytest.fixture(scope="module")
def built(tmp_path_factory, one_thread):
    """``(cfg, cache_dir, TargetInfo, build seconds)``: the mini built into a fresh cache."""
    from eagle3.cli import to_typed
    from eagle3.target import resolve_target

    cfg = to_typed(_compose("extract", [f"model={MINI}"] + ENGINE_HF))
    cache = tmp_path_factory.mktemp("kimi_mini_cache")
    t0 = time.perf_counter()
    info = resolve_target(cfg.model, cache)
    return cfg, cache, info, time.perf_counter() - t0


@pytest.fixture(scope="module")
def engine(built):
    from eagle3.engines.hf.engine import HFEngine

    cfg, cache, _, _ = built
    eng = HFEngine.from_config(cfg.model, cfg.engine, cache)
    yield eng
    eng.close()


@pytest.mark.parametrize("stage", ["extract", "train", "evaluate"])
def test_every_stage_composes_with_the_mini_as_a_small_kimi(stage):
    from eagle3.cli import to_typed, unknown_override_key
    from eagle3.config import EvaluateConfig, ExtractConfig, TrainConfig
    from eagle3.target import default_aux_layer_ids, sglang_captured_ids, to_sglang_ids
    from test_cli import config_groups

    cfg = to_typed(_compose(stage, [f"model={MINI}"]))
    m = cfg.model
    assert (m.name, m.source, m.architecture, m.dtype) == (MINI, "builtin:kimi-k25-mini", "deepseek_v2", "bfloat16")
    assert (m.num_layers, m.hidden_size, m.vocab_size, m.trust_remote_code) == (8, 256, 49152, False)
    assert m.quantization.method == "none" and m.serve.tp == 1
    assert cfg.engine.name == "sglang"  # Kimi's engine, inherited
    assert to_typed(_compose(stage, [f"model={MINI}"] + ENGINE_HF)).engine.name == "hf"
    # the aux ids follow layers.py's default for 8 layers; SGLang's deepseek_v2 rule writes [1, 3, 4] for them
    assert list(m.aux_layer_ids) == default_aux_layer_ids(8) == [2, 4, 5]
    assert to_sglang_ids([2, 4, 5], "deepseek_v2") == [1, 3, 4]
    assert sglang_captured_ids([1, 3, 4], "deepseek_v2") == [2, 4, 5]
    # the check before Hydra sees the engine the mini selects (engine.url is an sglang setting)
    schema = {"extract": ExtractConfig, "train": TrainConfig, "evaluate": EvaluateConfig}[stage]
    url = "engine.baseline_url=http://h:1" if stage == "evaluate" else "engine.url=http://h:1"
    assert unknown_override_key([f"model={MINI}", url], schema, config_groups(CONF, stage), CONF) is None


def _flat(obj, prefix=""):
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out.update(_flat(v, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = v
    return out


def test_the_mini_differs_from_the_kimi_file_only_in_what_its_size_needs():
    """Composed from kimi-k25-int4.yaml: every other field, and the engine, are Kimi's."""
    from eagle3.cli import to_typed

    for stage in ("extract", "train", "evaluate"):
        mini, kimi = (to_typed(_compose(stage, [f"model={n}"])) for n in (MINI, KIMI))
        a, b = _flat(mini.model), _flat(kimi.model)
        assert a.keys() == b.keys()
        differ = {k for k in a if a[k] != b[k]}
        assert differ == {"name", "source", "num_layers", "hidden_size", "vocab_size", "aux_layer_ids",
                          "trust_remote_code", "quantization.method", "quantization.prequantized", "serve.tp"}
        assert (a["architecture"], a["serve.reasoning_parser"], a["serve.tool_call_parser"]) == (
            "deepseek_v2", "kimi_k2", "kimi_k2")
        assert mini.engine == kimi.engine


def test_the_build_is_quick_recorded_and_gives_the_same_bytes_twice(built, tmp_path):
    from eagle3.errors import Eagle3Error
    from eagle3.target import resolve_target
    from eagle3.target.kimi_mini import builtin_folder

    cfg, _, info, seconds = built
    assert seconds < 60, f"the first build took {seconds:.1f} s"
    folder = Path(info.path)
    assert folder.name == "kimi-k25-mini-bfloat16"
    assert info.build and "builtin:kimi-k25-mini" in info.build["what"]  # eagle3_build.json of _atomic_build
    weights = sorted(p.name for p in folder.iterdir() if p.suffix == ".safetensors")
    assert weights == ["model.safetensors"]
    h = hashlib.sha256(b"model.safetensors\0" + (folder / "model.safetensors").read_bytes()).hexdigest()
    assert info.content_hash == f"sha256:{h}"
    again = resolve_target(cfg.model, tmp_path)  # a second build, into another cache
    assert Path(again.path) != folder and again.content_hash == info.content_hash
    assert filecmp.cmp(folder / "model.safetensors", Path(again.path) / "model.safetensors", shallow=False)
    assert json.loads((folder / "config.json").read_text()) == json.loads((Path(again.path) / "config.json").read_text())
    assert not list(tmp_path.glob(".kimi-k25-mini-bfloat16.tmp-*"))  # the temporary folder was renamed away
    with pytest.raises(Eagle3Error, match="names no builtin target; use one of builtin:kimi-k25-mini"):
        builtin_folder(dataclasses.replace(cfg.model, source="builtin:kimi-k3"), tmp_path)


def test_config_json_carries_kimis_router_and_rope_and_the_fields_sglang_reads(built):
    from safetensors import safe_open

    _, _, info, _ = built
    cfg = json.loads((Path(info.path) / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
    assert "auto_map" not in cfg  # transformers' own classes: no remote code
    assert {k: cfg[k] for k in KIMI_ROUTER} == KIMI_ROUTER
    assert cfg["num_experts_per_tok"] == 8 and cfg["n_routed_experts"] in (128, 256, 384)  # SGLang's CPU router
    assert {k: cfg[k] for k in MLA} == MLA and cfg["num_key_value_heads"] == 4
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (8, 256, 49152)
    # what SGLang's deepseek_v2.py reads (transformers 4 config style) next to transformers 5's rope_parameters
    assert cfg["rope_theta"] == 50000.0 and cfg["rope_scaling"] == KIMI_YARN
    assert cfg["max_position_embeddings"] == 262144 and cfg["torch_dtype"] == "bfloat16"
    assert cfg["num_nextn_predict_layers"] == 0 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["tie_word_embeddings"] is False and "head_dim" not in cfg
    # SGLang's layer rule (layer_id >= first_k_dense_replace and layer_id % moe_layer_freq == 0) names
    # exactly the layers whose checkpoint holds the router and 384 experts
    with safe_open(str(Path(info.path) / "model.safetensors"), framework="pt") as fh:
        keys = set(fh.keys())
        bias_dtype = fh.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype
        embed_dtype = fh.get_tensor("model.embed_tokens.weight").dtype
    moe = [i for i in range(8) if i >= cfg["first_k_dense_replace"] and i % cfg["moe_layer_freq"] == 0]
    assert moe == [1, 2, 3, 4, 5, 6, 7]
    for i in range(8):
        experts = {int(m.group(1)) for k in keys if (m := re.match(rf"model\.layers\.{i}\.mlp\.experts\.(\d+)\.", k))}
        assert experts == (set(range(384)) if i in moe else set()), i
        assert (f"model.layers.{i}.mlp.gate.e_score_correction_bias" in keys) == (i in moe)
        assert (f"model.layers.{i}.mlp.gate_proj.weight" in keys) == (i not in moe)
    assert bias_dtype == torch.float32 and embed_dtype == torch.bfloat16


def test_transformers_loads_the_folder_with_its_own_deepseek_v3(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, _, info, _ = built
    model, loading = AutoModelForCausalLM.from_pretrained(info.path, dtype=torch.bfloat16, output_loading_info=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not any(loading[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), loading
    rope = model.config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["rope_theta"] == 50000.0
    assert {k: rope[k] for k in KIMI_YARN if k != "type"} == {k: v for k, v in KIMI_YARN.items() if k != "type"}
    # DeepSeek's yarn softmax scale, as SGLang computes it: qk_head_dim^-0.5 * (0.1 ln(factor) + 1)^2
    want = (32 + 16) ** -0.5 * (0.1 * math.log(64.0) + 1.0) ** 2
    assert model.model.layers[3].self_attn.scaling == pytest.approx(want, rel=1e-6)
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"
    assert all(type(model.model.layers[i].mlp).__name__ == "DeepseekV3MoE" for i in range(1, 8))
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0  # the noaux_tc bias is used
    tok = AutoTokenizer.from_pretrained(info.path)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template


def test_the_hf_engine_captures_exactly_the_hidden_states_the_aux_ids_name(built, engine):
    """As measured against SGLang on the Kimi path: cosine 1.0 at the named layers, lower one off."""
    from transformers import AutoModelForCausalLM

    from eagle3.target import render_prompt

    _, _, info, _ = built
    model = AutoModelForCausalLM.from_pretrained(info.path, dtype=torch.bfloat16).eval()
    seqs = [render_prompt(engine.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS[:2]]
    caps = engine.capture(seqs, 4)
    for seq, cap in zip(seqs, caps):
        aux = cap.aux_hidden_states
        assert tuple(aux.shape) == (len(seq), 3, 256) and aux.dtype == torch.bfloat16
        with torch.inference_mode():
            out = model(torch.tensor([seq]), output_hidden_states=True)
        hs = [h[0] for h in out.hidden_states]  # 9 states: the embeddings, then each layer's output
        assert len(hs) == 9
        for j, k in enumerate([2, 4, 5]):
            assert torch.equal(aux[:, j], hs[k].to(torch.bfloat16)), k
            cos = [torch.nn.functional.cosine_similarity(aux[:, j].float(), hs[n].float(), dim=-1).mean().item()
                   for n in (k - 1, k, k + 1)]
            assert cos[1] > 0.99999 and cos[0] < 0.99 and cos[2] < 0.99, (k, cos)
        assert torch.equal(cap.topk_ids[:, 0].long(), out.logits[0].argmax(-1))


def test_greedy_text_differs_between_prompts_and_is_no_repeated_token(engine):
    from eagle3.config import SamplingConfig
    from eagle3.target import render_prompt

    prompts = [render_prompt(engine.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    outs = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=16))
    assert all(len(o) >= 8 for o in outs), [len(o) for o in outs]
    assert len({tuple(o) for o in outs}) == len(outs), outs
    assert all(len(set(o)) >= 4 for o in outs), outs
    again = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=16))
    assert again == outs  # greedy: the same text again
