"""SGLang export: strict schema, round trip, aux-id mapping; speculators (vLLM) export."""

import json

import pytest
import torch
from safetensors import safe_open

from eagle3.train.drafter import DrafterArch, Eagle3Drafter
from eagle3.errors import Eagle3Error
from eagle3.export import export_sglang, export_speculators, load_sglang_export
from eagle3.target import default_aux_layer_ids

ARCH = DrafterArch(
    hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
    num_layers=1, target_hidden_size=32, vocab_size=96, draft_vocab_size=40,
    rms_norm_eps=1e-6, rope_theta=50000.0, max_position_embeddings=512,
)


def trained_like_drafter(arch=ARCH, seed=0):
    torch.manual_seed(seed)
    m = Eagle3Drafter(arch)
    ids = torch.sort(torch.randperm(arch.vocab_size)[: arch.draft_vocab_size]).values
    t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    m.set_draft_vocab(ids - torch.arange(arch.draft_vocab_size), t2d)
    with torch.no_grad():
        m.embed_tokens.weight.normal_()
        for n, p in m.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return m.eval()


def meta_for(arch_family="llama", aux=(2, 5, 8)):
    return {
        "target": {"name": "tiny", "content_hash": "sha256:abc", "quantization": {"method": "w4a16"},
                   "architecture": arch_family},
        "chat_template_hash": "sha256:def",
        "aux_layer_ids": list(aux),
        "features_dir": "data/features/tiny/x",
        "features_manifest_sha256": "0" * 64,
        "ttt_steps": 3,
    }


SGLANG_TENSORS = {  # name -> shape, for ARCH (H=32, heads 4x8, kv 2x8, ffn 48, Vd 40, V 96)
    "fc.weight": (32, 96),
    "midlayer.input_layernorm.weight": (32,),
    "midlayer.hidden_norm.weight": (32,),
    "midlayer.self_attn.q_proj.weight": (32, 64),
    "midlayer.self_attn.k_proj.weight": (16, 64),
    "midlayer.self_attn.v_proj.weight": (16, 64),
    "midlayer.self_attn.o_proj.weight": (32, 32),
    "midlayer.post_attention_layernorm.weight": (32,),
    "midlayer.mlp.gate_proj.weight": (48, 32),
    "midlayer.mlp.up_proj.weight": (48, 32),
    "midlayer.mlp.down_proj.weight": (32, 48),
    "norm.weight": (32,),
    "lm_head.weight": (40, 32),
    "d2t": (40,),
    "t2d": (96,),
}


def test_sglang_export_strict_schema(tmp_path):
    m = trained_like_drafter()
    out = export_sglang(m, tmp_path / "sglang", meta_for())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "eagle3_meta.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        got = {k: (tuple(f.get_slice(k).get_shape()), f.get_tensor(k).dtype) for k in f.keys()}
        assert set(got) == set(SGLANG_TENSORS)  # no embeddings: hidden sizes match
        for k, shape in SGLANG_TENSORS.items():
            assert got[k][0] == shape, k
            want = {"d2t": torch.int64, "t2d": torch.bool}.get(k, torch.bfloat16)
            assert got[k][1] == want, k
        assert torch.equal(f.get_tensor("d2t"), m.d2t) and torch.equal(f.get_tensor("t2d"), m.t2d)
        assert torch.equal(f.get_tensor("midlayer.hidden_norm.weight"), m.layers[0].hidden_norm.weight.bfloat16())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0, "rope_scaling": None, "max_position_embeddings": 512,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "vocab_size": 96, "draft_vocab_size": 40, "target_hidden_size": 32, "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 7], "use_aux_hidden_state": True},
    }
    meta = json.loads((out / "eagle3_meta.json").read_text())
    assert meta["aux_layer_ids"] == [2, 5, 8] and meta["sglang_aux_layer_ids"] == [1, 4, 7]
    for k in ("target", "chat_template_hash", "features_dir", "features_manifest_sha256", "draft_vocab_size", "ttt_steps"):
        assert k in meta, k
    assert meta["target"]["content_hash"] == "sha256:abc" and meta["target"]["quantization"] == {"method": "w4a16"}


