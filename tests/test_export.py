"""SGLang export: strict schema, round trip, aux-id mapping; speculators (vLLM) export."""

import json

import pytest
import torch
from safetensors import safe_open

from eagle3.model.drafter import DrafterArch, Eagle3Drafter
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


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def engine_draft_step(w: dict, ids, hidden, engine: str, layers: int, arch=ARCH):
    """One draft forward over ``ids [T]`` / fused ``hidden [T, H]`` as SGLang's or vLLM's
    ``llama_eagle3.py`` computes it from the exported file ``w`` (written independently of
    eagle3.model.drafter): fused residual-add norms, layer 0 on ``cat(embeds, hidden)``, a
    later layer's input norm read from ``hidden_norm`` (SGLang) or ``input_layernorm`` (vLLM).
    Returns (logits over the draft vocabulary [T, Vd], the pre-norm hidden state fed back [T, H])."""
    T, nh, nkv, hd = ids.shape[0], arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    pos = torch.arange(T, dtype=torch.float32)
    inv = 1.0 / arch.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)  # [T, hd]

    def rope(x):  # [heads, T, hd]
        half = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], dim=-1)
        return x * ang.cos() + half * ang.sin()

    def attn(p, x):
        q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(T, nh, hd).transpose(0, 1))
        k = rope((x @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd).transpose(0, 1))
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, hd).transpose(0, 1)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        s = (q @ k.transpose(1, 2)) / hd ** 0.5 + torch.full((T, T), float("-inf")).triu(1)
        return (s.softmax(-1) @ v).transpose(0, 1).reshape(T, nh * hd) @ w[p + "self_attn.o_proj.weight"].T

    def mlp(p, x):
        g, u = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        return (torch.nn.functional.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T

    embeds = w["embed"][ids]
    residual = hidden
    x = torch.cat([_rms(embeds, w["midlayer.input_layernorm.weight"]), _rms(hidden, w["midlayer.hidden_norm.weight"])], -1)
    residual = attn("midlayer.", x) + residual
    out = mlp("midlayer.", _rms(residual, w["midlayer.post_attention_layernorm.weight"]))
    for i in range(1, layers):
        p = f"layers.{i}."
        residual = out + residual
        norm = w.get(p + ("hidden_norm.weight" if engine == "sglang" else "input_layernorm.weight"), torch.ones(arch.hidden_size))
        residual = attn(p, _rms(residual, norm)) + residual
        out = mlp(p, _rms(residual, w[p + "post_attention_layernorm.weight"]))
    residual = out + residual
    return _rms(residual, w["norm.weight"]) @ w["lm_head.weight"].T, residual


@pytest.mark.parametrize("layers", [2, 3])
def test_multi_layer_export_is_the_drafter_both_engines_compute(tmp_path, layers):
    arch = DrafterArch(**{**ARCH.__dict__, "num_layers": layers})
    m = trained_like_drafter(arch)
    out = export_sglang(m, tmp_path / "e", meta_for(), dtype=torch.float32)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        w = {k: f.get_tensor(k) for k in f.keys()}
    later = {k for k in w if k.startswith("layers.")}
    assert later == {f"layers.{i}.{n}" for i in range(1, layers) for n in (
        "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
        "mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
        "self_attn.v_proj.weight", "self_attn.o_proj.weight")}
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == layers
    w["embed"] = m.embed_tokens.weight.detach()
    T = 6
    ids, aux = torch.randint(0, ARCH.vocab_size, (T,)), torch.randn(T, 3 * ARCH.target_hidden_size)
    with torch.no_grad():
        hidden = aux @ w["fc.weight"].T
        got = m(ids[None], m.fuse(aux[None]), torch.arange(T)[None])
        for engine in ("sglang", "vllm"):
            logits, h = engine_draft_step(w, ids, hidden, engine, layers, arch)
            torch.testing.assert_close(got.logits[0], logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got.hidden_states[0], h, atol=1e-4, rtol=1e-4)
        # without the second name SGLang would run layer 1 on a norm of ones: another drafter
        bad = {k: v for k, v in w.items() if k != "layers.1.hidden_norm.weight"}
        assert not torch.allclose(engine_draft_step(bad, ids, hidden, "sglang", layers, arch)[0], got.logits[0],
                                  atol=1e-4, rtol=1e-4)
    loaded, _ = load_sglang_export(out, m.embed_tokens.weight.detach())
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids[None], loaded.fuse(aux[None]), torch.arange(T)[None]).logits, got.logits,
                                   atol=0, rtol=0)
    # two copies that disagree are refused: the two engines would serve different drafters
    w.pop("embed")
    w["layers.1.hidden_norm.weight"] = w["layers.1.hidden_norm.weight"] * 1.5
    from safetensors.torch import save_file
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(Eagle3Error, match="layers.1.input_layernorm.weight and layers.1.hidden_norm.weight differ"):
        load_sglang_export(out)
    del w["layers.1.hidden_norm.weight"]
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(Eagle3Error, match="lacks .*layers.1.hidden_norm.weight"):
        load_sglang_export(out)


