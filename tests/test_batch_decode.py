"""Batched graph decoding (eagle3.engines.hf.batch_decode) against transformers' generate, float32 on CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eagle3.engines.hf.batch_decode import SLOT_MULTIPLE, BatchDecoder, FlatSlotCache
from eagle3.engines.hf.engine import generation_config, left_pad
from eagle3.errors import Eagle3Error
from test_spec_decode import tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def reference(model, seqs, n, stop_ids=()):
    """transformers' generate (dynamic cache, left padding), greedy, cut after the first stop id."""
    ids, mask = left_pad(seqs, pad_id=0)
    cfg = generation_config(SimpleNamespace(temperature=0.0, top_p=1.0, max_new_tokens=n), stop_ids=list(stop_ids),
                            pad_id=0, static=False)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)[:, ids.shape[1]:].tolist()
    rows = []
    for row in out:
        cut = next((j for j, t in enumerate(row) if t in set(stop_ids)), None)
        rows.append(row[: cut + 1] if cut is not None else row)
    return rows


def seqs_of(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 90, (n,), generator=g).tolist() for n in lengths]


def test_greedy_rows_equal_generate_for_mixed_prompt_lengths(target):
    seqs = seqs_of((9, 23, 5, 40, 17))
    dec = BatchDecoder(target, capacity=5 * 128)
    got = dec.generate(seqs, 24, stop_ids=[], pad_id=0)
    assert got == reference(target, seqs, 24)
    assert [len(r) for r in got] == [24] * 5
    assert dec.cache.rows == 5 and dec.cache.width == 64  # 40 + 24 rounded up to a multiple of 64
    # the one cache is reused by a batch of another shape: nothing of the first batch leaks in
    seqs2 = seqs_of((3, 12), seed=5)
    assert dec.generate(seqs2, 30, stop_ids=[], pad_id=0) == reference(target, seqs2, 30)


def test_a_row_stops_after_its_first_stop_id_and_the_others_go_on(target):
    seqs = seqs_of((9, 23, 5, 40, 17))
    free = reference(target, seqs, 24)
    stop = free[1][6]  # row 1 stops at its 7th token; other rows may meet it elsewhere
    want = reference(target, seqs, 24, stop_ids=[stop])
    got = BatchDecoder(target, capacity=5 * 128).generate(seqs, 24, stop_ids=[stop], pad_id=0)
    assert got == want
    assert len(got[1]) <= 7 and got[1][-1] == stop
    assert any(len(r) == 24 for r in got)  # a row that never met the stop id ran to max_new_tokens


def test_all_rows_stopped_ends_the_loop_early(target):
    seqs = seqs_of((6, 6))
    free = reference(target, seqs, 40)
    stops = [free[0][1], free[1][1]]
    got = BatchDecoder(target, capacity=2 * 64).generate(seqs, 40, stop_ids=stops, pad_id=0)
    assert all(len(r) <= 2 for r in got)


def test_sampling_is_seeded_and_stays_in_the_top_p_set(target):
    seqs = seqs_of((7, 11))
    dec = BatchDecoder(target, capacity=2 * 64)
    a = dec.generate(seqs, 12, stop_ids=[], pad_id=0, temperature=0.8, top_p=0.9, seed=4)
    b = dec.generate(seqs, 12, stop_ids=[], pad_id=0, temperature=0.8, top_p=0.9, seed=4)
    assert a == b and a != dec.generate(seqs, 12, stop_ids=[], pad_id=0)  # sampled != greedy (12 tokens)
    logits = torch.tensor([[0.0, 3.0, 2.9, -5.0]])
    g = torch.Generator().manual_seed(0)
    picks = {int(BatchDecoder._choose(logits, 1.0, 0.5, g)) for _ in range(50)}
    assert picks == {1}  # top-p 0.5: only the most likely id (p ~ 0.51) is in the set


def test_capacity_is_checked_with_a_fix():
    c = FlatSlotCache(num_layers=1, num_kv_heads=1, head_dim=2, capacity=100, dtype=torch.float32, device="cpu")
    c.use(1, 64)
    with pytest.raises(Eagle3Error, match="lower engine.generate_batch_size"):
        c.use(2, SLOT_MULTIPLE)


def test_flat_cache_views_share_one_buffer():
    c = FlatSlotCache(num_layers=1, num_kv_heads=2, head_dim=3, capacity=64, dtype=torch.float32, device="cpu")
    c.use(2, 8)
    c.set_slots(torch.tensor([5]))
    k, _ = c.update(torch.ones(2, 2, 1, 3), torch.ones(2, 2, 1, 3), 0)
    assert k.shape == (2, 2, 8, 3) and k.data_ptr() == c.keys[0].data_ptr() and k.is_contiguous()
    assert k[:, :, 5].eq(1).all() and k.sum() == 2 * 2 * 3
    # [B, kv, S, d] contiguous: row r, head h, slot 5 starts at element ((r * 2 + h) * 8 + 5) * 3
    flat = c.keys[0].view(-1)
    for r in range(2):
        for h in range(2):
            start = ((r * 2 + h) * 8 + 5) * 3
            assert flat[start:start + 3].eq(1).all()
    assert flat.sum() == 2 * 2 * 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_gives_generates_greedy_rows():
    tgt = tiny_target().cuda()
    seqs = seqs_of((9, 23, 5, 40, 17))
    ref = reference(tgt, seqs, 24)
    dec = BatchDecoder(tgt, capacity=8 * 128)
    for _ in range(2):  # the second call replays the graph captured by the first
        assert dec.generate(seqs, 24, stop_ids=[], pad_id=0) == ref
    assert dec.cuda_graphs and dec._decode.captures == [("decode", 5, 64)]
