"""The EAGLE-3 drafter: semantics against a from-scratch reference, KV cache, masks,
parity with speculators' Eagle3DraftModel (when installed)."""

import math

import pytest
import torch
from transformers import DynamicCache

from eagle3.model.drafter import DrafterArch, Eagle3Drafter
from eagle3.train.ttt import ttt_forward

ARCH = DrafterArch(
    hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
    num_layers=1, target_hidden_size=32, vocab_size=96, draft_vocab_size=40,
    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
)


def make_drafter(arch=ARCH, seed=0):
    torch.manual_seed(seed)
    m = Eagle3Drafter(arch)
    with torch.no_grad():
        m.embed_tokens.weight.normal_()
        for n, p in m.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)  # non-trivial norm weights so a swapped norm shows
    return m.eval()


# ------------------------------------------------------------------ reference
def ref_rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def ref_rope(x, pos, theta):  # x [T, h, d], rotate-half convention
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]  # [T, d/2]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_forward(m, ids, hidden, pos):
    """EAGLE-3 drafter written out from the paper / SGLang semantics, float64, B=1."""
    a = m.arch
    P = {k: v.double() for k, v in m.state_dict().items() if v.is_floating_point()}
    L = "layers.0."
    e = P["embed_tokens.weight"][ids]  # [T, H]
    h = hidden.double()
    x = torch.cat([ref_rms(e, P[L + "input_layernorm.weight"], a.rms_norm_eps),
                   ref_rms(h, P[L + "hidden_norm.weight"], a.rms_norm_eps)], -1)  # [T, 2H]
    T = ids.shape[0]
    q = (x @ P[L + "self_attn.q_proj.weight"].T).view(T, a.num_attention_heads, a.head_dim)
    k = (x @ P[L + "self_attn.k_proj.weight"].T).view(T, a.num_key_value_heads, a.head_dim)
    v = (x @ P[L + "self_attn.v_proj.weight"].T).view(T, a.num_key_value_heads, a.head_dim)
    q, k = ref_rope(q, pos, a.rope_theta), ref_rope(k, pos, a.rope_theta)
    rep = a.num_attention_heads // a.num_key_value_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(a.head_dim)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, -1) @ P[L + "self_attn.o_proj.weight"].T
    r = h + o  # residual = fused hidden before its norm
    y = ref_rms(r, P[L + "post_attention_layernorm.weight"], a.rms_norm_eps)
    g, u = y @ P[L + "mlp.gate_proj.weight"].T, y @ P[L + "mlp.up_proj.weight"].T
    out = r + (torch.nn.functional.silu(g) * u) @ P[L + "mlp.down_proj.weight"].T
    logits = ref_rms(out, P["norm.weight"], a.rms_norm_eps) @ P["lm_head.weight"].T
    return logits, out


def test_forward_matches_from_scratch_reference():
    m = make_drafter()
    T = 9
    ids = torch.randint(0, ARCH.vocab_size, (1, T))
    aux = torch.randn(1, T, 3 * ARCH.target_hidden_size)
    pos = torch.arange(3, 3 + T)[None]
    with torch.no_grad():
        fused = m.fuse(aux)
        out = m(ids, fused, pos)
    ref_logits, ref_h = reference_forward(m, ids[0], fused[0], pos[0])
    assert out.logits.shape == (1, T, ARCH.draft_vocab_size)
    torch.testing.assert_close(out.logits[0].double(), ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.hidden_states[0].double(), ref_h, atol=1e-4, rtol=1e-4)
    # fc is a bias-free 3*Ht -> H projection
    torch.testing.assert_close(fused, aux @ m.fc.weight.T)


def test_incremental_cache_equals_full_pass_and_crop_rolls_back():
    m = make_drafter()
    T = 10
    ids = torch.randint(0, ARCH.vocab_size, (2, T))
    h = torch.randn(2, T, ARCH.hidden_size)
    pos = torch.arange(T).expand(2, T)
    with torch.no_grad():
        full = m(ids, h, pos)
        cache = DynamicCache()
        a = m(ids[:, :4], h[:, :4], pos[:, :4], past_key_values=cache)
        b = m(ids[:, 4:7], h[:, 4:7], pos[:, 4:7], past_key_values=cache)
        c = m(ids[:, 7:], h[:, 7:], pos[:, 7:], past_key_values=cache)
        torch.testing.assert_close(torch.cat([a.logits, b.logits, c.logits], 1), full.logits)
        # roll back the last 6 rows, then extend with other inputs: equals a fresh pass
        cache.crop(-6)
        assert cache.get_seq_length() == 4
        h2 = torch.randn(2, 6, ARCH.hidden_size)
        d = m(ids[:, 4:], h2, pos[:, 4:], past_key_values=cache)
        fresh = m(ids, torch.cat([h[:, :4], h2], 1), pos)
        torch.testing.assert_close(d.logits, fresh.logits[:, 4:])
        # use_cache=True creates a cache
        assert m(ids, h, pos, use_cache=True).past_key_values.get_seq_length() == T


