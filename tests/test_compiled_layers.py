"""Inductor-compiled decoder layers (eagle3.spec.compiled): the same tokens and acceptance as the
eager layers, float32 on CPU, and one set of compilations for every batch shape and layer."""

from __future__ import annotations

import copy

import pytest
import torch

from eagle3.engines.hf.batch_decode import BatchDecoder
from eagle3.errors import Eagle3Error
from eagle3.evaluate.inprocess.backend import decoding_path
from eagle3.spec import SpecSettings, build_decoder
from eagle3.spec.compiled import SDPA_OUTSIDE_COMPILE, compile_decoder_layers, layers_compiled
from test_batch_decode import reference, seqs_of
from test_spec_decode import AUX, PROMPT, greedy_reference, tiny_drafter, tiny_target
from test_static_decode import assert_same_forced_decoding

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    """An eager target and a copy with compiled layers (same weights)."""
    torch._dynamo.reset()
    eager = tiny_target(layers=3)
    compiled = copy.deepcopy(eager)
    assert compile_decoder_layers(compiled) == 4  # 3 layers + the final norm
    assert compile_decoder_layers(compiled) == 0  # idempotent
    assert layers_compiled(compiled) and not layers_compiled(eager)
    return eager, compiled


def _frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_batched_decoding_with_compiled_layers_gives_generates_rows_and_compiles_once_per_kind(pair):
    """Three batch shapes (rows x widths): every row equals transformers' generate on the eager
    target; the third shape compiles nothing new (sizes are symbolic; layer_idx unspecialised)."""
    eager, compiled = pair
    dec = BatchDecoder(compiled, capacity=8 * 128)
    shapes = [[7, 12, 12, 3, 9], [20, 5], [33, 2, 17, 8, 8, 30, 11]]
    for i, lengths in enumerate(shapes):
        seqs = seqs_of(lengths, seed=10 + i)
        if i == 2:
            before = _frames()
        assert dec.generate(seqs, 9, stop_ids=[], pad_id=0) == reference(eager, seqs, 9)
    assert _frames() == before  # no compilation for a new batch shape


