"""Training-time test: loss rows, attention pattern, equivalence with chained drafting,
loss precision, simulated acceptance length."""

import math

import pytest
import torch
from transformers import DynamicCache

from eagle3.model.drafter import DrafterArch, Eagle3Drafter
from eagle3.train.noise import add_feature_noise
from eagle3.train.ttt import (
    TTTCollator,
    TTTModel,
    chain_acceptance,
    kl_loss,
    step_input_ids,
    summarize,
    target_distribution,
    target_to_draft_index,
    ttt_attention_mask,
    ttt_forward,
)

V, VD, H, K = 200, 50, 16, 3
ARCH = DrafterArch(hidden_size=H, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=24,
                   num_layers=1, target_hidden_size=H, vocab_size=V, draft_vocab_size=VD)
D2T = torch.zeros(VD, dtype=torch.int64)  # draft vocabulary = target ids 0..49
T2D_INDEX = target_to_draft_index(D2T, V)


def twelve_token_sample():
    T = 12
    g = torch.Generator().manual_seed(0)
    topk = torch.randint(0, VD, (T, K), generator=g, dtype=torch.int32)
    topk[9, 0] = 150  # the target's argmax at position 9 is outside the draft vocabulary
    return {
        "sample_id": "s",
        "input_ids": torch.arange(100, 100 + T, dtype=torch.int32),
        "loss_mask": torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.uint8),
        "aux_hidden_states": torch.randn(T, 3, H, generator=g).bfloat16(),
        "topk_ids": topk,
        "topk_logprobs": torch.log_softmax(torch.randn(T, K, generator=g), -1) - 0.1,
    }


def test_twelve_token_sample_loss_rows_and_attention():
    s = twelve_token_sample()
    b = TTTCollator(T2D_INDEX, ttt_steps=3, max_length=64)([s])
    # Row r of step j predicts x[r+2+j] from the target's top-k at p = r+1+j; it carries loss
    # iff loss_mask[r+2+j] = 1 (labels 3,4,5,6,9,10,11) and the argmax at p is in the draft
    # vocabulary (not p = 9):
    #   step 0: r+2 in labels -> r in {1,2,3,4,7,8,9}; p=9 is r=8            -> {1,2,3,4,7,9}
    #   step 1: r+3 in labels -> r in {0,1,2,3,6,7,8}; p=9 is r=7            -> {0,1,2,3,6,8}
    #   step 2: r+4 in labels -> r in {0,1,2,5,6,7};   p=9 is r=6            -> {0,1,2,5,7}
    assert b["rows_full"][0].tolist() == [1, 2, 3, 4, 7, 9]
    assert b["rows_full"][1].tolist() == [0, 1, 2, 3, 6, 8]
    assert b["rows_full"][2].tolist() == [0, 1, 2, 5, 7]
    # steps >= 1 run only on rows with loss at some later step; rows 4, 9, 10, 11 drop out
    assert b["chain_rows"][0].tolist() == [0, 1, 2, 3, 5, 6, 7, 8]
    assert b["rows"][0].tolist() == [1, 2, 3, 4, 7, 9]  # step 0: every row
    assert b["rows"][1].tolist() == [0, 1, 2, 3, 5, 7]  # slots of rows 0,1,2,3,6,8
    assert b["rows"][2].tolist() == [0, 1, 2, 4, 6]  # slots of rows 0,1,2,5,7
    # chains start wherever the first label is generated, in vocabulary or not (r=8 rejects)
    assert b["chain_starts"].nonzero().flatten().tolist() == [1, 2, 3, 4, 7, 8, 9]
    # the targets of step 1, row 6 are the top-k at p = 8
    torch.testing.assert_close(b["target_ids"][1][4], s["topk_ids"][8].long())
    # input tokens: row r of step j holds x[r+1+j]
    ids = b["input_ids"]
    assert step_input_ids(ids, 0)[0, :3].tolist() == [101, 102, 103]
    assert step_input_ids(ids, 2)[0, 0].item() == 103 and step_input_ids(ids, 2)[0, -3:].tolist() == [0, 0, 0]
    # attention: step j, row r sees step-0 keys of rows 0..r and the keys of steps 1..j at row r
    assert ttt_attention_mask(12, 0) is None  # step 0: plain causal
    m1, m2 = ttt_attention_mask(12, 1)[0, 0], ttt_attention_mask(12, 2)[0, 0]
    assert m1.shape == (12, 24) and m2.shape == (12, 36)
    assert m1[0].nonzero().flatten().tolist() == [0, 12]
    assert m1[5].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 17]
    assert m2[5].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 17, 29]
    assert m2[11].nonzero().flatten().tolist() == list(range(12)) + [23, 35]


