"""The EAGLE-3 drafter (architecture only).

One Llama decoder layer whose attention reads the concatenation of the token
embedding and the fused target features (EAGLE-3, Li et al. 2025, arXiv 2503.01840):

* row ``t`` gets the embedding of token ``t+1`` (the target's own embedding table,
  frozen) and ``fc(concat(aux_low, aux_mid, aux_high))`` of the target's aux hidden
  states at ``t`` (``fc``: ``3*H_target -> H``, no bias);
* first layer: ``input_layernorm`` on the embedding, ``hidden_norm`` on the fused
  hidden, concatenated to ``2H`` for the q/k/v projections; the residual is the fused
  hidden *before* its norm; then ``post_attention_layernorm``, SwiGLU MLP, residual.
  Further layers (``num_layers > 1``) are plain pre-norm Llama layers;
* ``logits = lm_head(norm(h))`` over the draft vocabulary; ``h`` (before ``norm``) is
  what the next training-time-test step or draft step feeds back as its hidden input.

Parameter names follow SGLang's ``LlamaForCausalLMEagle3``
(``python/sglang/srt/models/llama_eagle3.py``) except that layer 0 is ``layers.0``
here and ``midlayer`` in an export (see :mod:`eagle3.export.sglang`). Rotary embedding,
RMSNorm, MLP and ``apply_rotary_pos_emb`` are transformers' Llama building blocks;
attention is ``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from eagle3.gqa import can_fold, folded_gqa_sdpa

#: in training (autograd on), grouped-query attention inside SDPA (``enable_gqa``) instead of
#: ``repeat_kv`` copies of the keys and values, which the backward pass would keep: the same
#: attention (``tests/test_drafter.py``, CPU and CUDA). Timed on one H100 for the Kimi-K2.5-shaped
#: drafter (``benchmarks/train_throughput.py --gqa both``): the same step time (ratio 0.986 and
#: 0.997) and 3.0 GB less peak memory (docs/performance.md). Decoding (no autograd: the copies
#: are transient) keeps the kernels its speed was measured with.
GQA_IN_KERNEL = True


@dataclass
class DrafterArch:
    """Sizes of an EAGLE-3 drafter.

    Attributes:
        hidden_size: drafter width ``H``.
        num_attention_heads, num_key_value_heads, head_dim: attention shape (GQA).
        intermediate_size: SwiGLU width.
        num_layers: decoder layers (1 in EAGLE-3; SGLang's and vLLM's loaders take more,
            see :mod:`eagle3.export.sglang`).
        target_hidden_size: ``H_target``; ``fc`` maps ``3*H_target -> H``.
        vocab_size: the target's vocabulary ``V`` (embedding rows, ``t2d`` length).
        draft_vocab_size: ``Vd``, rows of ``lm_head``.
        rms_norm_eps, rope_theta, max_position_embeddings: as in the target's config.
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    target_hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    def llama_config(self) -> LlamaConfig:
        """The equivalent ``LlamaConfig`` (feeds the transformers building blocks)."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=self.num_layers,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
        )

    @property
    def shares_target_embeddings(self) -> bool:
        """True when the drafter uses the target's (frozen) embedding table as is."""
        return self.hidden_size == self.target_hidden_size


@dataclass
class DrafterOutput:
    """What :meth:`Eagle3Drafter.forward` returns.

    Attributes:
        logits: ``[B, T, Vd]`` in the compute dtype (bf16 under autocast; cast to
            float32 before any softmax), or ``None`` when not requested.
        hidden_states: ``[B, T, H]``, decoder output before the final norm (fed back
            at the next TTT / draft step).
        past_key_values: the updated ``DynamicCache`` (``None`` without caching).
    """

    logits: Optional[torch.Tensor]
    hidden_states: torch.Tensor
    past_key_values: Optional[DynamicCache]


