"""Capture's two-stage ranking, fused log-normaliser and overlapped host copies.

The references are independent of the code under test: a stable descending sort of the whole
row (the definition of the capture's top-k order) and float64 ``log_softmax``.
"""

import pytest
import torch

from eagle3.engines.hf.capture import (HostCopies, block_max_and_logsumexp, rank_top_k_blocks, row_logsumexp,
                                      top_k_logprobs)


def _stable_top_k(x: torch.Tensor, k: int):
    ref = torch.sort(x.float(), dim=-1, descending=True, stable=True)
    return ref.indices[:, :k], ref.values[:, :k]


@pytest.mark.parametrize("V,block", [(96, 8), (100, 8), (1000, 8), (49152, 128), (1000, 128)])
@pytest.mark.parametrize("k", [1, 3, 20])
def test_two_stage_ranking_equals_a_stable_sort_of_the_whole_row(V, block, k):
    g = torch.Generator().manual_seed(V + k)
    for values in (5, 1000):  # few distinct values (ties everywhere, across blocks) and few ties
        x = torch.randint(0, values, (64, V), generator=g).to(torch.bfloat16)
        x[0] = 7  # one row all tied: the k lowest ids
        x[1, :] = float("-inf")
        x[1, V - 1] = 1.0  # the only finite logit in the last (padded, for V=100) block
        x[2, :block] = 3000.0  # the first block holds the whole top-k when k <= block
        ids, vals = rank_top_k_blocks(x, k, block=block)
        ref_ids, ref_vals = _stable_top_k(x, k)
        assert torch.equal(ids, ref_ids), (V, block, k, values)
        assert torch.equal(vals.float(), ref_vals) and vals.dtype == torch.bfloat16
        assert torch.equal(ids[:, 0], x.argmax(-1))  # the verifier's greedy token first


def test_ranking_hand_case_ties_cross_the_block_boundary():
    # blocks of 2: [5, 9 | 9, 9 | 1, 9]; top-3 is ids 1, 2, 3 (the three lowest ids holding 9),
    # although block 2 also has a 9: equal block maxima go to the lower block
    x = torch.tensor([[5.0, 9.0, 9.0, 9.0, 1.0, 9.0]])
    ids, vals = rank_top_k_blocks(x, 2, block=2)
    assert ids.tolist() == [[1, 2]] and vals.tolist() == [[9.0, 9.0]]
    assert rank_top_k_blocks(x, 4, block=1)[0].tolist() == [[1, 2, 3, 5]]