def test_ttt_equals_chained_drafting_with_a_kv_cache():
    """Each TTT row reproduces drafting after token r at serving time: prefix pass over
    target features, then draft steps fed with the drafter's own hidden states."""
    torch.manual_seed(1)
    m = Eagle3Drafter(ARCH).eval()
    with torch.no_grad():
        m.embed_tokens.weight.normal_()
    s = twelve_token_sample()
    J, T = 3, 12
    b = TTTCollator(T2D_INDEX, ttt_steps=J, max_length=64)([s])
    del b["chain_rows"]  # every step on every row
    b["rows"] = [torch.arange(T)] * J  # logits of every row
    b["target_ids"] = [torch.zeros(T, 1, dtype=torch.long)] * J
    b["target_q"] = [torch.ones(T, 1)] * J
    with torch.no_grad():
        ttt = ttt_forward(m, b, J, return_logits=True).logits
        x = b["input_ids"]
        fused = m.fuse(b["aux_hidden_states"].float())
        for r in range(T - 1 - J):
            cache = DynamicCache()
            out = m(x[:, 1 : r + 2], fused[:, : r + 1], torch.arange(r + 1)[None], past_key_values=cache)
            torch.testing.assert_close(ttt[0][r], out.logits[0, -1], atol=1e-5, rtol=1e-5)
            h = out.hidden_states[:, -1:]
            for j in range(1, J):
                out = m(x[:, r + 1 + j : r + 2 + j], h, torch.tensor([[r + j]]), past_key_values=cache)
                torch.testing.assert_close(ttt[j][r], out.logits[0, -1], atol=1e-5, rtol=1e-5)
                h = out.hidden_states


def test_non_finite_check_agrees_with_isfinite_at_every_position_and_value():
    # the collator's aminmax check against the reference torch.isfinite(...).all(): one bad value
    # (NaN of either sign, +Inf, -Inf) at a random position, or none, in bf16 and float32 aux states
    g = torch.Generator().manual_seed(5)
    for trial in range(240):
        T = int(torch.randint(1, 300, (1,), generator=g))
        aux = torch.randn(T, 3, 16, generator=g).to(torch.bfloat16 if trial % 2 else torch.float32)
        kind = trial % 5
        if kind < 4:
            pos = int(torch.randint(0, aux.numel(), (1,), generator=g))
            aux.view(-1)[pos] = (float("nan"), float("inf"), float("-inf"), -float("nan"))[kind]
        sample = {"aux_hidden_states": aux, "topk_logprobs": torch.zeros(T, 4)}
        assert TTTCollator.is_finite(sample) == bool(torch.isfinite(aux).all()), (trial, kind)
    empty = {"aux_hidden_states": torch.zeros(0, 3, 16, dtype=torch.bfloat16), "topk_logprobs": torch.zeros(0, 4)}
    assert TTTCollator.is_finite(empty)
    # log-probs: NaN and +Inf are bad, -Inf (a token the target rules out) is not
    ok = {"aux_hidden_states": torch.zeros(2, 3, 16), "topk_logprobs": torch.tensor([[0.0, -float("inf")]] * 2)}
    assert TTTCollator.is_finite(ok)
    for v in (float("nan"), float("inf")):
        assert not TTTCollator.is_finite({**ok, "topk_logprobs": torch.tensor([[0.0, v]] * 2)})


