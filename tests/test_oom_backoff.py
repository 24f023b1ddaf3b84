"""CUDA out-of-memory during regeneration or capture: the batch limits are halved and the work goes on.

The out-of-memory error is raised by a stand-in for the model's forward whenever a batch has
more rows than "fit", so the test runs on CPU; the results must equal those of an engine that
never ran out of memory.
"""

import logging

import pytest
import torch

from eagle3.config import HFEngineConfig, ModelConfig, SamplingConfig
from eagle3.engines import build_engine
from eagle3.engines.hf.oom import MAX_HALVINGS, run_in_batches
from eagle3.errors import Eagle3Error


def _engine(tiny_target_dir, cache):
    cfg = ModelConfig(name="tiny", source=str(tiny_target_dir), aux_layer_ids=[1, 4, 8])
    return build_engine(cfg, HFEngineConfig(device="cpu", generate_batch_size=8, capture_batch_size=4,
                                            max_batch_tokens=256), cache, None)


def _fail_above(rows_that_fit, fn, calls):
    def wrapped(*args, **kwargs):
        rows = kwargs["input_ids"].shape[0]
        calls.append(rows)
        if rows > rows_that_fit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return fn(*args, **kwargs)
    return wrapped


def _prompts(engine):
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                 return_dict=False)
            for c in ("Hi", "What is the capital of France, please?", "2+2", "Name a colour.", "Why?")]


def test_generation_halves_its_batches_until_they_fit_and_keeps_the_tokens(tiny_target_dir, tmp_path, caplog):
    engine = _engine(tiny_target_dir, tmp_path)
    prompts = _prompts(engine)
    smp = SamplingConfig(max_new_tokens=5)
    alone = [engine.generate([p], smp)[0] for p in prompts]  # one prompt per batch: the reference
    calls: list[int] = []
    engine.model.generate = _fail_above(1, engine.model.generate, calls)
    with caplog.at_level(logging.WARNING, logger="eagle3"):
        got = engine.generate(prompts, smp)
    assert got == alone
    assert calls == [5, 4, 2, 1, 1, 1, 1, 1]  # at most 8, 4, 2, then 1 row a batch: 5 prompts fail, then 4 of them, then 2
    assert engine.batch["generate_batch_size"] == 1 and engine.batch["max_batch_tokens"] == 32
    assert "generate ran out of GPU memory on a batch of 5 item(s) at generate_batch_size=8, max_batch_tokens=256; " \
           "going on with generate_batch_size=4, max_batch_tokens=128 (5 of 5 items left" in caplog.text


def test_capture_halves_its_batches_and_keeps_what_was_captured(tiny_target_dir, tmp_path):
    engine = _engine(tiny_target_dir, tmp_path)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 49152, (int(n),), generator=g).tolist() for n in (40, 30, 20, 12, 9, 7)]
    alone = [engine.capture([s], top_k=4)[0] for s in seqs]
    calls: list[int] = []
    engine._base = _fail_above(1, engine._base, calls)
    got = engine.capture(seqs, top_k=4)
    for a, b in zip(got, alone):
        assert torch.equal(a.aux_hidden_states, b.aux_hidden_states) and torch.equal(a.topk_ids, b.topk_ids)
        assert torch.equal(a.topk_logprobs, b.topk_logprobs)
    assert calls == [4, 2, 1, 1, 1, 1, 1, 1]  # capture_batch_size 4 -> 2 -> 1: six sequences one at a time
    assert engine.batch["capture_batch_size"] == 1


def test_items_finished_before_the_failure_are_not_done_again():
    limits = {"rows": 4}
    ran: list[list[int]] = []

    def plan(lengths):  # consecutive batches of limits["rows"] items
        return [list(range(a, min(a + limits["rows"], len(lengths)))) for a in range(0, len(lengths), limits["rows"])]

    def run(idx):
        if len(ran) == 1:  # the second batch ever run fails once
            ran.append([])
            raise torch.OutOfMemoryError("CUDA out of memory")
        ran.append(idx)

    run_in_batches(limits, ("rows",), [1] * 10, plan, run, "work")
    assert ran == [[0, 1, 2, 3], [], [4, 5], [6, 7], [8, 9]]  # 0-3 kept; 4-9 planned again at 2 a batch
    assert limits == {"rows": 2}


def test_out_of_memory_that_halving_cannot_cure_is_a_clear_error():
    limits = {"capture_batch_size": 64, "max_batch_tokens": 65536}

    def run(idx):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(Eagle3Error, match=r"capture ran out of GPU memory on a batch of 1 item\(s\) \(longest 900 tokens\) "
                                          r"even at capture_batch_size=1, max_batch_tokens=1024, after 6 halvings: run fewer "
                                          r"replicas on this GPU \(parallel.workers, or other jobs\), or lower "
                                          r"capture.max_length \(CUDA out of memory\)"):
        run_in_batches(limits, ("capture_batch_size", "max_batch_tokens"), [900], lambda ls: [[0]], run, "capture")
    assert MAX_HALVINGS == 6 and limits == {"capture_batch_size": 1, "max_batch_tokens": 1024}


def test_other_errors_are_not_taken_for_memory():
    def run(idx):
        raise RuntimeError("CUDA error: device-side assert triggered")

    limits = {"rows": 4}
    with pytest.raises(RuntimeError, match="device-side assert"):
        run_in_batches(limits, ("rows",), [1, 1], lambda ls: [[0, 1]], run, "work")
    assert limits == {"rows": 4}


def test_the_failed_batch_is_freed_before_the_cache_is_given_back():
    """What the failed batch allocated is referenced by the error's traceback; the limits are
    halved (and the CUDA cache emptied) only once that is gone, or nothing would be freed."""
    import weakref

    class Tensor:  # stands in for a batch's activations
        pass

    alive: list = []

    def run(idx):
        if not alive:
            activations = Tensor()
            alive.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("CUDA out of memory")

    freed_at_shrink: list[bool] = []
    run_in_batches({"rows": 2}, ("rows",), [1, 1], lambda ls: [list(range(len(ls)))], run, "work",
                   on_shrink=lambda: freed_at_shrink.append(alive[0]() is None))
    assert freed_at_shrink == [True]
