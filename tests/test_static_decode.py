"""Static KV caches (SlotCache) for target and drafter: same tokens, counts and drafter logits as the dynamic path."""

from __future__ import annotations

import pytest
import torch

from eagle3.errors import Eagle3Error
from eagle3.spec import (
    Eagle3Proposer,
    ForcedProposer,
    SlotCache,
    SpecSettings,
    SpeculativeDecoder,
    StaticEagle3Proposer,
    StaticTargetRunner,
    TargetRunner,
    build_decoder,
    target_generate,
)
from eagle3.runtime.graphs import GraphedCall
from test_spec_decode import AUX, PROMPT, ReferenceProposer, greedy_reference, tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN = 160


@pytest.fixture(scope="module")
def target():
    return tiny_target()


class Recording:
    """Wraps a proposer; keeps every begin/step result (to compare two proposers call by call)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.aux_layer_ids, self.vocab_target_ids = inner.aux_layer_ids, inner.vocab_target_ids

    def reset(self):
        self.inner.reset()

    def begin(self, input_ids, aux, start):
        out = self.inner.begin(input_ids, aux, start)
        self.calls.append(("begin", start, input_ids.numel(), out.clone()))
        return out

    def step(self, input_ids, parents, position):
        out = self.inner.step(input_ids, parents, position)
        self.calls.append(("step", position, input_ids.numel(), out.clone()))
        return out

    def end_round(self):
        self.inner.end_round()

    def to_target(self, ids):
        return self.inner.to_target(ids)


def forced_run(runner, proposer, ref, settings):
    """Decode PROMPT with ``proposer`` forced to draft ``ref``: ``(result, recorded calls)``."""
    rec = Recording(proposer)
    res = SpeculativeDecoder(runner, ForcedProposer(rec, ref), settings).generate(PROMPT)
    return res, rec.calls


def assert_same_forced_decoding(pairs, ref, settings):
    """Forced-decode PROMPT with each ``(target, drafter)`` of ``pairs`` (two) on static caches
    (spans of 8: rounds verify 1..4 positions) and check the second equals the first: the same
    tokens (the greedy reference's), accept counts, drafter call arguments and drafter logits.
    Returns the second run's result."""
    runs = [forced_run(StaticTargetRunner(m, AUX, max_len=160, min_span=8),
                       StaticEagle3Proposer(d, AUX, max_len=160, min_span=8), ref, settings) for m, d in pairs]
    (a, acalls), (b, bcalls) = runs
    assert b.tokens == a.tokens == ref[len(PROMPT):]
    assert b.accept_counts == a.accept_counts and max(a.accept_counts) == settings.num_steps
    assert [c[:3] for c in bcalls] == [c[:3] for c in acalls]
    for x, y in zip(bcalls, acalls):
        torch.testing.assert_close(x[3], y[3], atol=1e-4, rtol=1e-4)
    return b


# ----------------------------------------------------------------------------- SlotCache
def test_slot_cache_writes_at_slots_moves_paths_and_refuses_overflow():
    c = SlotCache(num_layers=2, num_kv_heads=1, head_dim=2, max_len=6, dtype=torch.float32, device="cpu")
    assert c.max_len == 64  # rounded up to SLOT_ALIGN
    k = torch.arange(6.0).reshape(1, 1, 3, 2)
    c.set_slots(torch.tensor([1, 2, 4]))
    keys, values = c.update(k, -k, layer_idx=1)
    assert keys.shape == (1, 1, 64, 2)  # the whole buffer is returned
    assert keys[0, 0, :6].tolist() == [[0, 0], [0, 1], [2, 3], [0, 0], [4, 5], [0, 0]]
    assert values[0, 0, 4].tolist() == [-4, -5]
    assert c.keys[0].abs().sum() == 0  # the other layer is untouched
    c.move(torch.tensor([4, 2]), dst_start=0)  # a tree path: slot 4 then slot 2, behind the prefix
    assert c.keys[1][0, 0, :2].tolist() == [[4, 5], [2, 3]]
    assert c.values[1][0, 0, :2].tolist() == [[-4, -5], [-2, -3]]
    c.check_room(64)
    with pytest.raises(Eagle3Error, match="raise spec.max_len"):
        c.check_room(65)


def test_slot_cache_spans_double_from_min_span_up_to_max_len():
    c = SlotCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=80, dtype=torch.float32, device="cpu",
                  min_span=4)
    assert c.max_len == 128
    assert [c.span_for(e) for e in (1, 4, 5, 8, 9, 16, 17, 64, 65, 128)] == [4, 4, 8, 8, 16, 16, 32, 64, 128, 128]
    with pytest.raises(Eagle3Error, match="needs 129 KV slots"):
        c.span_for(129)
    c3 = SlotCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=130, dtype=torch.float32, device="cpu",
                   min_span=48)
    assert c3.max_len == 192 and [c3.span_for(e) for e in (48, 49, 97, 192)] == [48, 96, 192, 192]
    c.set_span(c.span_for(6))
    c.set_slots(torch.tensor([5]))
    keys, _ = c.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), layer_idx=0)
    assert keys.shape == (1, 1, 8, 2) and keys[0, 0, 5].tolist() == [1, 1]  # the first 8 slots
    assert c.get_mask_sizes() == (8, 0)
    assert keys.data_ptr() == c.keys[0].data_ptr()  # a view: graph replay sees the same memory
    off = SlotCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=20, dtype=torch.float32, device="cpu",
                    min_span=None)
    assert off.span_for(1) == off.span_for(64) == 64


