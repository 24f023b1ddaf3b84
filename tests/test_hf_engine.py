"""The in-process hf engine on a tiny random Llama with the real SmolLM2 tokenizer."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from eagle3.config import HFEngineConfig, ModelConfig, SamplingConfig
from eagle3.engines import build_engine
from eagle3.engines.hf.engine import left_pad, right_pad
from eagle3.errors import Eagle3Error


@pytest.fixture(scope="module")
def engine(tiny_target_dir, tmp_path_factory):
    cfg = ModelConfig(name="tiny", source=str(tiny_target_dir), aux_layer_ids=[1, 4, 8])  # 8 = last layer's output
    eng = build_engine(cfg, HFEngineConfig(device="cpu", capture_batch_size=4, max_batch_tokens=256),
                       tmp_path_factory.mktemp("cache"), None)
    yield eng
    eng.close()


def _seqs(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (int(L),), generator=g).tolist() for L in torch.randint(5, 60, (n,), generator=g)]


def test_layer_convention_proven_with_hooks(engine):
    """Stored aux id k == the tensor entering decoder layer k (id L == the input of the final norm)."""
    model = engine.model
    seq = _seqs(1)[0]
    seen = {}
    handles = [
        layer.register_forward_pre_hook(lambda m, a, kw, k=k: seen.__setitem__(k, (a[0] if a else kw["hidden_states"]).clone()),
                                        with_kwargs=True)
        for k, layer in enumerate(model.model.layers)
    ]
    handles.append(model.model.norm.register_forward_pre_hook(lambda m, a: seen.__setitem__(8, a[0].clone())))
    with torch.inference_mode():
        out = model(torch.tensor([seq]), output_hidden_states=True)
    for h in handles:
        h.remove()
    (cap,) = engine.capture([seq], top_k=5)
    assert cap.aux_hidden_states.shape == (len(seq), 3, 64) and cap.aux_hidden_states.dtype == torch.bfloat16
    for j, k in enumerate([1, 4, 8]):
        assert torch.equal(cap.aux_hidden_states[:, j], seen[k][0].to(torch.bfloat16)), k
    # and the same ids index HF output_hidden_states (k < L)
    for j, k in enumerate([1, 4]):
        assert torch.equal(cap.aux_hidden_states[:, j], out.hidden_states[k][0]), k


def test_topk_equals_the_models_own_logits(engine):
    for seq in _seqs(3, seed=1):
        (cap,) = engine.capture([seq], top_k=20)  # alone: the same computation as the plain forward
        with torch.inference_mode():
            logits = engine.model(torch.tensor([seq])).logits[0].float()  # [T, V]
        lp = F.log_softmax(logits, dim=-1)
        v, i = lp.topk(20, dim=-1)
        assert cap.topk_ids.dtype == torch.int32 and cap.topk_logprobs.dtype == torch.float32
        # the stored values are the model's 20 largest log-probs, and the stored ids carry them
        # (bf16 logits have exact ties, so the order among equal values may differ)
        torch.testing.assert_close(cap.topk_logprobs, v, rtol=0, atol=1e-5)
        torch.testing.assert_close(lp.gather(-1, cap.topk_ids.long()), cap.topk_logprobs, rtol=0, atol=1e-5)
        untied = v[:, 0] > v[:, 1]
        assert untied.any() and torch.equal(cap.topk_ids[untied, 0], i[untied, 0].to(torch.int32))
        assert all(len(set(row)) == 20 for row in cap.topk_ids.tolist())  # distinct ids
        # log-probs over the full vocabulary: the top-20 carry less than all the mass
        assert (cap.topk_logprobs.exp().sum(-1) < 1.0 + 1e-5).all()
        assert (cap.topk_logprobs[:, :-1] >= cap.topk_logprobs[:, 1:]).all()


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_alone_equals_inside_a_padded_batch(engine, tiny_target_dir, tmp_path):
    seqs = _seqs(6, seed=2)
    # bf16 (as served): equal within bf16 rounding, which 8 random layers amplify to ~1% of the norm
    batch = engine.capture(seqs, top_k=8)
    for seq, b in zip(seqs, batch):
        (alone,) = engine.capture([seq], top_k=8)
        assert b.aux_hidden_states.shape == alone.aux_hidden_states.shape == (len(seq), 3, 64)
        assert all(_rel(b.aux_hidden_states[:, j], alone.aux_hidden_states[:, j]) < 0.04 for j in range(3))
        assert _rel(b.topk_logprobs, alone.topk_logprobs) < 0.02
    # float32: the padded batch gives the same numbers (masks and positions are right)
    f32 = build_engine(ModelConfig(name="tiny32", source=str(tiny_target_dir), dtype="float32", aux_layer_ids=[1, 4, 8]),
                       HFEngineConfig(device="cpu", capture_batch_size=4, max_batch_tokens=256), tmp_path, None)
    batch = f32.capture(seqs, top_k=8)
    for seq, b in zip(seqs, batch):
        (alone,) = f32.capture([seq], top_k=8)
        assert _rel(b.aux_hidden_states, alone.aux_hidden_states) < 1e-2  # stored as bf16: one rounding step
        torch.testing.assert_close(b.topk_logprobs, alone.topk_logprobs, rtol=0, atol=1e-4)
        assert torch.equal(b.topk_ids[:, :3], alone.topk_ids[:, :3])


def test_padding_masks_and_positions():
    ids, mask, pos = right_pad([[5, 6, 7], [8]], pad_id=2)
    assert ids.tolist() == [[5, 6, 7], [8, 2, 2]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]  # padded positions have mask 0
    assert pos.tolist() == [[0, 1, 2], [0, 1, 2]]
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=2)
    assert ids.tolist() == [[5, 6, 7], [2, 2, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_batched_greedy_generation_equals_one_by_one(engine):
    """Left-padded batched greedy == each prompt alone, both with the engine's decode attention."""
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                     return_dict=False)
               for c in ("Hi", "What is the capital of France, please?", "2+2")]
    smp = SamplingConfig(max_new_tokens=6)
    batched = engine.generate(prompts, smp)
    for p, b in zip(prompts, batched):
        with torch.inference_mode(), engine.generation_attention():
            ref = engine.model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False,
                                        eos_token_id=engine.stop_ids, pad_token_id=engine.pad_id)[0, len(p):].tolist()
        assert b == ref


