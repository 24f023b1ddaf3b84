"""The GQA decode attention (eagle3.engines.hf.attention) against independent references."""

import math

import pytest
import torch

from eagle3.engines.hf.attention import GQA_DECODE, gqa_decode_attention, register


class _Module:  # what transformers' sdpa path reads off an attention module
    def __init__(self, groups):
        self.num_key_value_groups = groups
        self.is_causal = True


def _reference(q, k, v, keep, scale):
    """Per query head, plain float64 attention over its kv head (h // groups)."""
    B, Hq, _, D = q.shape
    g = Hq // k.shape[1]
    out = torch.empty(B, 1, Hq, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            kk, vv = k[b, h // g].double(), v[b, h // g].double()  # [T, D]
            s = (kk @ q[b, h, 0].double()) * scale  # [T]
            s = s.masked_fill(~keep[b], -math.inf)
            out[b, 0, h] = torch.softmax(s, 0) @ vv
    return out


def test_decode_step_equals_per_head_reference_with_padding():
    torch.manual_seed(0)
    B, Hq, Hk, T, D = 3, 6, 2, 11, 8
    q, k, v = torch.randn(B, Hq, 1, D), torch.randn(B, Hk, T, D), torch.randn(B, Hk, T, D)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, :4] = False  # left padding of row 1
    keep[2, :10] = False  # row 2 sees only its last key
    out, weights = gqa_decode_attention(_Module(Hq // Hk), q, k, v, keep[:, None, None, :], scaling=0.3)
    assert weights is None and out.shape == (B, 1, Hq, D)
    torch.testing.assert_close(out.double(), _reference(q, k, v, keep, 0.3), rtol=1e-5, atol=1e-6)
    # a row that sees one key returns that key's value for every head of its group
    torch.testing.assert_close(out[2, 0, :3], v[2, 0, -1].expand(3, D))
    # no mask (no padding anywhere): every key is attended
    full, _ = gqa_decode_attention(_Module(Hq // Hk), q, k, v, None, scaling=0.3)
    torch.testing.assert_close(full.double(), _reference(q, k, v, torch.ones(B, T, dtype=torch.bool), 0.3),
                               rtol=1e-5, atol=1e-6)


def test_additive_mask_and_default_scale_match_sdpa():
    torch.manual_seed(1)
    B, Hq, Hk, T, D = 2, 4, 1, 7, 16
    q, k, v = torch.randn(B, Hq, 1, D), torch.randn(B, Hk, T, D), torch.randn(B, Hk, T, D)
    add = torch.zeros(B, 1, 1, T)
    add[0, ..., :3] = torch.finfo(torch.float32).min
    out, _ = gqa_decode_attention(_Module(Hq // Hk), q, k, v, add)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(Hq // Hk, 1), v.repeat_interleave(Hq // Hk, 1), attn_mask=add
    ).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_per_head_mask_is_passed_to_sdpa_unchanged():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(4)
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.rand(2, 4, 1, 6) > 0.3
    mask[..., -1] = True
    a, _ = gqa_decode_attention(_Module(2), q, k, v, mask)
    b, _ = sdpa_attention_forward(_Module(2), q, k, v, mask)
    assert torch.equal(a, b)


def test_prefill_is_passed_to_sdpa_unchanged():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(2)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mod = _Module(2)
    a, _ = gqa_decode_attention(mod, q, k, v, None, scaling=0.5)
    b, _ = sdpa_attention_forward(mod, q, k, v, None, scaling=0.5)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32])
def test_greedy_generation_equals_sdpa_on_a_tiny_llama(tiny_target_dir, dtype):
    """A whole batched, left-padded greedy generation: same tokens as transformers' sdpa (float32)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=dtype, attn_implementation="sdpa").eval()
    torch.manual_seed(3)
    ids = torch.randint(10, 1000, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    gen = GenerationConfig(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        want = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
        model.set_attn_implementation(register())
        assert model.config._attn_implementation == GQA_DECODE
        got = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
    assert torch.equal(got, want)