def test_round_trip_reproduces_logits(tmp_path):
    m = trained_like_drafter()
    embed = m.embed_tokens.weight.detach().clone()
    T = 7
    ids = torch.randint(0, ARCH.vocab_size, (2, T))
    aux = torch.randn(2, T, 3 * ARCH.target_hidden_size)
    pos = torch.arange(T).expand(2, T)
    # float32 on disk: the loaded drafter is the same function
    loaded, meta = load_sglang_export(export_sglang(m, tmp_path / "f32", meta_for(), dtype=torch.float32), embed)
    with torch.no_grad():
        ref = m(ids, m.fuse(aux), pos).logits
        torch.testing.assert_close(loaded(ids, loaded.fuse(aux), pos).logits, ref, atol=0, rtol=0)
    assert torch.equal(loaded.t2d, m.t2d) and torch.equal(loaded.draft_to_target(torch.arange(40)), m.draft_ids())
    assert meta["aux_layer_ids"] == [2, 5, 8]
    # bf16 on disk (what ships): equals the drafter rounded to bf16
    loaded, _ = load_sglang_export(export_sglang(m, tmp_path / "bf16", meta_for()), embed)
    assert loaded.fc.weight.dtype == torch.bfloat16
    rounded = trained_like_drafter().to(torch.bfloat16)
    with torch.no_grad():
        a = loaded(ids, loaded.fuse(aux.bfloat16()), pos).logits
        b = rounded(ids, rounded.fuse(aux.bfloat16()), pos).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    # ... and loaded in float32 (faster on CPU) it is the bf16-rounded weights in float32
    loaded32, _ = load_sglang_export(tmp_path / "bf16", embed, dtype=torch.float32)
    rounded32 = rounded.float()
    with torch.no_grad():
        rounded32.embed_tokens.weight.copy_(embed)  # the target's table, not a bf16 copy
        torch.testing.assert_close(loaded32(ids, loaded32.fuse(aux), pos).logits,
                                   rounded32(ids, rounded32.fuse(aux), pos).logits, atol=0, rtol=0)
    # re-export into the same folder replaces it
    export_sglang(trained_like_drafter(seed=1), tmp_path / "bf16", meta_for())
    loaded2, _ = load_sglang_export(tmp_path / "bf16", embed)
    assert not torch.equal(loaded2.fc.weight, loaded.fc.weight)


def sglang_capture_rule(written_ids, family):
    """SGLang's rule, as in srt/models/llama.py and srt/models/deepseek_v2.py:
    the server captures the residual entering layer i for i in layers_to_capture."""
    if family == "llama":
        return [v + 1 for v in written_ids]
    return [v + 1 for v in written_ids] if written_ids[0] == 1 else list(written_ids)


@pytest.mark.parametrize("family,num_layers", [("llama", 30), ("deepseek_v2", 61), ("llama", 12)])
def test_exported_aux_ids_capture_the_extraction_layers(tmp_path, family, num_layers):
    hf_ids = default_aux_layer_ids(num_layers)  # what extraction captured (HF output_hidden_states)
    out = export_sglang(trained_like_drafter(), tmp_path / "e", meta_for(family, hf_ids))
    written = json.loads((out / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert sglang_capture_rule(written, family) == hf_ids
    assert load_sglang_export(out)[1]["aux_layer_ids"] == hf_ids
    if family == "deepseek_v2":  # non-default ids on deepseek: written as given (first id != 1)
        out = export_sglang(trained_like_drafter(), tmp_path / "d", meta_for(family, [3, 30, 58]))
        written = json.loads((out / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        assert sglang_capture_rule(written, family) == [3, 30, 58]


def test_export_refusals_and_own_embeddings(tmp_path):
    two = Eagle3Drafter(DrafterArch(**{**ARCH.__dict__, "num_layers": 2}))
    with pytest.raises(Eagle3Error, match="exactly one decoder layer"):
        export_sglang(two, tmp_path / "x", meta_for())
    with pytest.raises(Eagle3Error, match="aux_layer_ids"):
        export_sglang(trained_like_drafter(), tmp_path / "x", {"target": {"architecture": "llama"}})
    # a drafter narrower than the target ships its own embedding table
    narrow = Eagle3Drafter(DrafterArch(**{**ARCH.__dict__, "hidden_size": 16, "head_dim": 4}))
    out = export_sglang(narrow, tmp_path / "n", meta_for())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("embed_tokens.weight").get_shape() == [96, 16]
        assert f.get_slice("fc.weight").get_shape() == [16, 96]
    loaded, _ = load_sglang_export(out)
    assert torch.equal(loaded.embed_tokens.weight, narrow.embed_tokens.weight.bfloat16())
    # a broken export is refused with the difference named
    (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(Eagle3Error, match="LlamaForCausalLMEagle3"):
        load_sglang_export(out)


def test_speculators_export_loads_in_speculators_with_same_logits(tmp_path):
    pytest.importorskip("speculators")
    from transformers import LlamaConfig, LlamaForCausalLM
    from speculators.models.eagle3 import Eagle3DraftModel

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=10,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                          tie_word_embeddings=False))
    target.save_pretrained(tmp_path / "target")
    m = trained_like_drafter()
    with torch.no_grad():
        m.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    meta = meta_for()
    meta["target"]["path"] = str(tmp_path / "target")
    out = export_speculators(m, tmp_path / "speculators", meta, ttt_steps=3)
    assert (out / "config.json").exists() and (out / "eagle3_meta.json").exists()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 5, 8]
    assert cfg["draft_vocab_size"] == 40 and cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    ref = Eagle3DraftModel.from_pretrained(str(out)).float().eval()
    assert torch.equal(ref.d2t, m.d2t)
    captured = []
    ref.lm_head.register_forward_hook(lambda mod, i, o: captured.append(o))
    T = 8
    x = torch.randint(0, 96, (1, T))
    aux = torch.randn(1, T, 96)
    rounded = trained_like_drafter().to(torch.bfloat16).float()
    with torch.no_grad():
        rounded.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        ref(aux, x, document_ids=torch.zeros(1, T, dtype=torch.long), ttt_steps=1)
        ours = rounded(x, rounded.fuse(aux), torch.arange(T)[None]).logits
    # speculators' default flex attention (unfused on CPU) sums in another order
    torch.testing.assert_close(captured[0], ours, atol=1e-4, rtol=1e-4)