def test_export_refusals_and_own_embeddings(tmp_path):
    with pytest.raises(Eagle3Error, match="aux_layer_ids"):
        export_sglang(trained_like_drafter(), tmp_path / "x", {"target": {"architecture": "llama"}})
    # a weight dtype no engine loads is refused before anything is written (no staging folder left)
    with pytest.raises(Eagle3Error, match="torch.bfloat16, torch.float16, torch.float32, not torch.int8"):
        export_sglang(trained_like_drafter(), tmp_path / "i8", meta_for(), dtype=torch.int8)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # a drafter narrower than the target ships its own embedding table
    narrow = Eagle3Drafter(DrafterArch(**{**ARCH.__dict__, "hidden_size": 16, "head_dim": 4}))
    out = export_sglang(narrow, tmp_path / "n", meta_for())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("embed_tokens.weight").get_shape() == [96, 16]
        assert f.get_slice("fc.weight").get_shape() == [16, 96]
    loaded, _ = load_sglang_export(out)
    assert torch.equal(loaded.embed_tokens.weight, narrow.embed_tokens.weight.bfloat16())
    # a NaN in an ordinary weight is named, not loaded (an engine would serve it)
    from safetensors.torch import load_file, save_file

    w = load_file(str(out / "model.safetensors"))
    w["midlayer.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(Eagle3Error, match=r"midlayer\.mlp\.down_proj\.weight hold NaN or infinity"):
        load_sglang_export(out)
    # a broken export is refused with the difference named
    (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(Eagle3Error, match="LlamaForCausalLMEagle3"):
        load_sglang_export(out)


@pytest.mark.parametrize("layers", [1, 2])
def test_speculators_export_loads_in_speculators_with_same_logits(tmp_path, layers):
    from eagle3.export.speculators import speculators_available

    if not speculators_available():
        pytest.skip("speculators is not installed (.ci/run installs it)")
    from transformers import LlamaConfig, LlamaForCausalLM
    from speculators.models.eagle3 import Eagle3DraftModel

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=10,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                          tie_word_embeddings=False))
    target.save_pretrained(tmp_path / "target")
    arch = DrafterArch(**{**ARCH.__dict__, "num_layers": layers})
    m = trained_like_drafter(arch)
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
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == layers
    rounded = trained_like_drafter(arch).to(torch.bfloat16).float()
    with torch.no_grad():
        rounded.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        ref(aux, x, document_ids=torch.zeros(1, T, dtype=torch.long), ttt_steps=1)
        ours = rounded(x, rounded.fuse(aux), torch.arange(T)[None]).logits
    # speculators' default flex attention (unfused on CPU) sums in another order
    torch.testing.assert_close(captured[0], ours, atol=1e-4, rtol=1e-4)


def test_hand_edited_multi_layer_exports_are_refused_before_any_weight_loads(tmp_path):
    """What the readers without weights (served evaluation, the doctor) must refuse, each in one
    sentence: differing or non-finite norm copies, 'model.' prefixes an engine would not read,
    a layer count that disagrees with config.json, a missing layer count (the engines' default
    is 32), and config flags only some engines act on."""
    from safetensors.torch import load_file, save_file

    from eagle3.export import export_vllm, read_sglang_export, read_vllm_export
    from eagle3.export.validate import engine_norm_alias

    assert engine_norm_alias("layers.1.input_layernorm.weight") == "layers.1.hidden_norm.weight"
    for name in ("layers.0.input_layernorm.weight", "layers.\u00b2.input_layernorm.weight",
                 "layers.1.input_layernorm.bias", "midlayer.input_layernorm.weight"):
        assert engine_norm_alias(name) is None, name
    m = trained_like_drafter(DrafterArch(**{**ARCH.__dict__, "num_layers": 2}))

    def edited(reader, export, tensors=None, config=None):
        out = export(m, tmp_path / "e", meta_for())
        w = load_file(str(out / "model.safetensors"))
        save_file(tensors(w) if tensors else w, str(out / "model.safetensors"))
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
        return lambda: reader(out)

    def scaled(w, k="layers.1.hidden_norm.weight", by=2.0):
        return {**w, k: w[k] * by}

    for reader, export in ((read_sglang_export, export_sglang), (read_vllm_export, export_vllm)):
        edited(reader, export)()  # as written: accepted
        with pytest.raises(Eagle3Error, match="input_layernorm.weight and layers.1.hidden_norm.weight differ"):
            edited(reader, export, scaled)()
        with pytest.raises(Eagle3Error, match="hold NaN or inf"):
            edited(reader, export, lambda w: scaled(scaled(w, by=float("nan")), "layers.1.input_layernorm.weight",
                                                    float("nan")))()
        with pytest.raises(Eagle3Error, match=r"holds decoder layers \[0, 1\] but config.json has num_hidden_layers=200"):
            edited(reader, export, config=lambda c: {**c, "num_hidden_layers": 200})()
        with pytest.raises(Eagle3Error, match="lacks the field 'num_hidden_layers'"):
            edited(reader, export, config=lambda c: {k: v for k, v in c.items() if k != "num_hidden_layers"})()
        for flag, value in (("norm_before_residual", True), ("logit_scale", 2.0), ("fc_norm", True)):
            with pytest.raises(Eagle3Error, match=f"sets {flag}={value}, which this project's drafter does not compute"):
                edited(reader, export, config=lambda c: {**c, flag: value})()
        edited(reader, export, config=lambda c: {**c, "logit_scale": 1.0, "norm_output": False})()
    # 'model.' prefixes: vLLM adds its own (model.model.* fails to load); SGLang skips model.lm_head silently
    prefixed = lambda w: {("model." + k if k.startswith("layers.1.") else k): v for k, v in w.items()}  # noqa: E731
    with pytest.raises(Eagle3Error, match=r"model.layers.1.\S+ has a 'model.' prefix \(vLLM's loader"):
        edited(read_vllm_export, export_vllm, prefixed)()
    edited(read_sglang_export, export_sglang, prefixed)()  # SGLang finds model.layers.1.* in its parameters
    with pytest.raises(Eagle3Error, match="model.lm_head.weight has a 'model.' prefix .*name it lm_head.weight"):
        edited(read_sglang_export, export_sglang, lambda w: {("model." + k if k == "lm_head.weight" else k): v
                                                             for k, v in w.items()})()