def test_graphed_call_keeps_the_most_recently_used_graphs(monkeypatch):
    """max_graphs: capturing a new key drops the least recently used graph (bookkeeping only:
    the capture is replaced by a stand-in, as CPU tensors cannot be captured)."""
    from eagle3.runtime import graphs as gr

    class Replay:
        def replay(self):
            pass

    g = GraphedCall(lambda x: (x,), enabled=True, max_graphs=2)
    monkeypatch.setattr(g, "_capture", lambda inputs: gr._Graph(Replay(), tuple(x.clone() for x in inputs),
                                                                 (torch.zeros(1),)))
    x = torch.zeros(1)
    for key in ("a", "b", "a", "c"):
        g(key, x)
    assert g.captures == ["a", "c"]  # "b" was the least recently used when "c" came
    g("b", x)
    assert g.captures == ["c", "b"]


def test_graphed_call_is_a_plain_call_when_disabled():
    calls = []
    g = GraphedCall(lambda x: (calls.append(1) or x * 2,), enabled=False)
    assert g("k", torch.tensor([3.0]))[0].item() == 6.0
    assert calls == [1] and g.captures == []


# ------------------------------------------------------------------------ target runner
def test_static_runner_decodes_the_dynamic_runners_tokens(target):
    s, _ = SpecSettings.make(3, 1, 4, max_new_tokens=40)
    ref = target_generate(TargetRunner(target), PROMPT, s)
    runner = StaticTargetRunner(target, max_len=MAX_LEN)
    for _ in range(2):  # the one cache is reused: a second prompt sees nothing of the first
        got = target_generate(runner, PROMPT, s)
        assert got.tokens == ref.tokens
    assert runner.cuda_graphs is False  # CPU: eager


def test_static_runner_refuses_a_sequence_longer_than_its_cache(target):
    s, _ = SpecSettings.make(3, 1, 4, max_new_tokens=70)
    runner = StaticTargetRunner(target, max_len=30)  # 64 slots after rounding; 7 + 70 positions do not fit
    with pytest.raises(Eagle3Error, match="needs 77 KV slots but the static cache holds 64"):
        target_generate(runner, PROMPT, s)


@pytest.mark.parametrize("min_span", [None, 8])
@pytest.mark.parametrize("steps,topk,ndt", [(3, 1, 4), (3, 2, 6), (4, 3, 8)])
def test_static_verify_and_rollback_equal_dynamic_with_partial_acceptance(target, steps, topk, ndt, min_span):
    """A noisy oracle accepts some drafts, rejects others, and (trees) accepts paths that are
    not a prefix of the verify slots: the static cache's mask-only rollback and path move
    must give the dynamic cache's every token and count, with attention over all slots
    and over span buckets of 8, 16, 32, 64 slots (rounds that straddle a bucket edge)."""
    n = 60
    ref = greedy_reference(target, PROMPT, n)
    s, _ = SpecSettings.make(steps, topk, ndt, max_new_tokens=n)
    dyn = SpeculativeDecoder(TargetRunner(target), ReferenceProposer(ref, mode="noisy"), s).generate(PROMPT)
    runner = StaticTargetRunner(target, max_len=MAX_LEN, min_span=min_span)
    sta = SpeculativeDecoder(runner, ReferenceProposer(ref, mode="noisy"), s).generate(PROMPT)
    assert runner.cache.span == (runner.max_len if min_span is None else 128)  # the last round's span
    assert sta.tokens == dyn.tokens == ref[len(PROMPT):]
    assert sta.accept_counts == dyn.accept_counts
    assert 0 < sum(dyn.accept_counts) < steps * len(dyn.accept_counts)  # partial acceptance happened


