"""engine=remote: a capture node and the trainer as two processes on 127.0.0.1, the features
moving through a Mooncake store (hs-connectors' MooncakeHiddenStatesStore over TCP).

Needs Mooncake's non-CUDA build (``scripts/install-mooncake-cpu.sh``, which .ci/run runs);
skipped, with the reason, without it."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3.errors import Eagle3Error

from mooncake_env import ROOT, child_env, free_port, import_mooncake, start_master


def _import_mooncake():
    try:
        import_mooncake()
    except ImportError as e:
        pytest.skip(f"Mooncake is not importable ({e}); run scripts/install-mooncake-cpu.sh")


_free_port = free_port  # the name other test modules import


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the process ended with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"no /health from {url} in {timeout} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Node:
    """A Mooncake master and a capture node serving the tiny target, as subprocesses."""

    def __init__(self, target_dir: Path, work: Path):
        self.target_dir, self.work = target_dir, work
        self.master_log = work / "master.log"
        self.master_proc, self.master = start_master(self.master_log)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.start()

    def start(self) -> None:
        self.log = self.work / f"node-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "eagle3.engines.remote", "--port", str(self.port), "--master", self.master,
               "--segment-mb", "64", "model=smollm2-135m-bf16", "model.name=tiny", f"model.source={self.target_dir}",
               f"cache_dir={self.work / 'cache'}", "engine.device=cpu", "engine.capture_batch_size=1"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        _wait(self.url, self.proc, self.log)

    def close(self) -> None:
        _stop(self.proc)
        _stop(self.master_proc)


@pytest.fixture(scope="module")
def node(tiny_target_dir, tmp_path_factory):
    _import_mooncake()
    n = Node(tiny_target_dir, tmp_path_factory.mktemp("remote"))
    yield n
    n.close()


def _remote_cfg(node, **over):
    from eagle3.config import RemoteEngineConfig

    return RemoteEngineConfig(url=node.url, master=node.master, segment_mb=64, fetch_timeout_s=30, **over)


def test_remote_capture_equals_the_in_process_capture_and_leaves_nothing_in_the_store(node, tiny_target_dir, tmp_path):
    """Same engine (hf, CPU, bf16, one sequence a forward) in the node and here: bit-equal tensors."""
    from eagle3.config import HFEngineConfig, ModelConfig
    from eagle3.engines import build_engine

    model = ModelConfig(name="tiny", source=str(tiny_target_dir))
    remote = build_engine(model, _remote_cfg(node), tmp_path / "cache", None)
    local = build_engine(model, HFEngineConfig(device="cpu", capture_batch_size=1), tmp_path / "cache", None)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 17, 40)]
    got, want = remote.capture(seqs, 4), local.capture(seqs, 4)
    for a, b in zip(got, want):
        assert a.aux_hidden_states.dtype == torch.bfloat16 and a.aux_hidden_states.shape == b.aux_hidden_states.shape
        for k in ("aux_hidden_states", "topk_ids", "topk_logprobs"):
            assert torch.equal(getattr(a, k), getattr(b, k)), k
    assert remote.info() == {"name": "remote", "node": local.info()}
    # a published capture is in the store until read, and removed by reading it
    from eagle3.engines.remote.transfer import fetch

    ms = remote.client.request("POST", "/capture", {"request": "t1", "sequences": seqs[:2], "top_k": 4})["manifests"]
    raw = remote.store._require_store()
    assert [m["handle"] for m in ms] == ["t1/0", "t1/1"] and [raw.is_exist(m["handle"]) for m in ms] == [1, 1]
    assert torch.equal(fetch(remote.store, ms[1]).topk_ids, want[1].topk_ids)
    assert [raw.is_exist(m["handle"]) for m in ms] == [1, 0]
    with pytest.raises(Eagle3Error, match="refused POST /capture with HTTP 400"):
        remote.capture([[]], 4)
    with pytest.raises(Eagle3Error, match="captures features for online training only"):
        remote.generate([[1, 2]], None)


def test_online_training_through_the_node_equals_in_process_online_training(node, tiny_target_dir, tmp_path):
    from test_online import _extract, _train_cfg, assert_same_weights, weights

    from eagle3.train.run import run_train

    _extract(tiny_target_dir, tmp_path, tmp_path / "replies", mode="none")
    over = {"loop.max_steps": 2, "loop.max_tokens_per_batch": 512, "features.mode": "online"}
    here = run_train(_train_cfg(tiny_target_dir, tmp_path, tmp_path / "replies", tmp_path / "a", **over))
    cfg = _train_cfg(tiny_target_dir, tmp_path, tmp_path / "replies", tmp_path / "b", **over)
    cfg.engine = _remote_cfg(node)
    there = run_train(cfg)
    assert there["features"]["engine"]["name"] == "remote" and there["train_run"]["loss"] == here["train_run"]["loss"]
    assert there["features"]["captured_tokens"] == here["features"]["captured_tokens"] > 0
    assert_same_weights(weights(tmp_path / "a", 2), weights(tmp_path / "b", 2))


def test_a_node_that_restarts_mid_training_costs_a_retry_not_a_batch(node, tiny_target_dir, tmp_path):
    """The node killed between two micro-batches and started again: the trainer waits and goes on."""
    import threading

    from eagle3.config import ModelConfig
    from eagle3.engines import build_engine
    from eagle3.train.online import OnlineFeatures

    remote = build_engine(ModelConfig(name="tiny", source=str(tiny_target_dir)), _remote_cfg(node), tmp_path / "c", None)
    online = OnlineFeatures(remote, top_k=4, max_length=4096, remote=True, retry_timeout_s=120)
    sample = {"sample_id": "s0", "input_ids": torch.arange(3, 20), "loss_mask": torch.ones(17, dtype=torch.uint8)}
    first = online.features_of([sample])[0]
    node.proc.kill()
    node.proc.wait()
    restart = threading.Timer(2.0, node.start)
    restart.start()
    again = online.features_of([sample])[0]
    restart.join()
    assert online.stats.retries >= 1 and torch.equal(first["aux_hidden_states"], again["aux_hidden_states"])


def test_a_node_serving_another_build_is_refused_with_both_machines():
    import types

    from eagle3.engines.remote.engine import check_node_target

    build = {"built_utc": "2026-12-03T00:00:00", "cpu": "Xeon", "cpu_capability": "AVX512", "gpu": None}
    here = types.SimpleNamespace(name="smol", content_hash="sha256:b", aux_layer_ids=[2, 15, 27], hidden_size=576,
                                 build={**build, "cpu": "EPYC", "cpu_capability": "AVX2"}, path="data/models/smol-w4a16")
    node = {"name": "smol", "content_hash": "sha256:a", "aux_layer_ids": [2, 15, 27], "hidden_size": 576, "build": build}
    with pytest.raises(Eagle3Error, match=r"content hash sha256:a.*AVX512 CPU.*AVX2 CPU.*Copy the folder smol-w4a16"):
        check_node_target(node, here, "http://n:1")
    with pytest.raises(Eagle3Error, match=r"aux_layer_ids=\[1, 2, 3\]"):
        check_node_target({**node, "content_hash": "sha256:b", "aux_layer_ids": [1, 2, 3]}, here, "http://n:1")
    check_node_target({**node, "content_hash": "sha256:b"}, here, "http://n:1")  # the same target: no error