def test_loss_is_weighted_mean_kl_and_batching_pads_right():
    torch.manual_seed(2)
    m = Eagle3Drafter(ARCH)
    s1, s2 = twelve_token_sample(), twelve_token_sample()
    for k in ("input_ids", "loss_mask", "aux_hidden_states", "topk_ids", "topk_logprobs"):
        s2[k] = s2[k][:8]
    s2["loss_mask"] = torch.ones(8, dtype=torch.uint8)
    bad = dict(twelve_token_sample(), sample_id="nan")
    bad["aux_hidden_states"] = bad["aux_hidden_states"].clone()
    bad["aux_hidden_states"][3, 1, 2] = float("nan")
    col = TTTCollator(T2D_INDEX, ttt_steps=3, max_length=64)
    b = col([s1, bad, s2])
    assert b["skipped_nonfinite"] == 1 and b["sample_ids"] == ["s", "s"] and b["num_tokens"] == 20
    assert b["input_ids"].shape == (2, 12) and b["input_ids"][1, 8:].eq(0).all()
    # sample 2 (length 8, all labels generated): step 2 rows 0..3, flat index 12 + r
    assert b["rows_full"][2][5:].tolist() == [12, 13, 14, 15]
    out = ttt_forward(m, b, 3, step_weight=0.8, return_logits=True)
    ref = sum(0.8**j * kl_loss(out.logits[j], b["target_ids"][j], b["target_q"][j]).mean() for j in range(3))
    torch.testing.assert_close(out.loss, ref)
    out.loss.backward()
    assert m.fc.weight.grad.abs().sum() > 0 and m.embed_tokens.weight.grad is None
    # a padded batch gives the same per-sample losses as the samples alone
    alone = ttt_forward(m, col([s2]), 3, return_logits=True)
    for j in range(3):
        n = alone.logits[j].shape[0]
        torch.testing.assert_close(out.logits[j][-n:], alone.logits[j], atol=1e-5, rtol=1e-5)


def test_a_micro_batch_without_a_loss_row_backpropagates_zero_gradients():
    """Every argmax outside the draft vocabulary: no row carries loss, the loss is exactly 0 and
    its backward runs (it raised 'does not require grad' before) and leaves zero gradients."""
    torch.manual_seed(3)
    m = Eagle3Drafter(ARCH)
    s = twelve_token_sample()
    s["topk_ids"] = torch.full_like(s["topk_ids"], 150)  # target ids >= 50: outside the draft vocabulary
    b = TTTCollator(T2D_INDEX, ttt_steps=3, max_length=64)([s])
    assert [r.numel() for r in b["rows_full"]] == [0, 0, 0]
    out = ttt_forward(m, b, 3)
    assert out.loss.item() == 0.0 and out.loss.requires_grad
    out.loss.backward()
    assert m.fc.weight.grad is not None and m.fc.weight.grad.abs().sum() == 0
    assert out.step_stats[:, 1].tolist() == [0.0, 0.0, 0.0]


def test_target_distribution_restricted_and_renormalised():
    t2d_index = torch.full((10,), -1, dtype=torch.int64)
    t2d_index[[5, 9]] = torch.tensor([0, 1])
    ids = torch.tensor([[5, 7, 9]])
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.1]]))
    d, q = target_distribution(ids, lp, t2d_index)
    torch.testing.assert_close(q, torch.tensor([[0.5 / 0.6, 0.0, 0.1 / 0.6]]))
    assert d.tolist() == [[0, 0, 1]]
    # KL is 0 when the drafter puts exactly q on those ids, positive otherwise
    logits = torch.tensor([[math.log(0.5 / 0.6), math.log(0.1 / 0.6), -1e4]])
    assert abs(kl_loss(logits, d, q).item()) < 1e-6
    assert kl_loss(torch.zeros(1, 3), d, q).item() > 0.1