def test_explicit_tree_mask_equals_separate_chains():
    """Tree after a 5-token prefix: A, B (child of A), C (sibling of A)."""
    m = make_drafter()
    P = 5
    ids = torch.randint(0, ARCH.vocab_size, (1, P + 3))
    h = torch.randn(1, P + 3, ARCH.hidden_size)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 5]])  # A at 5, B at 6, C at 5
    with torch.no_grad():
        cache = DynamicCache()
        m(ids[:, :P], h[:, :P], pos[:, :P], past_key_values=cache)
        mask = torch.zeros(1, 1, 3, P + 3, dtype=torch.bool)
        mask[..., :P] = True
        mask[0, 0, 0, P] = True  # A: itself
        mask[0, 0, 1, [P, P + 1]] = True  # B: A, itself
        mask[0, 0, 2, P + 2] = True  # C: itself
        tree = m(ids[:, P:], h[:, P:], pos[:, P:], attention_mask=mask, past_key_values=cache)
        chain_ab = m(ids[:, : P + 2], h[:, : P + 2], pos[:, : P + 2])
        sel = [0, 1, 2, 3, 4, 7]
        chain_c = m(ids[:, sel], h[:, sel], pos[:, sel])
    torch.testing.assert_close(tree.logits[:, :2], chain_ab.logits[:, P:])
    torch.testing.assert_close(tree.logits[:, 2], chain_c.logits[:, P])
    # an explicit causal mask is the same as None
    T = P + 3
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        torch.testing.assert_close(m(ids, h, torch.arange(T)[None], attention_mask=causal).logits,
                                   m(ids, h, torch.arange(T)[None]).logits)


