"""Grouped-query attention with the query heads folded into the query axis (eagle3.gqa): the
attention of every query head over its own kv head, computed here head by head, and the same
tokens, acceptance and drafter logits when the target and the drafter decode with it."""

from __future__ import annotations

import copy

import pytest
import torch

from eagle3.engines.hf.batch_decode import BatchDecoder
from eagle3.errors import Eagle3Error
from eagle3.gqa import (
    FOLD_MAX_QUERIES,
    GQA_SDPA,
    GQA_SDPA_OUTSIDE_COMPILE,
    can_fold,
    fold_drafter_attention,
    folded_gqa_sdpa,
    gqa_sdpa_attention,
    use_gqa_sdpa,
)
from eagle3.spec import SpecSettings
from test_batch_decode import reference, seqs_of
from test_spec_decode import AUX, PROMPT, greedy_reference, tiny_drafter, tiny_target
from test_static_decode import assert_same_forced_decoding

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def fold_calls(monkeypatch):
    """Counts the folded calls: ``target`` every :func:`eagle3.gqa.grouped_attention` call (the
    target's attention function and, through ``folded_gqa_sdpa``, the drafter's), ``drafter``
    the drafter's."""
    import eagle3.gqa
    import eagle3.model.drafter

    calls = {"target": 0, "drafter": 0}

    def spy(who):
        real = eagle3.gqa.grouped_attention if who == "target" else folded_gqa_sdpa

        def f(*args, **kwargs):
            calls[who] += 1
            return real(*args, **kwargs)
        return f

    monkeypatch.setattr(eagle3.gqa, "grouped_attention", spy("target"))
    monkeypatch.setattr(eagle3.model.drafter, "folded_gqa_sdpa", spy("drafter"))
    return calls


