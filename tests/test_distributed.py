"""Data-parallel training on CPU (gloo): N processes equal one process with the same global batch.

Each case launches ``tests/dist_train_worker.py`` through ``accelerate launch`` (the
command users run on GPUs) and compares checkpoints tensor by tensor.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from toy import write_features

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "dist_train_worker.py"
# feature noise on: its per-micro-batch seeds must make N processes equal one and resumes exact as well
COMMON = ["loop.max_steps=4", "loop.save_every=1000", "drafter.feature_noise=0.1"]


def launch(features: Path, out: Path, processes: int, grad_accum: int, stop_after=None, extra=(), env=None,
           timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """Train ``processes`` processes of the worker; ``env`` adds to the environment. Past ``timeout``
    seconds the launcher and every process are killed and the test fails; ``check``: a launch
    that fails fails the test with each process's report."""
    args = ([str(features), str(out)] + ([str(stop_after)] if stop_after else []) + COMMON
            + [f"loop.grad_accum={grad_accum}", *extra])
    if processes == 1:
        cmd = [sys.executable, str(WORKER), *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(29500 + os.getpid() % 1000), str(WORKER), *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", **(env or {}))
    for f in [*out.glob("error-*.txt"), *out.glob("hang-*.txt")]:  # reports of an earlier launch in this folder
        f.unlink()
    # a session of its own, so that a launch past its time goes with all its processes, not the launcher alone
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        pytest.fail(f"the launch did not end within {timeout} s\n" + rank_errors(out) + stderr[-4000:])
    r = subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)
    if check:
        assert r.returncode == 0, rank_errors(out) + r.stderr[-4000:]
    return r


def rank_errors(out: Path) -> str:
    """What each failed process left (written by the worker): its traceback (``error-<rank>.txt``)
    or, when it hung, the stacks of its threads (``hang-<rank>.txt``)."""
    reports = sorted([*out.glob("error-*.txt"), *out.glob("hang-*.txt")])
    return "".join(f"--- {f.name}\n{f.read_text()}\n" for f in reports)


def order(out: Path) -> list:
    """``[(step, sorted sample ids of the step)]`` over all processes."""
    steps: dict[int, list] = {}
    for f in sorted(out.glob("order-*.jsonl")):
        for line in f.read_text().splitlines():
            _, step, ids = json.loads(line)
            steps.setdefault(step, []).extend(ids)
    return [(s, sorted(ids)) for s, ids in sorted(steps.items())]


def assert_same_checkpoint(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6, msg=k)
    oa = torch.load(a / "optimizer.bin", weights_only=False)
    ob = torch.load(b / "optimizer.bin", weights_only=False)
    for i in oa["state"]:
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(oa["state"][i][k], ob["state"][i][k], rtol=1e-5, atol=1e-8)
    sa = torch.load(a / "custom_checkpoint_0.pkl", weights_only=False)
    sb = torch.load(b / "custom_checkpoint_0.pkl", weights_only=False)
    assert sa["_last_lr"] == sb["_last_lr"]
    ta = torch.load(a / "custom_checkpoint_1.pkl", weights_only=False)
    tb = torch.load(b / "custom_checkpoint_1.pkl", weights_only=False)
    assert ta == tb  # TrainState: epoch, micro-batch, step, tokens in global units


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    write_features(root / "f", n=40)
    launch(root / "f", root / "one", processes=1, grad_accum=2)
    launch(root / "f", root / "two", processes=2, grad_accum=1)
    return root


def test_two_processes_equal_one_process_with_the_same_global_batch(runs):
    one, two = runs / "one", runs / "two"
    assert len(list(two.glob("order-*.jsonl"))) == 2  # really two processes
    assert order(one) == order(two) and len(order(one)) == 4
    assert_same_checkpoint(one / "checkpoints" / "step-00000004", two / "checkpoints" / "step-00000004")
    m1, m2 = (json.loads((d / "metrics.json").read_text()) for d in (one, two))
    assert (m1["num_processes"], m2["num_processes"]) == (1, 2)
    assert m2["distributed_type"] == "MULTI_CPU"
    assert m1["train_tokens"] == m2["train_tokens"]
    assert m1["train"]["loss"] == pytest.approx(m2["train"]["loss"], rel=1e-5)
    assert m1["validation"]["loss"] == pytest.approx(m2["validation"]["loss"], rel=1e-5)
    assert m1["validation"]["step_acc"] == pytest.approx(m2["validation"]["step_acc"], abs=1e-6)


def test_checkpoint_of_two_processes_resumes_in_one(runs):
    out = runs / "resumed"
    launch(runs / "f", out, processes=2, grad_accum=1, stop_after=2)
    assert (out / "checkpoints" / "step-00000002" / "COMPLETE").exists() and not (out / "export").exists()
    launch(runs / "f", out, processes=1, grad_accum=2)
    assert order(out) == order(runs / "one")  # no micro-batch repeated or skipped across the switch
    assert_same_checkpoint(out / "checkpoints" / "step-00000004", runs / "one" / "checkpoints" / "step-00000004")


def test_resume_with_another_global_batch_is_refused(runs):
    out = runs / "refused"
    launch(runs / "f", out, processes=2, grad_accum=1, stop_after=2)
    with pytest.raises(AssertionError, match="micro_batches_per_step=2"):
        launch(runs / "f", out, processes=1, grad_accum=1)


def test_two_processes_with_the_compiled_drafter_and_fused_loss_train_the_eager_single_process_weights(runs):
    # loop.compile_drafter and loop.fused_loss under DDP: the compiled norms and MLPs inside the
    # wrapped model, lm_head.weight used by the fused loss outside lm_head's forward, the gradients
    # all-reduced through DDP's parameter hooks; the same samples and, up to float32 rounding
    # (fused kernels, recomputed logits), the same weights as one eager process
    out = runs / "two-compiled"
    launch(runs / "f", out, processes=2, grad_accum=1, extra=["loop.compile_drafter=true", "loop.fused_loss=true"])
    assert order(out) == order(runs / "one")
    a = load_file(str(out / "checkpoints" / "step-00000004" / "model.safetensors"))
    b = load_file(str(runs / "one" / "checkpoints" / "step-00000004" / "model.safetensors"))
    assert a.keys() == b.keys()  # Module.compile keeps the parameter names
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)
    m, eager = (json.loads((d / "metrics.json").read_text()) for d in (out, runs / "one"))
    assert m["num_processes"] == 2 and m["compiled_modules"] > 0 and eager["compiled_modules"] == 0
    assert m["fused_loss"] and not eager["fused_loss"]
