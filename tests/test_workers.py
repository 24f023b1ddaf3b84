"""eagle3.workers.run_workers: crashed workers are started again, settings errors are not."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.errors import Eagle3Error
from eagle3.workers import run_workers


def flaky(cfg: dict) -> None:
    """A stage function for spawned workers: counts its launches in ``<dir>/w<w>.launches``,
    fails its first ``fail`` launches (``RuntimeError``: exit code 1; ``Eagle3Error``: exit
    code 2 when ``setting_error``; out of memory at every batch size when ``oom``: the batch
    runner's ``GPUMemoryError``, exit code 3), then writes ``<dir>/w<w>.done``, and into
    ``<dir>/w<w>.saw`` which workers had written theirs by then."""
    d, w = Path(cfg["dir"]), cfg["w"]
    launches = d / f"w{w}.launches"
    n = int(launches.read_text()) + 1 if launches.exists() else 1
    launches.write_text(str(n))
    if n <= cfg.get("fail", 0):
        if cfg.get("setting_error"):
            raise Eagle3Error("a bad setting")
        if cfg.get("oom"):
            import torch

            from eagle3.engines.hf.oom import run_in_batches

            def run(idx):
                raise torch.OutOfMemoryError("CUDA out of memory (simulated: another replica holds the GPU)")

            run_in_batches({"rows": 8}, ("rows",), [10, 10], lambda ls: [list(range(len(ls)))], run, "generate")
        raise RuntimeError("CUDA out of memory (simulated)")
    (d / f"w{w}.saw").write_text(" ".join(sorted(p.name for p in d.glob("w*.done"))))
    (d / f"w{w}.done").write_text("ok")


def launches(d: Path, w: int) -> int:
    return int((d / f"w{w}.launches").read_text())


def test_a_crashed_worker_is_started_again_alone(tmp_path):
    cfgs = [{"dir": str(tmp_path), "w": 0}, {"dir": str(tmp_path), "w": 1, "fail": 1}]
    run_workers("test_workers.flaky", cfgs, "extraction", retries=1)
    assert (launches(tmp_path, 0), launches(tmp_path, 1)) == (1, 2)  # only the crashed one again
    assert (tmp_path / "w0.done").exists() and (tmp_path / "w1.done").exists()


def test_retries_run_out(tmp_path):
    cfgs = [{"dir": str(tmp_path), "w": 0, "fail": 3}]
    with pytest.raises(Eagle3Error, match=r"worker\(s\) 0 \(exit code 1\) failed.*run the same command again"):
        run_workers("test_workers.flaky", cfgs, "extraction", retries=2)
    assert launches(tmp_path, 0) == 3 and not (tmp_path / "w0.done").exists()


def test_a_settings_error_is_not_retried(tmp_path):
    cfgs = [{"dir": str(tmp_path), "w": 0, "fail": 1, "setting_error": True}, {"dir": str(tmp_path), "w": 1, "fail": 1}]
    with pytest.raises(Eagle3Error, match=r"worker\(s\) 0 \(exit code 2\), 1 \(exit code 1\) failed"):
        run_workers("test_workers.flaky", cfgs, "extraction", retries=3)
    assert (launches(tmp_path, 0), launches(tmp_path, 1)) == (1, 1)


def test_a_worker_out_of_gpu_memory_at_its_smallest_batches_is_started_again_after_the_others(tmp_path):
    """Halving its batches could not make room (another replica held the memory): that is no bad setting
    (exit code 3, not 2), so the worker runs again, alone, once the others are done."""
    cfgs = [{"dir": str(tmp_path), "w": 0}, {"dir": str(tmp_path), "w": 1, "fail": 1, "oom": True}]
    run_workers("test_workers.flaky", cfgs, "extraction", retries=1)
    assert (launches(tmp_path, 0), launches(tmp_path, 1)) == (1, 2)
    assert (tmp_path / "w1.saw").read_text() == "w0.done"  # its second launch came after worker 0 ended


def test_out_of_gpu_memory_past_the_retries_names_its_exit_code(tmp_path):
    cfgs = [{"dir": str(tmp_path), "w": 0, "fail": 2, "oom": True}]
    with pytest.raises(Eagle3Error, match=r"worker\(s\) 0 \(exit code 3\) failed.*run the same command again"):
        run_workers("test_workers.flaky", cfgs, "extraction", retries=1)
    assert launches(tmp_path, 0) == 2
