"""Data-parallel training on CPU (gloo) when something goes wrong on one process only: no hang.

A process with no validation batch, a micro-batch whose samples all have non-finite
features, a non-finite loss on one process, a process killed or stuck in the middle of a
step. Each launch of ``tests/dist_train_worker.py`` has a hard time limit (the test fails,
killing every process, instead of hanging), and the outcomes are compared with one process
training the same global batch (``tests/test_distributed.py``).
"""

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.features import FeatureDataset
from eagle3.train.data import BatchPlan, length_bucketed_batches
from eagle3.train.faults import is_collective_failure, process_group_kwargs
from test_distributed import assert_same_checkpoint, launch, order
from toy import write_features

FAULT_LIMIT_S = 240  # a launch with a fault must end well inside this (the worker's own hang report comes at 300 s)
N, VAL_EVERY, MAX_TOKENS = 40, 40, 48  # 39 training samples, one validation sample (make_cfg's 48-token batches)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    """Features whose plan puts, with 2 processes x grad_accum 1, a sample with an overflowing loss
    on process 1 in step 1 and a micro-batch of NaN samples on process 0 in step 2; trained by
    one process x grad_accum 2 and by two processes."""
    root = tmp_path_factory.mktemp("faults")
    write_features(root / "plain", n=N, val_every=VAL_EVERY)
    ds = FeatureDataset(root / "plain", splits=("train",), verify=False)
    batches = BatchPlan(ds.lengths, MAX_TOKENS, 0, 1, 2).batches_of(0)  # global micro-batch i: process i % 2
    assert len(batches) >= 8  # 4 steps
    ids = ds.sample_ids
    huge = [ids[batches[3][0]]]  # step 1, process 1
    nan = [ids[j] for j in batches[4]]  # step 2, process 0: all of its micro-batch
    write_features(root / "f", n=N, val_every=VAL_EVERY, huge_ids=huge, nan_ids=nan)
    # launch's own limit: a hang shows each process's stacks (the worker's report at 300 s)
    one = launch(root / "f", root / "one", processes=1, grad_accum=2)
    two = launch(root / "f", root / "two", processes=2, grad_accum=1)
    return {"root": root, "huge": huge, "nan": nan, "ids": ids, "batches": batches, "stderr": two.stderr,
            "stderr_one": one.stderr}


def metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def test_a_process_without_a_validation_batch_takes_part_in_validation(faulty):
    root = faulty["root"]
    val = FeatureDataset(root / "f", splits=("validation",), verify=False)
    assert len(length_bucketed_batches(val.lengths, MAX_TOKENS, 0, 0)) == 1  # process 1 has no validation batch
    m1, m2 = metrics(root / "one"), metrics(root / "two")
    assert m2["num_processes"] == 2 and m1["num_processes"] == 1
    # the sums of process 0's batch and process 1's zeros: what one process computes over the same batch
    assert m2["validation"]["samples"] == m1["validation"]["samples"] == 1
    assert m2["validation"]["loss"] == pytest.approx(m1["validation"]["loss"], rel=1e-5)
    assert m2["validation"]["step_acc"] == pytest.approx(m1["validation"]["step_acc"], abs=1e-6)
    assert m2["validation"]["step_rows"] == m1["validation"]["step_rows"] and m2["validation"]["step_rows"][0] > 0


def test_a_non_finite_loss_on_one_process_skips_the_step_on_every_process(faulty):
    root = faulty["root"]
    m1, m2 = metrics(root / "one"), metrics(root / "two")
    assert m1["skipped_steps"] == m2["skipped_steps"] == 1 and m2["step"] == 4
    a, b = root / "one" / "checkpoints" / "step-00000004", root / "two" / "checkpoints" / "step-00000004"
    assert_same_checkpoint(a, b)  # the weights of one process skipping the step where its global batch overflowed
    for ckpt in (a, b):
        assert all(torch.isfinite(w).all() for w in load_file(str(ckpt / "model.safetensors")).values())
        opt = torch.load(ckpt / "optimizer.bin", weights_only=False)
        assert {int(s["step"]) for s in opt["state"].values()} == {3}  # AdamW stepped 4 - 1 times
    assert order(root / "one") == order(root / "two")
    assert any(faulty["huge"][0] in ids for step, ids in order(root / "two") if step == 1)
    # each process says so, naming the step (1-based) it skipped
    assert faulty["stderr"].count("optimizer step 2 skipped on every process") == 2
    assert faulty["stderr_one"].count("optimizer step 2 skipped on every process") == 1


def test_a_micro_batch_of_non_finite_samples_still_joins_the_gradient_all_reduce(faulty):
    root, ids, batches = faulty["root"], faulty["ids"], faulty["batches"]
    m1, m2 = metrics(root / "one"), metrics(root / "two")
    assert m1["skipped_nonfinite"] == m2["skipped_nonfinite"] == len(faulty["nan"])
    # step 2 trained on process 1's micro-batch alone; process 0 ran a loss-free stand-in
    assert dict(order(root / "two"))[2] == sorted(ids[j] for j in batches[5])


def test_a_killed_process_ends_the_run_and_the_same_command_resumes_it(faulty):
    """Under torchrun the launcher ends the survivors of a dead process (a survivor already in a
    collective fails first: gloo sees the closed connection); the checkpoints stay complete and
    the same command, run again, ends with the weights of the uninterrupted run."""
    root = faulty["root"]
    out, args = root / "killed", ["loop.save_every=1"]
    r = launch(root / "f", out, 2, 1, extra=args, env={"DIST_FAULT": "kill:1:2"}, timeout=FAULT_LIMIT_S, check=False)
    assert r.returncode != 0 and "Signal 9 (SIGKILL)" in r.stderr
    # no hang report written (a survivor ended by the launcher before its own cleanup leaves an empty one)
    assert not [h for h in out.glob("hang-*.txt") if h.stat().st_size] and not (out / "metrics.json").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]
    launch(root / "f", out, 2, 1, extra=args, timeout=FAULT_LIMIT_S)
    assert_same_checkpoint(out / "checkpoints" / "step-00000004", root / "two" / "checkpoints" / "step-00000004")
    assert metrics(out)["skipped_steps"] == 1  # the skip of step 2, before the kill, was checkpointed


def test_a_stuck_process_ends_the_others_after_the_collective_timeout_saying_how_to_resume(faulty):
    root = faulty["root"]
    out, args = root / "stuck", ["loop.save_every=1", "loop.collective_timeout_s=20"]
    r = launch(root / "f", out, 2, 1, extra=args, env={"DIST_FAULT": "hang:1:2"}, timeout=FAULT_LIMIT_S, check=False)
    assert r.returncode != 0
    err = (out / "error-0.txt").read_text()
    msg = err.strip().splitlines()[-1]
    assert msg.startswith("eagle3.errors.Eagle3Error: process 0 of 2: another training process died or stopped "
                          "answering"), err
    # gloo says which way the timeout met it: a recv 'Timed out', or (inside DDP's buffer broadcast)
    # 'Application timeout caused pair closure'
    assert "loop.collective_timeout_s=20 s" in msg and ("Timed out" in msg or "pair closure" in msg), msg
    assert f"the newest complete checkpoint is {out / 'checkpoints' / 'step-00000002'}" in msg, msg
    assert "run the same command again to resume from it" in msg, msg
    launch(root / "f", out, 2, 1, extra=args, timeout=FAULT_LIMIT_S)
    assert_same_checkpoint(out / "checkpoints" / "step-00000004", root / "two" / "checkpoints" / "step-00000004")


def test_the_collective_timeout_reaches_the_process_group_as_set():
    # Accelerate passes on only the values that differ from its defaults (600 s among them)
    assert process_group_kwargs(20).to_kwargs()["timeout"] == timedelta(seconds=20)
    t = process_group_kwargs(600).to_kwargs()["timeout"]
    assert timedelta(seconds=600) < t < timedelta(seconds=600, milliseconds=1)


def test_only_failed_collectives_count_as_a_peer_failure():
    gloo = "[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation"
    assert is_collective_failure(RuntimeError(gloo))
    # gloo's timeout inside DDP's buffer broadcast carries no backend name
    assert is_collective_failure(RuntimeError("Application timeout caused pair closure"))
    assert is_collective_failure(torch.distributed.DistBackendError("NCCL communicator was aborted"))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))
    assert not is_collective_failure(torch.OutOfMemoryError("CUDA out of memory (nccl buffers)"))
    assert not is_collective_failure(ValueError("gloo"))