def test_frozen_target_embeddings_and_vocab_mapping():
    m = make_drafter()
    assert not m.embed_tokens.weight.requires_grad
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert "fc.weight" in trainable and "lm_head.weight" in trainable and "embed_tokens.weight" not in trainable
    ids = torch.tensor(sorted(torch.randperm(ARCH.vocab_size)[: ARCH.draft_vocab_size].tolist()))
    t2d = torch.zeros(ARCH.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    m.set_draft_vocab(ids - torch.arange(ARCH.draft_vocab_size), t2d)
    assert torch.equal(m.draft_to_target(torch.arange(ARCH.draft_vocab_size)), ids)
    target_head = torch.randn(ARCH.vocab_size, ARCH.hidden_size)
    m.init_from_target(torch.randn(ARCH.vocab_size, ARCH.hidden_size), target_head)
    assert torch.equal(m.lm_head.weight, target_head[ids])
    # other hidden size: own, trainable embedding table
    other = Eagle3Drafter(DrafterArch(**{**ARCH.__dict__, "hidden_size": 16, "head_dim": 4}))
    assert other.embed_tokens.weight.shape == (ARCH.vocab_size, 16) and other.embed_tokens.weight.requires_grad
    assert other.fc.weight.shape == (16, 3 * ARCH.target_hidden_size)


def test_parity_with_speculators_eagle3_draft_model():
    """Same weights, same inputs: per-step TTT logits equal speculators' (all rows)."""
    pytest.importorskip("speculators")
    from transformers import LlamaConfig
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    m = make_drafter()
    ids_vocab = torch.tensor(sorted(torch.randperm(ARCH.vocab_size)[: ARCH.draft_vocab_size].tolist()))
    t2d = torch.zeros(ARCH.vocab_size, dtype=torch.bool)
    t2d[ids_vocab] = True
    m.set_draft_vocab(ids_vocab - torch.arange(ARCH.draft_vocab_size), t2d)
    lc = LlamaConfig(
        hidden_size=ARCH.hidden_size, intermediate_size=ARCH.intermediate_size,
        num_attention_heads=ARCH.num_attention_heads, num_key_value_heads=ARCH.num_key_value_heads,
        head_dim=ARCH.head_dim, num_hidden_layers=1, vocab_size=ARCH.vocab_size,
        rms_norm_eps=ARCH.rms_norm_eps, rope_theta=ARCH.rope_theta,
        max_position_embeddings=ARCH.max_position_embeddings,
    )
    lc._attn_implementation = "sdpa"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=lc, draft_vocab_size=ARCH.draft_vocab_size,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    ref = Eagle3DraftModel(cfg).eval()
    missing, unexpected = ref.load_state_dict(m.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"verifier_lm_head.weight", "verifier_norm.weight"}
    captured = []
    ref.lm_head.register_forward_hook(lambda mod, inp, out: captured.append(out.detach()))

    T, J = 11, 3
    x = torch.randint(0, ARCH.vocab_size, (1, T))
    aux = torch.randn(1, T, 3 * ARCH.hidden_size)
    with torch.no_grad():
        # speculators' rows are pre-aligned: row t holds token t+1 (the last row is padding)
        x_shift = torch.cat([x[:, 1:], x.new_zeros(1, 1)], 1)
        ref(aux, x_shift, document_ids=torch.zeros(1, T, dtype=torch.long), ttt_steps=J)
        rows = [torch.arange(T)] * J
        batch = {"input_ids": x, "aux_hidden_states": aux, "rows": rows,
                 "target_ids": [torch.zeros(T, 1, dtype=torch.long)] * J, "target_q": [torch.ones(T, 1)] * J,
                 "chain_starts": torch.zeros(T, dtype=torch.bool), "num_chains": 0}
        ours = ttt_forward(m, batch, J, return_logits=True).logits
    assert len(captured) == J
    for j in range(J):
        # rows past T-1-j read padding tokens in both implementations (and carry no loss)
        n = T - 1 - j
        torch.testing.assert_close(ours[j][:n], captured[j][0, :n], atol=2e-5, rtol=2e-5)


def test_bf16_cast_keeps_rotary_frequencies_exact():
    m = make_drafter()
    ref = m.rotary_emb.inv_freq.clone()
    m = m.to(torch.bfloat16)
    assert m.fc.weight.dtype == torch.bfloat16 and m.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(m.rotary_emb.inv_freq, ref)  # a bf16 copy would shift far positions


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_grouped_query_attention_in_the_kernel_equals_repeated_keys(monkeypatch, device):
    """``GQA_IN_KERNEL``: SDPA's ``enable_gqa`` against ``repeat_kv`` copies, the reference
    from-scratch forward, and a training-time-test unroll's loss and gradients (float32); without
    autograd (decoding) the copies stay."""
    import benchmarks.train_throughput as bench
    import eagle3.model.drafter as drafter_module
    from eagle3.train.ttt import batch_to

    m = make_drafter().to(device)
    ids = torch.randint(0, ARCH.vocab_size, (1, 9), device=device)
    fused = torch.randn(1, 9, ARCH.hidden_size, device=device)
    pos = torch.arange(9, device=device)[None]
    batch = batch_to(bench.synthetic_batch(ARCH, 2, 24, 3, 0.6, top_k=5), torch.device(device))
    got = {}
    for on in (False, True):
        monkeypatch.setattr(drafter_module, "GQA_IN_KERNEL", on)
        m.zero_grad(set_to_none=True)
        logits = m(ids, fused, pos).logits[0].detach()  # autograd on: the path GQA_IN_KERNEL selects
        out = ttt_forward(m.train(), batch, 3)
        out.loss.backward()
        m.eval()
        got[on] = (logits, out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    calls = []
    real_sdpa = drafter_module.F.scaled_dot_product_attention
    monkeypatch.setattr(drafter_module.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(kw.get("enable_gqa", False)) or real_sdpa(*a, **kw))
    with torch.no_grad():
        m(ids, fused, pos)
    m(ids, fused, pos)
    assert calls == [False, True]
    ref_logits, _ = reference_forward(m.cpu(), ids[0].cpu(), fused[0].cpu(), pos[0].cpu())
    torch.testing.assert_close(got[True][0].double().cpu(), ref_logits, atol=1e-4, rtol=1e-4)
    tol = {"atol": 1e-6, "rtol": 1e-5} if device == "cpu" else {"atol": 2e-5, "rtol": 1e-4}  # other CUDA kernels
    torch.testing.assert_close(got[True][0], got[False][0], **tol)
    torch.testing.assert_close(got[True][1], got[False][1], **tol)
    assert got[True][2].keys() == got[False][2].keys() and len(got[True][2]) > 5
    for n in got[True][2]:
        torch.testing.assert_close(got[True][2][n], got[False][2][n], atol=tol["atol"], rtol=1e-4, msg=n)