# ----------------------------------------------------------------------------- drafter
@pytest.mark.parametrize("min_span", [None, 8])
@pytest.mark.parametrize("steps,topk,ndt,layers", [(3, 1, 4, 1), (3, 2, 6, 1), (3, 2, 6, 2)])
def test_static_drafter_gives_the_dynamic_drafters_logits_call_by_call(target, steps, topk, ndt, layers, min_span):
    """The EAGLE-3 drafter with a forced reference (so rounds verify 1..steps+1 positions and
    the static proposer's begin sees every count) on both paths: identical tokens and counts,
    and every begin/step returns the same logits (one layer, and two). The two-layer drafter
    is seed 1's: seed 0's has a near tie at its second tree level, where logits equal to 1e-5
    make the two paths keep different nodes."""
    drafter = tiny_drafter(target, layers=layers, seed=layers - 1)
    n = 50
    ref = greedy_reference(target, PROMPT, n)
    s, _ = SpecSettings.make(steps, topk, ndt, max_new_tokens=n)

    dyn, dcalls = forced_run(TargetRunner(target, AUX), Eagle3Proposer(drafter, AUX), ref, s)
    sta, scalls = forced_run(StaticTargetRunner(target, AUX, max_len=MAX_LEN, min_span=min_span),
                             StaticEagle3Proposer(drafter, AUX, max_len=MAX_LEN, min_span=min_span), ref, s)
    assert sta.tokens == dyn.tokens == ref[len(PROMPT):]
    assert sta.accept_counts == dyn.accept_counts
    assert max(dyn.accept_counts) == steps  # forced: full rounds happen
    assert [c[:3] for c in scalls] == [c[:3] for c in dcalls]
    for (_, _, _, a), (_, _, _, b) in zip(scalls, dcalls):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_forced_proposer_makes_every_chain_draft_accepted(target):
    drafter = tiny_drafter(target)
    n = 30
    ref = greedy_reference(target, PROMPT, n)
    s, _ = SpecSettings.make(3, 1, 4, max_new_tokens=n)
    # the draft vocabulary must hold the reference tokens for them to be forced
    vocab = set(drafter.draft_ids().tolist())
    res = SpeculativeDecoder(TargetRunner(target, AUX), ForcedProposer(Eagle3Proposer(drafter, AUX), ref),
                             s).generate(PROMPT)
    assert res.tokens == ref[len(PROMPT):]
    # a round accepts all 3 drafts unless one of the 3 reference tokens is outside the draft vocabulary
    gen = ref[len(PROMPT):]
    assert sum(res.accept_counts) >= sum(t in vocab for t in gen[1:]) - 3 * sum(t not in vocab for t in gen)
    assert res.verify_passes < n


def test_build_decoder_picks_the_dynamic_path_on_cpu_unless_asked(target):
    drafter = tiny_drafter(target)
    s, _ = SpecSettings.make(3, 1, 4, max_new_tokens=8)
    auto = build_decoder(target, drafter, AUX, s, [], max_prompt_tokens=64)
    assert type(auto.runner) is TargetRunner and type(auto.proposer) is Eagle3Proposer
    forced = build_decoder(target, drafter, AUX, s, [], max_prompt_tokens=64, static=True)
    assert isinstance(forced.runner, StaticTargetRunner) and isinstance(forced.proposer, StaticEagle3Proposer)
    assert forced.runner.max_len == 128  # 64 + 8 + 4 + 3 slots needed, rounded up to a multiple of 64
    assert forced.generate(PROMPT).tokens == auto.generate(PROMPT).tokens