def test_target_distribution_at_a_temperature_by_hand():
    """drafter.target_temperature: q_k ∝ p_k^(1/t) over the entries inside the draft vocabulary
    (t = 0.5 squares them: 0.5, 0.3 -> 0.25, 0.09, renormalised; t = 2 takes square roots), the
    order and the out-of-vocabulary zeros kept; t = 1 is the plain renormalisation."""
    t2d_index = torch.full((10,), -1, dtype=torch.int64)
    t2d_index[[5, 8]] = torch.tensor([0, 1])
    ids = torch.tensor([[5, 8, 9]])
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    _, q = target_distribution(ids, lp, t2d_index, temperature=0.5)
    torch.testing.assert_close(q, torch.tensor([[0.25 / 0.34, 0.09 / 0.34, 0.0]]))
    _, q = target_distribution(ids, lp, t2d_index, temperature=2.0)
    a, b = math.sqrt(0.5), math.sqrt(0.3)
    torch.testing.assert_close(q, torch.tensor([[a / (a + b), b / (a + b), 0.0]]))
    _, q1 = target_distribution(ids, lp, t2d_index, temperature=1.0)
    torch.testing.assert_close(q1, torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0]]))
    # through the collator: the same argmax ids, sharper q
    samples = [random_sample(23, 1, 4)]
    t2d = target_to_draft_index(D2T, V)
    b1 = TTTCollator(t2d, ttt_steps=2, max_length=64)(samples)
    bs = TTTCollator(t2d, ttt_steps=2, max_length=64, target_temperature=0.25)(samples)
    assert torch.equal(b1["target_ids"][0], bs["target_ids"][0])
    top1, tops = b1["target_q"][0].max(-1).values, bs["target_q"][0].max(-1).values
    assert bool((tops >= top1 - 1e-6).all()) and bool((tops > top1 + 1e-3).any())


def test_float32_loss_gradient_matches_float64_under_bf16_autocast():
    """Drafter ~ target: the gradient (p - q) is small, so precision matters."""
    torch.manual_seed(0)
    N, Hd, Vd, k = 64, 32, 1000, 20
    h = torch.randn(N, Hd)
    W = (torch.randn(Vd, Hd) * 1.5).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(h, W)  # bf16, as lm_head under autocast
    assert logits.dtype == torch.bfloat16
    l64 = logits.detach().double()
    ids = l64.topk(k, -1).indices
    lp = l64.log_softmax(-1).gather(-1, ids) + 1e-3 * torch.randn(N, k, dtype=torch.float64)
    q = (lp - lp.logsumexp(-1, keepdim=True)).exp()
    kl_loss(logits, ids, q.float()).mean().backward()
    ref = l64.clone().requires_grad_()
    (q * (q.log() - ref.log_softmax(-1).gather(-1, ids))).sum(-1).mean().backward()
    g_ref = ref.grad.T @ h.double()
    rel = ((W.grad.double() - g_ref).norm() / g_ref.norm()).item()
    assert rel < 0.01, rel
    # the same loss with a bf16 softmax is far off: the check above can fail
    W.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lb = torch.nn.functional.linear(h, W)
    qb = q.bfloat16()
    (qb * (qb.log() - lb.log_softmax(-1).gather(-1, ids))).sum(-1).mean().backward()
    assert ((W.grad.double() - g_ref).norm() / g_ref.norm()).item() > 0.05


def test_simulated_acceptance_length():
    hits = [torch.tensor([1, 1, 0, 1, 1], dtype=torch.bool),
            torch.tensor([1, 0, 1, 1, 1], dtype=torch.bool),
            torch.tensor([0, 1, 1, 1, 1], dtype=torch.bool)]
    starts = torch.tensor([1, 1, 1, 0, 1], dtype=torch.bool)
    acc = chain_acceptance(hits, starts)
    assert acc.tolist() == [2, 1, 0, 0, 3]
    stats = torch.tensor([[2.0, 4, 3], [1.0, 4, 2], [0.5, 2, 2]])
    m = summarize(stats, acc.sum().item(), int(starts.sum()), 0.8)
    assert m["tau"] == 1 + 6 / 4 and m["step_acc"] == [0.75, 0.5, 1.0]
    assert m["step_loss"] == [0.5, 0.25, 0.25] and abs(m["loss"] - (0.5 + 0.8 * 0.25 + 0.64 * 0.25)) < 1e-12