def test_attention_kept_outside_the_compiled_layers_gives_the_same_rows():
    """attention_in_graph=False: the model's attention becomes the registered eager-sdpa key, the
    batched decoder's rows equal generate's on the eager target over two batch shapes, and
    the attention call is a graph break: Dynamo compiled the layer in pieces around it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = tiny_target(layers=2)
    split = copy.deepcopy(eager)
    assert compile_decoder_layers(split, attention_in_graph=False) == 3
    assert split.config._attn_implementation == SDPA_OUTSIDE_COMPILE and eager.config._attn_implementation == "sdpa"
    dec = BatchDecoder(split, capacity=6 * 128)
    for i, lengths in enumerate([[7, 12, 3], [20, 5, 9, 9]]):
        seqs = seqs_of(lengths, seed=20 + i)
        assert dec.generate(seqs, 8, stop_ids=[], pad_id=0) == reference(eager, seqs, 8)
    assert sum(counters["graph_break"].values()) > 0  # the disabled sdpa call splits each layer
    assert compile_decoder_layers(split, attention_in_graph=False) == 0  # idempotent
    with pytest.raises(Eagle3Error, match="already compiled with the attention outside"):
        compile_decoder_layers(split)  # attention_in_graph=True on layers compiled without it
    with pytest.raises(Eagle3Error, match="attn_implementation='sdpa'"):
        compile_decoder_layers(tiny_drafter(eager), attention_in_graph=False)


def test_speculative_decoding_with_compiled_target_layers_equals_eager(pair):
    """Static caches, target and drafter layers compiled, the drafter fed the aux hidden states
    that forward hooks read from compiled layers, a forced reference (rounds verify 1..4 positions): the same tokens and
    accept counts as the eager target, and every drafter call returns the same logits."""
    eager, compiled = pair
    n = 40
    ref = greedy_reference(eager, PROMPT, n)
    s, _ = SpecSettings.make(3, 1, 4, max_new_tokens=n)
    drafter = tiny_drafter(eager)
    twin = copy.deepcopy(drafter)
    assert compile_decoder_layers(twin) == 2  # its one layer + its norm
    assert_same_forced_decoding([(eager, drafter), (compiled, twin)], ref, s)
    dec = build_decoder(compiled, drafter, AUX, s, [], max_prompt_tokens=64, static=True)
    assert decoding_path(dec) == "static KV caches + compiled layers"  # the report says so (no graphs on CPU)
    assert decoding_path(build_decoder(eager, drafter, AUX, s, [], max_prompt_tokens=64)) == "dynamic KV caches"


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(Eagle3Error, match="compile_layers=false"):
        compile_decoder_layers(torch.nn.Linear(2, 2))


def test_capture_with_compiled_layers_equals_eager(tiny_target_dir, tmp_path):
    """The hf engine's capture (forward pre-hooks on layers and the final norm, padded batches of
    several shapes), float32: the same aux hidden states and top-k after compiling the layers."""
    from eagle3.config import HFEngineConfig, ModelConfig
    from eagle3.engines import build_engine

    cfg = ModelConfig(name="tiny", source=str(tiny_target_dir), aux_layer_ids=[1, 4, 8])
    eng = build_engine(cfg, HFEngineConfig(device="cpu", capture_batch_size=2, max_batch_tokens=128),
                       tmp_path / "cache", None)
    try:
        assert eng.info()["compile_layers"] is False  # CPU: the setting is ignored
        eng.model.float()
        seqs = seqs_of([9, 30, 14, 22, 5], seed=4)
        eager = eng.capture(seqs, top_k=8)
        compile_decoder_layers(eng.model)
        got = eng.capture(seqs, top_k=8)
        for a, b in zip(got, eager):
            # stored as bf16: float32 results that differ in the last bits may round one bf16 step apart
            torch.testing.assert_close(a.aux_hidden_states.float(), b.aux_hidden_states.float(), atol=1e-4, rtol=2 ** -7)
            torch.testing.assert_close(a.topk_logprobs, b.topk_logprobs, atol=1e-4, rtol=1e-4)
            assert (a.topk_ids[:, 0] == b.topk_ids[:, 0]).float().mean() > 0.99
    finally:
        eng.close()


def test_engine_generation_restores_the_outside_compile_attention_for_capture(tiny_target_dir, tmp_path):
    """An engine over layers compiled with SDPA kept eager (what engine.compile_layers=true does on
    CUDA): generation switches to its own attention and back to the model's outside-compile key,
    not to the configured name (which would trace SDPA into the layers again); greedy rows and
    capture equal the eager engine's (float32)."""
    from eagle3.config import HFEngineConfig, ModelConfig, SamplingConfig
    from eagle3.engines import build_engine
    from eagle3.engines.hf.engine import HFEngine

    torch._dynamo.reset()
    cfg = ModelConfig(name="tiny", source=str(tiny_target_dir), aux_layer_ids=[1, 4, 8])
    eng = build_engine(cfg, HFEngineConfig(device="cpu", capture_batch_size=2, max_batch_tokens=128),
                       tmp_path / "cache", None)
    try:
        eng.model.float()
        prompts, smp = seqs_of([9, 30, 14], seed=6), SamplingConfig(max_new_tokens=5)
        rows, eager = eng.generate(prompts, smp), eng.capture(seqs_of([9, 30, 14, 22], seed=4), top_k=8)
        assert eng.capture_attn == "sdpa"
        compile_decoder_layers(eng.model, attention_in_graph=False)
        split = HFEngine(eng.model, eng.tokenizer, eng.target, eng.cfg, eng.device)
        assert split.capture_attn == SDPA_OUTSIDE_COMPILE
        assert "capture_attn" not in split.info()  # info() is extraction metadata: a new key would refuse resumes
        assert split.generate(prompts, smp) == rows
        assert eng.model.config._attn_implementation == SDPA_OUTSIDE_COMPILE  # restored after generation
        got = split.capture(seqs_of([9, 30, 14, 22], seed=4), top_k=8)
        for a, b in zip(got, eager):
            torch.testing.assert_close(a.aux_hidden_states.float(), b.aux_hidden_states.float(), atol=1e-4, rtol=2 ** -7)
            torch.testing.assert_close(a.topk_logprobs, b.topk_logprobs, atol=1e-4, rtol=1e-4)
    finally:
        eng.close()


def test_compile_layers_setting_resolves_by_device_and_stage():
    from eagle3.spec.compiled import wants_compile

    assert not wants_compile(True, "cpu", default=True)  # never on CPU
    assert wants_compile(None, "cuda", default=True) and not wants_compile(None, "cuda", default=False)
    assert wants_compile(True, "cuda", default=False) and not wants_compile(False, "cuda", default=True)