# ------------------------------------------------------------------- batched regeneration
def test_static_cache_generation_gives_the_dynamic_caches_greedy_tokens(target):
    """The hf engine's generate with ``generate_cache=static`` (StaticCache, prompts padded to a
    multiple of 64) against the dynamic cache (no extra padding), float32 on CPU: same tokens."""
    from types import SimpleNamespace

    from eagle3.engines.hf.engine import STATIC_WIDTH_MULTIPLE, generation_config, left_pad

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (9, 23, 5, 40, 17)]
    sampling = SimpleNamespace(temperature=0.0, top_p=1.0, max_new_tokens=24)
    out = {}
    for static in (False, True):
        ids, mask = left_pad(seqs, pad_id=0, multiple=STATIC_WIDTH_MULTIPLE if static else 1)
        assert ids.shape[1] == (64 if static else 40)
        cfg = generation_config(sampling, stop_ids=[], pad_id=0, static=static)
        assert cfg.cache_implementation == ("static" if static else None)
        with torch.inference_mode():
            out[static] = target.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)[:, ids.shape[1]:]
    assert out[True].shape == (5, 24)
    assert out[True].tolist() == out[False].tolist()


def test_engine_generate_cache_setting_is_checked():
    from types import SimpleNamespace

    from eagle3.engines.hf.engine import HFEngine

    with pytest.raises(Eagle3Error, match="generate_cache='fast': use auto, dynamic, static or graphs"):
        HFEngine.__init__(object.__new__(HFEngine), model=None, tokenizer=SimpleNamespace(),
                          target=None, engine_cfg=SimpleNamespace(generate_cache="fast", attn_implementation="sdpa"),
                          device=torch.device("cpu"))


@pytest.mark.parametrize("cache,device,path", [
    ("auto", "cuda", "graphs"), ("auto", "cpu", "dynamic"), (None, "cuda", "graphs"), (None, "cpu", "dynamic"),
    ("dynamic", "cuda", "dynamic"), ("static", "cpu", "static"), ("graphs", "cuda", "graphs"),
])
def test_generation_path_auto_is_graphs_on_cuda_and_dynamic_elsewhere(cache, device, path):
    from eagle3.engines.hf.engine import generation_path

    assert generation_path(cache, device) == path


# ------------------------------------------------------------------------- CUDA graphs
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("steps,topk,ndt", [(3, 1, 4), (3, 2, 6)])
def test_cuda_graph_replay_gives_the_eager_dynamic_paths_tokens_and_logits(steps, topk, ndt):
    """Float32 on the GPU: the static path with every decode step, verify pass, begin and draft
    step replayed from CUDA graphs against the eager dynamic path."""
    dev = torch.device("cuda")
    tgt = tiny_target().to(dev)
    drafter = tiny_drafter(tiny_target()).to(dev)
    n = 50
    ref = greedy_reference(tgt, PROMPT, n)
    s, _ = SpecSettings.make(steps, topk, ndt, max_new_tokens=n)

    dyn, dcalls = forced_run(TargetRunner(tgt, AUX), Eagle3Proposer(drafter, AUX), ref, s)
    runner = StaticTargetRunner(tgt, AUX, max_len=MAX_LEN, min_span=16)
    prop = StaticEagle3Proposer(drafter, AUX, max_len=MAX_LEN, min_span=16)
    for _ in range(2):  # the second run replays graphs captured by the first
        sta, scalls = forced_run(runner, prop, ref, s)
        assert sta.tokens == dyn.tokens == ref[len(PROMPT):]
        assert sta.accept_counts == dyn.accept_counts
        for (_, _, _, a), (_, _, _, b) in zip(scalls, dcalls):
            torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    assert runner.cuda_graphs and prop.cuda_graphs
    spans = {k[2] for k in runner._calls.captures}
    assert {k[:2] for k in runner._calls.captures} <= {("chain", ndt), ("tree", ndt)}
    assert len(spans) >= 2  # the sequence grew across span buckets, each its own graph
    begins = {k[1] for k in prop._begin_calls.captures}
    assert len(begins) >= 2  # rounds verified different numbers of positions, each its own graph
    base = target_generate(runner, PROMPT, s)  # the decode step's graphs, one per span
    assert base.tokens == ref[len(PROMPT):]
    assert {k[0] for k in runner._decode_calls.captures} == {"decode"} and len(runner._decode_calls.captures) >= 2