def test_serving_replay_starts_chains_where_a_speculative_decoder_does():
    """Hand-computed walks: a chain at row q with n accepted drafts emits n + 1 tokens and
    the next chain starts at row q + n + 1; the first chain of a reply x[P..E] (chain-start
    rows P-2 .. E-2) is at row P - 1."""
    from eagle3.train.replay import serving_replay

    T = 12
    starts = torch.zeros(2, T, dtype=torch.bool)
    acc = torch.zeros(2, T)
    # sample 0: one reply x[4..10] -> chain-start rows 2..8
    starts[0, 2:9] = True
    acc[0, 2:9] = torch.tensor([3.0, 1, 0, 3, 2, 0, 1])
    # sample 1: two replies -> rows 1..3 and 6..9
    starts[1, 1:4] = True
    starts[1, 6:10] = True
    acc[1, 1:4] = torch.tensor([3.0, 0, 2])
    acc[1, 6:10] = torch.tensor([3.0, 0, 1, 3])
    a, c = serving_replay(acc.flatten(), starts.flatten(), T)
    # sample 0: q=3 (n=1) -> q=5 (n=3) -> q=9 >= 9: stop.  sample 1: q=2 (0) -> q=3 (2) -> q=6 >= 4;
    # then q=7 (0) -> q=8 (1) -> q=10 >= 10: stop
    assert (a, c) == (1 + 3 + 0 + 2 + 0 + 1, 6)
    assert 1 + a / c != 1 + acc[starts].sum().item() / starts.sum().item()  # not the every-position average