class DrafterAttention(nn.Module):
    """Grouped-query self-attention with rotary positions and an optional KV cache.

    ``in_features`` is ``2H`` in the first layer (embedding ++ hidden) and ``H`` after.

    Attributes:
        fold_gqa: without autograd (draft steps), attend with the query heads folded into the
            query axis (:func:`eagle3.gqa.folded_gqa_sdpa`) instead of ``repeat_kv`` copies,
            where it applies; the same attention. A class default, set per module by
            :func:`eagle3.gqa.fold_drafter_attention`.
    """

    fold_gqa = False

    def __init__(self, arch: DrafterArch, in_features: int, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, arch.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        past_key_values: Optional[DynamicCache],
    ) -> torch.Tensor:
        """``x [B, T, in_features]`` -> ``[B, T, H]``; ``cos``/``sin`` ``[B, T, head_dim]``;
        ``attention_mask`` as in :meth:`Eagle3Drafter.forward` (None = causal over cache + new rows;
        an object with an ``attend(q, k, v, rep)`` method, such as the training-time test's
        :class:`eagle3.train.ttt_attention.ChainMask`, computes the attention itself from the un-repeated
        ``[B, kv, S, d]`` keys and values); ``past_key_values`` is extended in place with this
        layer's keys and values."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, h, T, d]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, kv, T, d]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos.to(q.dtype), sin.to(q.dtype))
        past = 0
        if past_key_values is not None:
            past = past_key_values.get_seq_length(self.layer_idx)
            k, v = past_key_values.update(k, v, self.layer_idx)  # [B, kv, past+T, d]
        S = k.shape[2]
        rep = self.num_heads // self.num_kv_heads
        if hasattr(attention_mask, "attend"):  # a structured mask computes the attention itself
            out = attention_mask.attend(q, k, v, rep)  # [B, h, T, d]
            return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))
        is_causal = False
        if attention_mask is None and T > 1:
            if past == 0:
                is_causal = True
            else:  # causal with a prefix: query i sits at absolute index past+i
                q_abs = torch.arange(past, past + T, device=x.device)
                attention_mask = (torch.arange(S, device=x.device)[None, :] <= q_abs[:, None])[None, None]
        if GQA_IN_KERNEL and rep > 1 and torch.is_grad_enabled():  # kv head h // rep for query head h
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=is_causal, enable_gqa=True)
        elif self.fold_gqa and rep > 1 and not is_causal and can_fold(q, k, attention_mask):  # draft steps
            out = folded_gqa_sdpa(q, k, v, attention_mask)  # [B, h, T, d], no repeat_kv copies
        else:
            k, v = repeat_kv(k, rep), repeat_kv(v, rep)  # [B, h, S, d] (every SDPA kernel accepts it)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=is_causal)  # [B, h, T, d]
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(out)  # [B, T, H]


class Eagle3FirstLayer(nn.Module):
    """The EAGLE-3 decoder layer: attention over ``[norm(embed), norm(hidden)]`` (2H)."""

    def __init__(self, arch: DrafterArch, cfg: LlamaConfig):
        super().__init__()
        H = arch.hidden_size
        self.input_layernorm = LlamaRMSNorm(H, eps=arch.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=arch.rms_norm_eps)
        self.self_attn = DrafterAttention(arch, 2 * H, layer_idx=0)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=arch.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, embeds, hidden, cos, sin, attention_mask, past_key_values):
        """``embeds [B, T, H]`` (token embeddings), ``hidden [B, T, H]`` (fused target features or
        the previous draft step's output) -> ``[B, T, H]``."""
        residual = hidden  # the fused hidden before its norm (as SGLang)
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        h = residual + self.self_attn(x, cos, sin, attention_mask, past_key_values)
        return h + self.mlp(self.post_attention_layernorm(h))  # [B, T, H]


class DrafterLayer(nn.Module):
    """A plain pre-norm Llama decoder layer (drafter layers after the first)."""

    def __init__(self, arch: DrafterArch, cfg: LlamaConfig, layer_idx: int):
        super().__init__()
        H = arch.hidden_size
        self.input_layernorm = LlamaRMSNorm(H, eps=arch.rms_norm_eps)
        self.self_attn = DrafterAttention(arch, H, layer_idx=layer_idx)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=arch.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, h, cos, sin, attention_mask, past_key_values):
        """``h [B, T, H]`` -> ``[B, T, H]``."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attention_mask, past_key_values)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter.

    Submodules: ``embed_tokens`` (``[V, H]``, frozen copy of the target's table when
    ``H == H_target``, trainable otherwise), ``fc`` (``3*H_target -> H``), ``layers``,
    ``norm``, ``lm_head`` (``H -> Vd``), ``rotary_emb``. Buffers: ``d2t`` ``[Vd]``
    int64 offsets (target id = ``i + d2t[i]``) and ``t2d`` ``[V]`` bool (target id is
    in the draft vocabulary). Until :meth:`set_draft_vocab` the draft vocabulary is
    the first ``Vd`` target ids.
    """

    def __init__(self, arch: DrafterArch):
        super().__init__()
        if arch.draft_vocab_size > arch.vocab_size:
            raise ValueError(f"draft_vocab_size {arch.draft_vocab_size} exceeds vocab_size {arch.vocab_size}")
        self.arch = arch
        cfg = arch.llama_config()
        H = arch.hidden_size
        self.embed_tokens = nn.Embedding(arch.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(not arch.shares_target_embeddings)
        self.fc = nn.Linear(3 * arch.target_hidden_size, H, bias=False)
        self.layers = nn.ModuleList(
            [Eagle3FirstLayer(arch, cfg)] + [DrafterLayer(arch, cfg, i) for i in range(1, arch.num_layers)]
        )
        self.norm = LlamaRMSNorm(H, eps=arch.rms_norm_eps)
        self.lm_head = nn.Linear(H, arch.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(cfg)
        self.register_buffer("d2t", torch.zeros(arch.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
        t2d[: arch.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.reset_parameters()

    # ------------------------------------------------------------------ setup
    def _apply(self, fn, recurse=True):
        # ``.to(bfloat16)`` would round the rotary frequencies too (positions drift);
        # keep them in float32 as servers do, whatever dtype the weights take.
        super()._apply(fn, recurse)
        rot = self.rotary_emb
        inv = rot.compute_default_rope_parameters(rot.config)[0].to(rot.inv_freq.device)
        rot.inv_freq = inv
        rot.original_inv_freq = inv.clone()
        return self

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Llama-style init: linear weights ~ N(0, std), norms 1 (embeddings untouched)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std)
            elif isinstance(m, LlamaRMSNorm):
                m.weight.fill_(1.0)

    @torch.no_grad()
    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary (``d2t [Vd]`` int64 offsets, ``t2d [V]`` bool)."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocab shapes {tuple(d2t.shape)}/{tuple(t2d.shape)} do not fit this drafter")
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    @torch.no_grad()
    def init_from_target(self, embed: torch.Tensor, lm_head: Optional[torch.Tensor] = None) -> None:
        """Copy the target's embedding table ``[V, H]``; with ``lm_head`` ``[V, H]`` also
        initialise ``lm_head`` from the target head's rows of the draft vocabulary."""
        if self.arch.shares_target_embeddings:
            self.embed_tokens.weight.copy_(embed)
        if lm_head is not None:
            if lm_head.shape[1] != self.arch.hidden_size:
                raise ValueError("lm_head init from the target needs hidden_size == target hidden size")
            self.lm_head.weight.copy_(lm_head[self.draft_ids()])

    def draft_ids(self) -> torch.Tensor:
        """``[Vd]`` int64: the target id of every draft id."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft ids (any shape, int64) to target ids: ``i + d2t[i]``."""
        return draft_ids + self.d2t[draft_ids]

    # ---------------------------------------------------------------- forward
    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """``[B, T, 3*H_target]`` (low ++ mid ++ high aux states) -> ``[B, T, H]``."""
        return self.fc(aux_hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` decoder output -> ``[..., Vd]`` draft logits (``lm_head(norm(h))``)."""
        return self.lm_head(self.norm(hidden_states))

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[DynamicCache] = None,
        use_cache: bool = False,
        return_logits: bool = True,
    ) -> DrafterOutput:
        """One drafter pass.

        Args:
            input_ids: ``[B, T]`` int64 target ids; row ``t`` holds token ``t+1`` of the
                sequence the hidden states belong to.
            hidden_states: ``[B, T, H]``, fused target features (:meth:`fuse`) or the
                drafter's own previous output.
            position_ids: ``[B, T]`` int64 rotary positions.
            attention_mask: ``None`` = causal over cache + new rows; else ``[B|1, 1, T, S]``
                bool, True = attend, ``S`` = cached length + ``T`` (tree drafting, TTT), or
                a structured mask that attends itself (:class:`eagle3.train.ttt_attention.ChainMask`).
            past_key_values: a ``DynamicCache`` extended in place with this call's keys
                and values (roll back with ``crop``).
            use_cache: create a new cache when ``past_key_values`` is None.
            return_logits: compute ``lm_head(norm(h))`` for every row.

        Returns:
            :class:`DrafterOutput`.
        """
        if past_key_values is None and use_cache:
            past_key_values = DynamicCache()
        embeds = self.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = self.rotary_emb(hidden_states, position_ids)  # [B, T, head_dim] each
        h = self.layers[0](embeds.to(hidden_states.dtype), hidden_states, cos, sin, attention_mask, past_key_values)
        for layer in self.layers[1:]:
            h = layer(h, cos, sin, attention_mask, past_key_values)
        logits = self.compute_logits(h) if return_logits else None
        return DrafterOutput(logits=logits, hidden_states=h, past_key_values=past_key_values)