def per_head_reference(q, k, v, mask, scale):
    """Query head ``h`` over kv head ``h // g``, one head at a time, float64: the definition."""
    B, hq, Q, d = q.shape
    g = hq // k.shape[1]
    out = torch.empty(B, hq, Q, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(hq):
            s = q[b, h].double() @ k[b, h // g].double().T * scale  # [Q, S]
            if mask is not None:
                m = mask[b if mask.shape[0] > 1 else 0, 0]
                s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
            out[b, h] = torch.softmax(s, -1) @ v[b, h // g].double()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_len,mask_kind", [(1, "bool"), (1, "none"), (4, "bool"), (4, "float"), (7, "bool")])
def test_folded_attention_is_each_query_heads_attention_over_its_kv_head(device, q_len, mask_kind):
    g = torch.Generator().manual_seed(q_len)
    B, hk, grp, S, d = 3, 2, 3, 40, 16
    q = torch.randn(B, hk * grp, q_len, d, generator=g)
    k, v = torch.randn(B, hk, S, d, generator=g), torch.randn(B, hk, S, d, generator=g)
    mask = None
    if mask_kind != "none":
        visible = torch.rand(B, 1, q_len, S, generator=g) < 0.6
        visible[..., 0] = True  # no row masked entirely
        mask = visible if mask_kind == "bool" else torch.where(visible, 0.0, -1e9) + 0.1 * torch.randn(visible.shape, generator=g)
    ref = per_head_reference(q, k, v, mask, d ** -0.5)
    dev = torch.device(device)
    got = folded_gqa_sdpa(q.to(dev), k.to(dev), v.to(dev),
                          None if mask is None else mask.to(dev))
    assert got.shape == (B, hk * grp, q_len, d)
    torch.testing.assert_close(got.cpu().double(), ref, atol=2e-5, rtol=2e-5)
    # a query with transformers' layout ([B, T, H, d] projected, then transposed) folds the same way
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(folded_gqa_sdpa(qt, k, v, mask).double(), ref, atol=2e-5, rtol=2e-5)


def test_fold_refuses_what_it_cannot_express():
    k = torch.zeros(1, 2, 8, 4)
    assert not can_fold(torch.zeros(1, 2, 1, 4), k, None)  # no grouping (Hq == Hk)
    assert not can_fold(torch.zeros(1, 5, 1, 4), k, None)  # 5 heads over 2 kv heads
    assert not can_fold(torch.zeros(1, 4, FOLD_MAX_QUERIES + 1, 4), k, torch.ones(1, 1, FOLD_MAX_QUERIES + 1, 8, dtype=torch.bool))
    assert not can_fold(torch.zeros(1, 4, 3, 4), k, None)  # several queries need a mask (no causal form)
    assert not can_fold(torch.zeros(1, 4, 3, 4), k, torch.ones(1, 4, 3, 8, dtype=torch.bool))  # a per-head mask
    assert not can_fold(torch.zeros(1, 4, 3, 4), k, torch.ones(1, 1, 1, 8, dtype=torch.bool))  # one row for 3 queries
    assert can_fold(torch.zeros(1, 4, 3, 4), k, torch.ones(1, 1, 3, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="shared by all heads"):
        folded_gqa_sdpa(torch.zeros(1, 4, 3, 4), k, k, torch.ones(1, 4, 3, 8, dtype=torch.bool))


def test_the_transformers_function_equals_sdpa_and_passes_prefill_through():
    """gqa_sdpa_attention against transformers' own sdpa_attention_forward (repeat_kv): a decode
    step and a verify pass under left-padded causal masks, and a prefill
    of more than FOLD_MAX_QUERIES queries (handed to sdpa itself)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    g = torch.Generator().manual_seed(0)
    for q_len in (1, 4, FOLD_MAX_QUERIES + 6):
        S = q_len + 30
        q = torch.randn(2, 6, q_len, 8, generator=g)
        k, v = torch.randn(2, 2, S, 8, generator=g), torch.randn(2, 2, S, 8, generator=g)
        mask = torch.ones(2, 1, q_len, S, dtype=torch.bool).tril(diagonal=S - q_len)
        mask[1, ..., :3] = False  # left padding in row 1
        want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
        got, _ = gqa_sdpa_attention(module, q, k, v, mask, scaling=0.3)
        assert got.shape == want.shape == (2, q_len, 6, 8)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_batched_decoding_with_the_folded_attention_gives_generates_rows(fold_calls):
    eager = tiny_target(layers=3)
    folded = copy.deepcopy(eager)
    use_gqa_sdpa(folded)
    use_gqa_sdpa(folded)  # idempotent
    assert folded.config._attn_implementation == GQA_SDPA
    dec = BatchDecoder(folded, capacity=6 * 128)
    for i, lengths in enumerate([[7, 12, 3, 30], [20, 5]]):
        seqs = seqs_of(lengths, seed=40 + i)
        assert dec.generate(seqs, 10, stop_ids=[], pad_id=0) == reference(eager, seqs, 10)
    assert fold_calls["target"] == 2 * (1 + 9) * 3  # both batches' prefills (<= 64 queries) and decode steps, 3 layers
    with pytest.raises(Eagle3Error, match="attn_implementation='sdpa'"):
        use_gqa_sdpa(tiny_target(layers=1, attn="eager"))


def test_speculative_decoding_with_the_folded_attention_equals_repeat_kv(fold_calls):
    """Static caches (verify passes of 1..4 positions, draft steps), target and drafter folded:
    the same tokens and accept counts, and every drafter call the same logits."""
    eager = tiny_target(layers=3)
    n = 40
    ref = greedy_reference(eager, PROMPT, n)
    s, _ = SpecSettings.make(3, 1, 4, max_new_tokens=n)
    drafter = tiny_drafter(eager)
    folded, folded_drafter = copy.deepcopy(eager), copy.deepcopy(drafter)
    use_gqa_sdpa(folded)
    assert fold_drafter_attention(folded_drafter) == 1
    b = assert_same_forced_decoding([(eager, drafter), (folded, folded_drafter)], ref, s)
    drafter_calls = fold_calls["drafter"]  # the drafter's folded calls run through grouped_attention too
    assert fold_calls["target"] - drafter_calls == 3 * (1 + len(b.accept_counts))  # the 7-token prefill, every verify pass
    assert fold_calls["drafter"] >= 3 * len(b.accept_counts)  # the draft steps of every round


def test_compiling_with_the_attention_outside_keeps_the_folded_attention():
    from eagle3.spec.compiled import compile_decoder_layers, layers_compiled

    model = tiny_target(layers=2)
    use_gqa_sdpa(model)
    assert compile_decoder_layers(model, attention_in_graph=False) == 3
    assert model.config._attn_implementation == GQA_SDPA_OUTSIDE_COMPILE and layers_compiled(model)
    assert compile_decoder_layers(model, attention_in_graph=False) == 0  # idempotent


def test_engine_generation_with_the_folded_attention_gives_the_same_rows(tiny_target_dir, tmp_path, fold_calls):
    """engine.gqa_fold=true (auto turns it on for CUDA only): generation attends with the folded
    key (recorded as generate_attn), rows equal the engine's default CPU generation, and capture
    goes back to sdpa with the same features (float32)."""
    from eagle3.config import HFEngineConfig, ModelConfig, SamplingConfig
    from eagle3.engines import build_engine
    from eagle3.engines.hf.engine import HFEngine

    cfg = ModelConfig(name="tiny", source=str(tiny_target_dir), aux_layer_ids=[1, 4, 8])
    eng = build_engine(cfg, HFEngineConfig(device="cpu", capture_batch_size=2, max_batch_tokens=128),
                       tmp_path / "cache", None)
    try:
        eng.model.float()
        assert eng.gqa_fold is False  # auto: off on CPU
        prompts, smp = seqs_of([9, 30, 14], seed=6), SamplingConfig(max_new_tokens=6)
        seqs = seqs_of([9, 30, 14, 22], seed=4)
        rows, feats = eng.generate(prompts, smp), eng.capture(seqs, top_k=8)
        folded = HFEngine(eng.model, eng.tokenizer, eng.target, HFEngineConfig(device="cpu", gqa_fold=True,
                          capture_batch_size=2, max_batch_tokens=128), eng.device)
        assert folded.gqa_fold and folded.info()["generate_attn"] == GQA_SDPA
        assert fold_calls["target"] == 0
        assert folded.generate(prompts, smp) == rows
        assert fold_calls["target"] > 0  # the tiny target has grouped heads: the decode steps folded
        n = fold_calls["target"]
        assert eng.model.config._attn_implementation == "sdpa"  # restored for capture
        for a, b in zip(folded.capture(seqs, top_k=8), feats):
            torch.testing.assert_close(a.aux_hidden_states, b.aux_hidden_states)
            torch.testing.assert_close(a.topk_logprobs, b.topk_logprobs)
        assert fold_calls["target"] == n  # capture did not fold
    finally:
        eng.close()


def test_gqa_fold_setting_resolves_by_device_and_attention():
    from eagle3.gqa import wants_fold

    assert wants_fold(None, "cuda", "sdpa") and not wants_fold(None, "cpu", "sdpa")
    assert not wants_fold(None, "cuda", "eager") and not wants_fold(False, "cuda", "sdpa")
    assert wants_fold(True, "cpu", "sdpa")
    with pytest.raises(Eagle3Error, match="gqa_fold=true needs engine.attn_implementation=sdpa"):
        wants_fold(True, "cuda", "eager")


def test_the_report_names_the_folded_attention():
    from eagle3.evaluate.inprocess.backend import decoding_path
    from eagle3.spec import build_decoder

    model = tiny_target(layers=3)
    drafter = tiny_drafter(model)
    s, _ = SpecSettings.make(3, 1, 4, max_new_tokens=8)
    assert decoding_path(build_decoder(model, drafter, AUX, s, [], max_prompt_tokens=64, static=True)) == "static KV caches"
    use_gqa_sdpa(model)
    assert (decoding_path(build_decoder(model, drafter, AUX, s, [], max_prompt_tokens=64, static=True))
            == "static KV caches + folded GQA attention")


def test_an_engine_with_compiled_layers_generates_with_the_compile_disabled_folded_key(tiny_target_dir, tmp_path,
                                                                                      monkeypatch):
    """engine.compile_layers on (what CUDA gives; forced here) with the fold: generation switches to
    the folded key kept out of compiled code, registered by the engine itself even in a process
    where nothing registered it before, and back to the model's outside-compile sdpa key."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    import eagle3.spec.compiled
    from eagle3.config import HFEngineConfig, ModelConfig
    from eagle3.engines import build_engine
    from eagle3.spec.compiled import SDPA_OUTSIDE_COMPILE

    for interface in (AttentionInterface, AttentionMaskInterface):
        for key in (GQA_SDPA, GQA_SDPA_OUTSIDE_COMPILE):
            monkeypatch.delitem(interface._global_mapping, key, raising=False)
    monkeypatch.setattr(eagle3.spec.compiled, "wants_compile", lambda setting, device_type, default: True)
    cfg = ModelConfig(name="tiny", source=str(tiny_target_dir), aux_layer_ids=[1, 4, 8])
    eng = build_engine(cfg, HFEngineConfig(device="cpu", gqa_fold=True), tmp_path / "cache", None)
    try:
        assert eng.compile_layers and eng.generate_attn == GQA_SDPA_OUTSIDE_COMPILE
        with eng.generation_attention():
            assert eng.model.config._attn_implementation == GQA_SDPA_OUTSIDE_COMPILE
        assert eng.model.config._attn_implementation == SDPA_OUTSIDE_COMPILE
    finally:
        eng.close()