def test_chain_row_pruning_changes_nothing_but_the_work():
    """Steps >= 1 on the compact chain rows give the same logits, loss and gradients
    as running every step on every row."""
    torch.manual_seed(3)
    m = Eagle3Drafter(ARCH)
    s1, s2 = twelve_token_sample(), twelve_token_sample()
    s2["loss_mask"] = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0], dtype=torch.uint8)
    b = TTTCollator(T2D_INDEX, ttt_steps=4, max_length=64, pad_multiple=16)([s1, s2])
    assert b["chain_rows"].shape == (2, 16)
    full = dict(b, rows=b["rows_full"])
    del full["chain_rows"]
    outs = []
    for batch in (b, full):
        m.zero_grad()
        o = ttt_forward(m, batch, 4, return_logits=True)
        o.loss.backward()
        outs.append((o, m.fc.weight.grad.clone(), m.lm_head.weight.grad.clone()))
    (p, gp, hp), (f, gf, hf) = outs
    for j in range(4):
        torch.testing.assert_close(p.logits[j], f.logits[j], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p.loss, f.loss)
    torch.testing.assert_close(p.step_stats, f.step_stats)
    assert p.accepted == f.accepted
    torch.testing.assert_close(gp, gf, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(hp, hf, atol=1e-6, rtol=1e-5)


def random_sample(T, seed, start):
    """A sample of ``T`` tokens whose assistant part starts at ``start`` with a gap of prompt tokens inside."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(T, dtype=torch.uint8)
    mask[start:] = 1
    mask[start + 3 : start + 5] = 0  # a second user turn in the middle
    return {
        "sample_id": f"r{seed}",
        "input_ids": torch.randint(0, VD, (T,), generator=g, dtype=torch.int32),
        "loss_mask": mask,
        "aux_hidden_states": torch.randn(T, 3, H, generator=g).bfloat16(),
        "topk_ids": torch.randint(0, VD, (T, K), generator=g, dtype=torch.int32),
        "topk_logprobs": torch.log_softmax(torch.randn(T, K, generator=g), -1),
    }


def test_chunked_chain_attention_equals_the_dense_mask():
    """chain_chunk (ChainMask): per chunk of chain rows, only the prefix up to the chunk and the
    rows' own chain keys; the same logits, loss and gradients as the dense [prefix | eye ...]
    mask, for chunks that divide the chain rows, that do not, and one chunk for all."""
    torch.manual_seed(5)
    m = Eagle3Drafter(DrafterArch(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  intermediate_size=24, num_layers=1, target_hidden_size=H, vocab_size=V,
                                  draft_vocab_size=VD))
    samples = [random_sample(23, 1, 4), random_sample(17, 2, 9), random_sample(30, 3, 2)]
    b = TTTCollator(T2D_INDEX, ttt_steps=4, max_length=64)(samples)
    Tp = b["chain_rows"].shape[1]
    assert Tp > 7 and b["chain_rows"].shape[0] == 3

    def run(chunk):
        m.zero_grad()
        o = ttt_forward(m, b, 4, return_logits=True, chain_chunk=chunk)
        o.loss.backward()
        return o, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    dense, gd = run(None)
    for chunk in (3, 4, Tp, 64):
        got, gc = run(chunk)
        for j in range(4):
            torch.testing.assert_close(got.logits[j], dense.logits[j], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.loss, dense.loss, atol=1e-6, rtol=1e-6)
        assert got.accepted == dense.accepted
        assert gc.keys() == gd.keys() and "layers.0.self_attn.k_proj.weight" in gc
        for n in gd:
            torch.testing.assert_close(gc[n], gd[n], atol=1e-6, rtol=1e-5, msg=n)


def _gqa_drafter(head_dim: int = 8):
    torch.manual_seed(5)
    return Eagle3Drafter(DrafterArch(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                                     intermediate_size=24, num_layers=1, target_hidden_size=H, vocab_size=V,
                                     draft_vocab_size=VD))


def test_flex_chain_attention_equals_the_dense_mask_forward():
    """attention="flex" (FlexChainMask, a block mask over the same [prefix | eye ...] pattern):
    the same logits, loss and acceptance as the dense mask, without gradients (all FlexAttention
    runs on CPU), for chain rows that do not fill a block and for several sequences padded
    differently; the CUDA test below checks gradients. Grouped-query heads (4 query, 2 KV)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    m = _gqa_drafter()
    samples = [random_sample(23, 1, 4), random_sample(17, 2, 9), random_sample(30, 3, 2)]
    b = TTTCollator(T2D_INDEX, ttt_steps=4, max_length=64)(samples)
    assert b["chain_rows"].shape[1] > 7
    with torch.no_grad():
        dense = ttt_forward(m, b, 4, return_logits=True)
        flex = ttt_forward(m, b, 4, return_logits=True, attention="flex")
    for j in range(4):
        torch.testing.assert_close(flex.logits[j], dense.logits[j], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex.loss, dense.loss, atol=1e-6, rtol=1e-6)
    assert flex.accepted == dense.accepted and flex.step_stats[:, 2].tolist() == dense.step_stats[:, 2].tolist()


def test_flex_chain_mask_selects_the_prefix_and_each_rows_own_chain_keys():
    """The block mask's element pattern, read back through its mask_mod, equals the dense mask of
    ttt_forward at every step (hand check on two sequences, one padded)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from eagle3.train.ttt_attention import FlexChainMask

    rows = torch.tensor([[2, 3, 7, 8, 9], [1, 5, 6, 0, 0]])
    T, Tp = 12, 5
    for step in (1, 3):
        fm = FlexChainMask(rows, T).at(step)
        bm = fm.block_mask()
        S = T + step * Tp
        b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(Tp), torch.arange(S), indexing="ij")
        got = bm.mask_mod(b, torch.zeros_like(b), q, kv)
        prefix = torch.arange(T)[None, None, :] <= rows[:, :, None]
        want = torch.cat([prefix] + [torch.eye(Tp, dtype=torch.bool).expand(2, Tp, Tp)] * step, dim=-1)
        assert torch.equal(got, want)
        assert bm.shape[-2:] == (Tp, S)


def test_flex_chain_attention_refuses_cpu_gradients_with_the_setting_to_change():
    pytest.importorskip("torch.nn.attention.flex_attention")
    from eagle3.errors import Eagle3Error

    m = _gqa_drafter()
    b = TTTCollator(T2D_INDEX, ttt_steps=2, max_length=64)([random_sample(23, 1, 4)])
    with pytest.raises(Eagle3Error, match="drafter.ttt_attention=flex trains on CUDA only"):
        ttt_forward(m, b, 2, attention="flex")


def test_flex_chain_attention_refuses_a_head_dim_the_cuda_kernel_cannot_take():
    """FlexAttention's CUDA kernel takes no head dim below 16 (inductor's NotImplementedError on one
    H200, 2026-12-05): refused with the setting to change before any kernel is built. Tensors on
    the meta device stand in for CUDA ones (the check reads only device type and shape)."""
    from eagle3.errors import Eagle3Error
    from eagle3.train.ttt_attention import FlexChainMask

    fm = FlexChainMask(torch.tensor([[3, 4, 5]]), 8).at(1)
    q = torch.empty(1, 4, 3, 8, device="meta")
    kv = torch.empty(1, 2, 8 + 3, 8, device="meta")
    with pytest.raises(Eagle3Error, match="head dim is 8, and FlexAttention's CUDA kernel needs at least 16"):
        fm.attend(q, kv, kv, rep=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward pass needs CUDA")
def test_flex_chain_attention_gradients_equal_the_dense_mask_on_cuda():
    """On CUDA, float32: the compiled FlexAttention kernel gives the dense mask's loss and the
    gradients of every parameter (what training uses). Head dim 16: the CUDA kernel takes no less."""
    m = _gqa_drafter(head_dim=16).cuda()
    samples = [random_sample(23, 1, 4), random_sample(17, 2, 9), random_sample(30, 3, 2)]
    b = {k: (v.cuda() if torch.is_tensor(v) else [x.cuda() if torch.is_tensor(x) else x for x in v]
             if isinstance(v, list) else v) for k, v in TTTCollator(T2D_INDEX, ttt_steps=4, max_length=64)(samples).items()}

    def run(attention):
        m.zero_grad()
        o = ttt_forward(m, b, 4, attention=attention)
        o.loss.backward()
        return o, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    dense, gd = run("dense")
    flex, gf = run("flex")
    torch.testing.assert_close(flex.loss, dense.loss, atol=1e-5, rtol=1e-5)
    assert gf.keys() == gd.keys() and "layers.0.self_attn.k_proj.weight" in gf
    for n in gd:
        torch.testing.assert_close(gf[n], gd[n], atol=1e-5, rtol=1e-4, msg=n)


def test_chain_mask_chunk_ends_are_the_largest_prefix_in_each_chunk():
    from eagle3.train.ttt_attention import ChainMask

    rows = torch.tensor([[2, 3, 7, 8, 9], [1, 5, 6, 0, 0]])  # sample 1 has 3 chain rows, then padding
    cm = ChainMask.create(rows, T=12, chunk=2)
    assert cm.ends == [6, 9, 10]  # max(rows[:, 0:2]) + 1, max(rows[:, 2:4]) + 1, max(rows[:, 4:5]) + 1
    assert cm.at(3).step == 3 and cm.at(3).ends is cm.ends


def test_feature_noise_is_relative_per_aux_state_and_only_in_training_mode():
    """add_feature_noise: per token and aux layer, the added noise's RMS is sigma x the state's RMS
    (statistically, over 4,096 elements per state: three layers at scales 1e-2, 1 and 1e2); the
    TTT unroll adds it in training mode only (eval mode equals the noise-free unroll exactly)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 3, 4096, generator=g) * torch.tensor([1e-2, 1.0, 1e2])[None, None, :, None]
    torch.manual_seed(1)
    y = add_feature_noise(x.view(2, 3, -1), 0.1).view_as(x)
    ratio = (y - x).pow(2).mean(-1).sqrt() / x.pow(2).mean(-1).sqrt()  # [2, 3, 3]
    assert ratio.sub(0.1).abs().max() < 0.005 and y.dtype == x.dtype
    assert torch.equal(add_feature_noise(x.view(2, 3, -1), 0.0).view_as(x), x)
    # seeded generators repeat the draw; a state with a 1e30 element stays finite (no float32 overflow)
    assert torch.equal(add_feature_noise(x.view(2, 3, -1), 0.1, 5), add_feature_noise(x.view(2, 3, -1), 0.1, 5))
    assert not torch.equal(add_feature_noise(x.view(2, 3, -1), 0.1, 5), add_feature_noise(x.view(2, 3, -1), 0.1, 6))
    big = torch.ones(1, 1, 3 * 8)
    big[0, 0, 2] = 1e30
    assert add_feature_noise(big, 0.1).isfinite().all()
    torch.manual_seed(2)
    m = Eagle3Drafter(ARCH)
    b = TTTCollator(T2D_INDEX, ttt_steps=3, max_length=64)([twelve_token_sample()])
    m.eval()
    clean, plain = TTTModel(m, 3, 1.0)(b), TTTModel(m, 3, 1.0, feature_noise=0.5)
    assert torch.equal(plain(b).loss, clean.loss)  # eval mode: no noise
    m.train()
    plain.noise_seed = 7
    noisy = plain(b)
    assert not torch.equal(noisy.loss, clean.loss) and torch.equal(plain(b).loss, noisy.loss)  # seeded: repeatable
