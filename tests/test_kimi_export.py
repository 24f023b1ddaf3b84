"""The full-size Kimi-K2.5 drafter's export, planned on the meta device: every tensor name and
shape against what SGLang's and vLLM's EAGLE-3 loaders read for a DeepseekV3 target.

The expected table is written out by hand from SGLang's ``srt/models/llama_eagle3.py``
(``fc`` [H, 3 * target_H]; ``midlayer.*``, renamed to ``layers.0.*`` by its loader, q/k/v and
gate/up stacked there; the q/k/v projections read ``2 * H``, the token embedding and the
hidden state side by side; ``lm_head`` [draft_V, H]; ``d2t`` [draft_V] int64 offsets; ``t2d``
[V] bool, kept though SGLang ignores it; no ``embed_tokens`` when ``target_hidden_size ==
hidden_size``: the target's is shared) and vLLM's ``llama_eagle3.py`` (the same names; this
project's exports of them are served by vLLM's CPU build in the live tier). The aux ids: SGLang's ``deepseek_v2.py`` adds 1 only when the first id
is 1, so ``[1, 29, 57]`` captures HF ``[2, 30, 58]``, the ids SpecForge's DeepSeek-V3 config
writes (``configs/deepseek-v3-671b-eagle3.json``)."""

import torch

H, TH, V, VD, HEADS, KV, HD, FFN = 7168, 7168, 163840, 32000, 64, 8, 128, 18432
DRAFTER = [f"drafter.num_attention_heads={HEADS}", f"drafter.num_key_value_heads={KV}", f"drafter.head_dim={HD}",
           f"drafter.intermediate_size={FFN}"]
EXPECTED = {
    "fc.weight": ((H, 3 * TH), torch.bfloat16),
    "midlayer.input_layernorm.weight": ((H,), torch.bfloat16),
    "midlayer.hidden_norm.weight": ((H,), torch.bfloat16),
    "midlayer.self_attn.q_proj.weight": ((HEADS * HD, 2 * H), torch.bfloat16),
    "midlayer.self_attn.k_proj.weight": ((KV * HD, 2 * H), torch.bfloat16),
    "midlayer.self_attn.v_proj.weight": ((KV * HD, 2 * H), torch.bfloat16),
    "midlayer.self_attn.o_proj.weight": ((H, HEADS * HD), torch.bfloat16),
    "midlayer.post_attention_layernorm.weight": ((H,), torch.bfloat16),
    "midlayer.mlp.gate_proj.weight": ((FFN, H), torch.bfloat16),
    "midlayer.mlp.up_proj.weight": ((FFN, H), torch.bfloat16),
    "midlayer.mlp.down_proj.weight": ((H, FFN), torch.bfloat16),
    "norm.weight": ((H,), torch.bfloat16),
    "lm_head.weight": ((VD, H), torch.bfloat16),
    "d2t": ((VD,), torch.int64),
    "t2d": ((V,), torch.bool),
}


def _kimi_drafter():
    from hydra import compose, initialize_config_dir

    from eagle3.cli import to_typed
    from eagle3.target import resolve_target
    from eagle3.model.drafter import Eagle3Drafter
    from eagle3.train.settings import drafter_arch
    from test_cli import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = to_typed(compose("train", ["model=kimi-k25-int4", f"drafter.draft_vocab_size={VD}"] + DRAFTER))
    target = resolve_target(cfg.model, "unused-cache")  # hub-only: nothing is read or downloaded
    arch = drafter_arch(target, cfg.drafter, draft_vocab_size=VD)
    with torch.device("meta"):
        return Eagle3Drafter(arch), target


def test_the_kimi_drafter_exports_every_tensor_sglang_and_vllm_read_with_their_shapes():
    from eagle3.export.sglang import _engine_state_dict, sglang_config
    from eagle3.export.validate import expected_shapes
    from eagle3.target import to_engine_ids

    drafter, target = _kimi_drafter()
    assert target.hidden_size == TH and target.vocab_size == V and target.aux_layer_ids == [2, 30, 58]
    for convention in ("sglang", "vllm"):
        sd = _engine_state_dict(drafter, torch.bfloat16, convention)
        assert {k: (tuple(t.shape), t.dtype) for k, t in sd.items()} == EXPECTED, convention
    # the project's own export reader expects the same shapes for this config
    assert {k: tuple(v) for k, v in expected_shapes(drafter.arch).items() if k in EXPECTED} == {
        k: s for k, (s, _) in EXPECTED.items() if k in expected_shapes(drafter.arch)}
    trained = sum(t.numel() for k, t in _engine_state_dict(drafter, torch.bfloat16, "sglang").items()
                  if k not in ("d2t", "t2d"))
    assert trained == (H * 3 * TH + (HEADS * HD + 2 * KV * HD) * 2 * H + H * HEADS * HD + 3 * FFN * H + VD * H + 4 * H)
    ids = to_engine_ids(target.aux_layer_ids, "sglang", target.architecture)
    cfg = sglang_config(drafter.arch, ids, torch.bfloat16)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    # vLLM's deepseek_v2.py collects the residual stream entering each listed layer: HF ids as they are
    assert to_engine_ids(target.aux_layer_ids, "vllm", target.architecture) == [2, 30, 58]
    assert (cfg["hidden_size"], cfg["target_hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"]) == (H, TH, V, VD)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (HEADS, KV, HD)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