@pytest.mark.parametrize("chunk_bytes", [None, 4000])  # one chunk, or chunks of a few rows
def test_log_probs_of_the_fast_path_equal_float64_log_softmax(monkeypatch, chunk_bytes):
    import eagle3.engines.hf.capture as capture

    if chunk_bytes:
        monkeypatch.setattr(capture, "LOGITS_CHUNK_BYTES", chunk_bytes)  # 3000 x bf16: 1 row per chunk
    g = torch.Generator().manual_seed(0)
    H, V, N, k = 16, 3000, 37, 5
    head = torch.nn.Linear(H, V, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 2)
    h = torch.randn(N, H, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        ids, lp = top_k_logprobs(h, head, k, fast=True)
        ref_ids, ref_lp = top_k_logprobs(h, head, k, fast=False)
        logits = head(h)
    assert ids.dtype == torch.int32 and lp.dtype == torch.float32 and ids.shape == (N, k)
    assert torch.equal(ids, ref_ids)
    exact = torch.log_softmax(logits.double(), -1).gather(-1, ids.long())
    assert torch.allclose(lp.double(), exact, atol=2e-6) and torch.allclose(ref_lp.double(), exact, atol=2e-6)
    assert torch.equal(ids[:, 0].long(), logits.argmax(-1))
    lse = row_logsumexp(logits)
    assert lse.dtype == torch.float32 and torch.allclose(lse.double(), torch.logsumexp(logits.double(), -1), atol=2e-6)


def test_a_final_logit_softcap_is_applied_before_ranking_and_normalising():
    """Gemma 2 / 3 cap their logits in the forward (``final_logit_softcapping``); capture must see
    the capped logits: the reference is float64 ``log_softmax`` of ``cap * tanh(logits / cap)``."""
    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(8, 500, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(500, 8, generator=g) * 20)  # logits far beyond the cap
    h = torch.randn(6, 8, generator=g)
    with torch.no_grad():
        ids, lp = top_k_logprobs(h, head, 4, softcap=30.0)
        capped = torch.tanh(head(h) / 30.0) * 30.0
        plain_ids, plain_lp = top_k_logprobs(h, head, 4)
    ref = torch.log_softmax(capped.double(), -1)
    assert torch.equal(ids.long(), _stable_top_k(capped, 4)[0])
    assert torch.allclose(lp.double(), ref.gather(-1, ids.long()), atol=1e-5)
    assert not torch.allclose(lp, plain_lp, atol=1e-2)  # the cap matters at these logits


def test_host_copies_hand_each_batch_over_once_in_order():
    seen = []
    copies = HostCopies(torch.device("cpu"))
    for b in range(3):
        copies.submit((torch.full((2, 3), b), torch.arange(b + 1)), lambda x, y: seen.append((x[0, 0].item(), len(y))))
    copies.finish()
    assert seen == [(0, 1), (1, 2), (2, 3)]


def test_a_compiler_failure_falls_back_to_eager_once_and_out_of_memory_propagates(monkeypatch, caplog):
    import logging

    import eagle3.engines.hf.capture as capture

    calls = []

    def broken_compile(fn, dynamic=None):
        def run(x):
            calls.append(x.shape)
            raise RuntimeError("inductor: no kernel for you")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(capture, "_COMPILED", {})
    x = torch.randn(3, 256)
    with caplog.at_level(logging.WARNING, logger="eagle3"):
        got = capture._run_compiled("logsumexp", capture._logsumexp_float, x)
        again = capture._run_compiled("logsumexp", capture._logsumexp_float, x)
    assert torch.equal(got, torch.logsumexp(x, -1)) and torch.equal(again, got)
    assert len(calls) == 1 and caplog.text.count("the compiled logsumexp failed (inductor: no kernel for you)") == 1

    def out_of_memory(x):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(capture, "_COMPILED", {"logsumexp": out_of_memory})
    with pytest.raises(torch.OutOfMemoryError):
        capture._run_compiled("logsumexp", capture._logsumexp_float, x)
    assert capture._COMPILED["logsumexp"] is out_of_memory  # not taken for a compiler failure


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned copies on a side stream need a GPU")
def test_host_copies_on_cuda_wait_for_their_kernels_and_arrive_in_order():
    seen = []
    copies = HostCopies(torch.device("cuda"))
    w = torch.randn(2048, 2048, device="cuda") / 45
    want = []
    for b in range(4):
        x = torch.randn(2048, 2048, device="cuda")
        for _ in range(20):  # a long kernel queue, no synchronisation before submit
            x = torch.tanh(x @ w)
        y = (x[:, :5] * 100).to(torch.int32)
        copies.submit((x.to(torch.bfloat16), y), lambda x, y, b=b: seen.append((b, x, y)))
        want.append((x.to(torch.bfloat16).clone(), y.clone()))  # queued after the producing kernels
        del x, y  # the side stream holds their memory until the copy is done
    copies.finish()
    assert [b for b, _, _ in seen] == [0, 1, 2, 3]
    for (_, x, y), (wx, wy) in zip(seen, want):
        assert x.device.type == "cpu" and torch.equal(x, wx.cpu()) and torch.equal(y, wy.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused logsumexp compiles for CUDA")
def test_fused_logsumexp_on_cuda_equals_float64():
    import eagle3.engines.hf.capture as capture

    g = torch.Generator().manual_seed(1)
    for n, V in ((7, 49152), (300, 32000), (1, 17)):
        x = (torch.randn(n, V, generator=g) * 4).to(torch.bfloat16).cuda()
        got = row_logsumexp(x, fused=True)
        assert got.dtype == torch.float32
        assert capture._COMPILED["logsumexp"] is not capture._logsumexp_float  # still the compiled one
        assert torch.allclose(got.double().cpu(), torch.logsumexp(x.double().cpu(), -1), atol=2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused first stage compiles for CUDA")
def test_fused_first_stage_on_cuda_equals_its_eager_parts():
    import eagle3.engines.hf.capture as capture

    g = torch.Generator().manual_seed(2)
    for n in (5, 300):
        x = (torch.randn(n, 49152, generator=g) * 4).to(torch.bfloat16).cuda()
        bmax, lse = block_max_and_logsumexp(x)
        assert torch.equal(bmax, x.view(n, -1, 128).amax(-1))
        assert torch.allclose(lse.double().cpu(), torch.logsumexp(x.double().cpu(), -1), atol=2e-5)
        assert torch.equal(rank_top_k_blocks(x, 20, block_max=bmax)[0], _stable_top_k(x, 20)[0])
    assert capture._COMPILED["first ranking stage"] is not capture._block_max_and_lse  # still the compiled one


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_engine_capture_fast_path_equals_the_reference_path(tiny_target_dir, tmp_path, device):
    """A whole ``HFEngine.capture`` (several batches, so copies overlap on CUDA) against the
    float32 reference path of the same engine: equal aux states and ids, log-probs to 1e-5."""
    from eagle3.config import HFEngineConfig, ModelConfig
    from eagle3.engines import build_engine

    cfg = ModelConfig(name="tiny", source=str(tiny_target_dir), aux_layer_ids=[1, 4, 8])
    engine = build_engine(cfg, HFEngineConfig(device=device, capture_batch_size=2, max_batch_tokens=128), tmp_path, None)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in (60, 41, 33, 20, 9, 3, 1)]
    fast = engine.capture(seqs, top_k=8)
    engine.capture_fast = False
    ref = engine.capture(seqs, top_k=8)
    alone = [engine.capture([s], top_k=8)[0] for s in seqs]  # each sequence alone: its rows are its own
    for s, a, b, c in zip(seqs, fast, ref, alone):
        assert a.aux_hidden_states.shape == (len(s), 3, engine.target.hidden_size)
        # bf16: another batch shape rounds differently, but rows of another sequence would be far off
        x, y = a.aux_hidden_states.float(), c.aux_hidden_states.float()
        assert (x - y).norm() <= 2e-2 * y.norm()
        assert a.aux_hidden_states.device.type == "cpu" and a.topk_ids.dtype == torch.int32
        assert torch.equal(a.aux_hidden_states, b.aux_hidden_states) and torch.equal(a.topk_ids, b.topk_ids)
        assert torch.allclose(a.topk_logprobs, b.topk_logprobs, atol=1e-5)