def test_generation_stops_at_end_of_turn(engine):
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                                  return_dict=False)
    free = engine.generate([prompt], SamplingConfig(max_new_tokens=8))[0]
    assert len(free) == 8
    stop_tok = free[3]
    saved = engine.stop_ids
    engine.stop_ids = saved + [stop_tok]  # pretend that token ends the turn
    try:
        out = engine.generate([prompt, prompt], SamplingConfig(max_new_tokens=8))
    finally:
        engine.stop_ids = saved
    cut = free.index(stop_tok)
    assert out[0] == out[1] == free[: cut + 1]


def test_sampling_is_seeded(engine):
    """The same seed gives the same tokens; another seed, or greedy decoding, gives others.

    The tiny random target's next-token distribution is nearly flat (checked below), so two
    independent 6-token samples agree by chance with probability below ``0.05 ** 6``.
    """
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                                  return_dict=False)
    with torch.inference_mode():
        probs = engine.model(torch.tensor([prompt])).logits[0, -1].float().softmax(-1)
    assert probs.max() < 0.05  # no token is near-certain: sampling cannot pass for greedy by chance
    smp = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=6, seed=3)
    sampled = engine.generate([prompt], smp)
    assert sampled == engine.generate([prompt], smp)
    assert engine.generate([prompt], dataclasses.replace(smp, seed=4)) != sampled
    assert engine.generate([prompt], dataclasses.replace(smp, temperature=0.0)) != sampled


def test_engine_info_and_errors(engine, tiny_target_dir, tmp_path):
    info = engine.info()
    assert info["name"] == "hf" and info["device"] == "cpu" and info["dtype"] == "bfloat16"
    with pytest.raises(Eagle3Error, match="top_k"):
        engine.capture([[1, 2]], top_k=0)
    with pytest.raises(Eagle3Error, match="engine 'tgi' is unknown; use engine=hf, engine=sglang, engine=vllm or engine=remote"):
        build_engine(ModelConfig(name="t", source=str(tiny_target_dir)), HFEngineConfig(name="tgi"), tmp_path, None)


def test_graphs_generate_cache_gives_generates_greedy_tokens(tiny_target_dir, tmp_path):
    """engine.generate_cache=graphs (eagle3.engines.hf.batch_decode), float32: the rows of
    transformers' generate, batches of several shapes through the one cache, stops honoured,
    sampling seeded."""
    cfg = ModelConfig(name="tiny", source=str(tiny_target_dir), aux_layer_ids=[1, 4, 8])
    eng = build_engine(cfg, HFEngineConfig(device="cpu", generate_cache="graphs", generate_batch_size=2,
                                           max_batch_tokens=64), tmp_path / "cache", None)
    try:
        eng.model.float()
        assert eng.info()["generate_cache"] == "graphs"
        prompts = _seqs(5, seed=1)
        smp = SamplingConfig(max_new_tokens=7)
        got = eng.generate(prompts, smp)
        for p, row in zip(prompts, got):
            with torch.inference_mode():
                ref = eng.model.generate(torch.tensor([p]), max_new_tokens=7, do_sample=False,
                                         eos_token_id=eng.stop_ids, pad_token_id=eng.pad_id)[0, len(p):].tolist()
            assert row == ref
        assert eng._batch_decoder is not None and eng._batch_decoder.cache.capacity == 8 * 64 + 2 * 64
        sampled = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=6, seed=3)
        greedy6 = SamplingConfig(max_new_tokens=6)
        assert eng.generate(prompts[:2], sampled) == eng.generate(prompts[:2], sampled) != eng.generate(prompts[:2],
                                                                                                      greedy6)
    finally:
        eng.close()
