"""Online training (features=online) against offline training, resume, the hybrid cache, bad input.

The toy capture engine computes the toy target's features from the token ids alone
(:func:`toy_capture`), so the same ids give the same features whether they were stored by an
extraction or captured while training: every comparison below is exact (``torch.equal``).
The real-target tests run the in-process ``hf`` engine on the tiny Llama of conftest.py.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.errors import Eagle3Error
from eagle3.features import Capture, FeatureDataset, FeatureWriter, Record
from eagle3.train.feature_cache import FeatureCache
from eagle3.train.run import train_drafter
from toy import H, K, V, embed, feature_table, make_cfg, tiny_target, toy_sequence

pytestmark = pytest.mark.usefixtures("one_thread")

LOGITS = torch.tensor([4.0, 1.0, 0.5, 0.0])


def toy_capture(ids: list[int]) -> Capture:
    """The toy target's features of ``ids``: each aux state the token's feature row, the top-k
    the rule's next token first (toy.py)."""
    t = torch.tensor(ids, dtype=torch.int64)
    aux = feature_table()[t][:, None, :].repeat(1, 3, 1).bfloat16()
    top = torch.stack([(3 * t + 1 + k) % V for k in range(K)], 1).int()
    lp = torch.log_softmax(LOGITS, -1).expand(len(ids), K).clone()
    return Capture(aux, top, lp)


class ToyEngine:
    """A capture engine over :func:`toy_capture` that records every call; ``fail`` makes the
    calls numbered in it raise (a capture server that died), ``name`` is what ``info`` says."""

    device = torch.device("cpu")

    def __init__(self, name="hf", fail=()):
        self.name, self.fail, self.calls, self.closed = name, set(fail), [], False

    def info(self):
        return {"name": self.name}

    def capture(self, seqs, top_k):
        n = len(self.calls)
        self.calls.append([tuple(s) for s in seqs])
        if n in self.fail:
            raise Eagle3Error("connection refused")
        assert top_k == K
        return [toy_capture(s) for s in seqs]

    def close(self):
        self.closed = True


def write_toy(d, n=30, features=True, content_hash="sha256:tiny", template="sha256:tmpl"):
    """A toy folder of ``n`` samples (every 6th in validation): features (offline) or the
    kept replies alone (``metadata.features = none``, as ``extract.py features=none``)."""
    g = torch.Generator().manual_seed(0)
    plan = [(f"s{i}", "validation" if i % 6 == 5 else "train") for i in range(n)]
    meta = {"target": {"content_hash": content_hash, "hidden_size": H, "vocab_size": V, "architecture": "llama",
                       "quantization": {"method": "none"}, "name": "tiny"},
            "aux_layer_ids": [2, 4, 5], "chat_template_hash": template, "capture": {"top_k": K},
            "sample_layout": "target_ids"}
    if not features:
        meta["features"] = "none"
    w = FeatureWriter.open(d, meta, plan, samples_per_shard=8)
    for idx, chunk in w.pending():
        recs = []
        for sid, split in chunk:
            ids, _ = toy_sequence(g, feature_table())
            mask = torch.ones(len(ids), dtype=torch.uint8)
            mask[:2] = 0
            recs.append(Record(sid, split, ids, mask, toy_capture(ids.tolist()) if features else None))
        w.write_shard(idx, recs)
    return w.finalize()


def weights(out: Path, step: int) -> dict:
    return load_file(str(out / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


OVER = {"loop.max_steps": 6, "loop.grad_accum": 2}


def test_online_training_equals_offline_training_on_the_same_ids(tmp_path):
    write_toy(tmp_path / "offline")
    write_toy(tmp_path / "replies", features=False)
    tgt, E = tiny_target(), embed()
    off = train_drafter(make_cfg(tmp_path / "offline", tmp_path / "a", **OVER), tgt, E)
    engine = ToyEngine()
    on = train_drafter(make_cfg(tmp_path / "replies", tmp_path / "b", **OVER, **{"features.mode": "online"}), tgt, E,
                       engine=engine)
    assert off["step"] == on["step"] == 6
    assert on["train_run"]["loss"] == off["train_run"]["loss"]
    assert on["validation"]["loss"] == off["validation"]["loss"]
    assert_same_weights(weights(tmp_path / "a", 6), weights(tmp_path / "b", 6))
    assert engine.closed
    # the replies folder stores ids and masks alone: 5 bytes a token plus the safetensors headers
    f_on, f_off = on["features"], off["features"]
    assert f_off["mode"] == "offline" and f_on["mode"] == "online"
    assert 5 <= f_on["disk_bytes_per_token"] < 10 < 3 * H * 2 < f_off["disk_bytes_per_token"]
    # 6 steps x 2 micro-batches handed to the trainer; the engine captured those, the validation batches and
    # what the producer had captured ahead when the last step ended
    assert f_on["batches"] == 12 and 0.0 <= f_on["idle_fraction"] <= 1.0
    assert f_on["captured_tokens"] == sum(len(c) for call in engine.calls for c in call) > on["train_tokens"]
    assert f_on["capture_tokens_per_s"] > 0 and f_on["trainer_tokens_per_s"] > 0
    # online training may read the ids of a features folder too, and gets the same drafter
    train_drafter(make_cfg(tmp_path / "offline", tmp_path / "c", **OVER, **{"features.mode": "online"}), tgt, E,
                  engine=ToyEngine())
    assert_same_weights(weights(tmp_path / "a", 6), weights(tmp_path / "c", 6))


def test_an_interrupted_online_run_captures_the_same_batches_in_the_same_order(tmp_path):
    write_toy(tmp_path / "r", features=False)
    tgt, E = tiny_target(), embed()
    cfg = lambda out: make_cfg(tmp_path / "r", out, **OVER, **{"features.mode": "online", "loop.eval_every": 100})
    full_engine = ToyEngine()
    train_drafter(cfg(tmp_path / "a"), tgt, E, engine=full_engine)
    first, second = ToyEngine(), ToyEngine()
    part = train_drafter(cfg(tmp_path / "b"), tgt, E, engine=first, stop_after=2)
    assert part["interrupted"] and first.closed
    train_drafter(cfg(tmp_path / "b"), tgt, E, engine=second)
    # the resumed launch captured exactly the micro-batches after the checkpoint (step 2 = 4 micro-batches),
    # in the uninterrupted order; the first launch's producer may have run ahead of its checkpoint
    trained = [c for c in full_engine.calls]
    assert second.calls == trained[4:]
    assert first.calls[:4] == trained[:4]
    assert_same_weights(weights(tmp_path / "a", 6), weights(tmp_path / "b", 6))


def test_the_hybrid_cache_reads_later_epochs_back_and_survives_a_damaged_file(tmp_path, caplog):
    write_toy(tmp_path / "r", features=False)
    tgt, E = tiny_target(), embed()
    over = {**OVER, "loop.max_steps": None, "loop.epochs": 3, "features.mode": "online"}
    plain = ToyEngine()
    train_drafter(make_cfg(tmp_path / "r", tmp_path / "a", **over), tgt, E, engine=plain)
    cached = ToyEngine()
    m = train_drafter(make_cfg(tmp_path / "r", tmp_path / "b", **over, **{"features.cache_gb": 1.0}), tgt, E,
                      engine=cached)
    steps = m["step"]
    assert_same_weights(weights(tmp_path / "a", steps), weights(tmp_path / "b", steps))
    f = m["features"]
    captured = {s for call in cached.calls for s in call}
    # every sample captured once (the cache holds them all), later epochs and validations read back
    assert sum(len(c) for c in cached.calls) == len(captured) < sum(len(c) for c in plain.calls)
    assert f["cached_samples"] > 0 and 0 < f["cache_bytes"] <= 1e9
    # a budget smaller than the features: what fits is kept, the rest captured every epoch
    small = ToyEngine()
    one_file = (tmp_path / "b" / "feature_cache" / "part-000000.safetensors").stat().st_size
    train_drafter(make_cfg(tmp_path / "r", tmp_path / "c", **over, **{"features.cache_gb": 2.5 * one_file / 1e9}),
                  tgt, E, engine=small)
    assert len(plain.calls) > len(small.calls) > len(cached.calls)
    assert len(json.loads((tmp_path / "c" / "feature_cache" / "index.json").read_text())["files"]) == 2
    # a damaged cache file is detected by its sha256, dropped, and its samples captured again
    cache = FeatureCache(tmp_path / "b" / "feature_cache", int(1e9))
    sid = next(iter(cache.where))
    path = tmp_path / "b" / "feature_cache" / cache.where[sid][0]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert cache.get(sid) is None and sid not in cache and not path.exists()
    assert "fails its sha256 check" in caplog.text


def test_a_capture_server_that_fails_is_retried_on_the_same_batch(tmp_path, monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    write_toy(tmp_path / "r", features=False)
    tgt, E = tiny_target(), embed()
    cfg = lambda out, **o: make_cfg(tmp_path / "r", out, **OVER, **{"features.mode": "online", **o})
    ok, flaky = ToyEngine("vllm"), ToyEngine("vllm", fail={3, 4})
    train_drafter(cfg(tmp_path / "a"), tgt, E, engine=ok)
    m = train_drafter(cfg(tmp_path / "b"), tgt, E, engine=flaky)
    assert m["features"]["retries"] == 2
    assert flaky.calls[3] == flaky.calls[4] == flaky.calls[5] == ok.calls[3]  # the same batch, no other in between
    assert flaky.calls[:3] + flaky.calls[5:] == ok.calls
    assert_same_weights(weights(tmp_path / "a", 6), weights(tmp_path / "b", 6))
    # a server that stays down ends the run with a clear error once features.retry_timeout_s is spent
    down = ToyEngine("vllm", fail=set(range(100)))
    with pytest.raises(Eagle3Error, match="failed on one micro-batch.*features.retry_timeout_s"):
        train_drafter(cfg(tmp_path / "c", **{"features.retry_timeout_s": 0}), tgt, E, engine=down)
    # the in-process engine is not retried: its error is the run's
    with pytest.raises(Eagle3Error, match="connection refused"):
        train_drafter(cfg(tmp_path / "d"), tgt, E, engine=ToyEngine("hf", fail={2}))
    # nor is a server's refusal (HTTP 4xx): the same request would be refused again
    from eagle3.engines.http import RequestRefused

    class Refusing(ToyEngine):
        def capture(self, seqs, top_k):
            self.calls.append(seqs)
            raise RequestRefused("the capture node refused POST /capture with HTTP 400: 'top_k' must be in 1..64")

    refusing = Refusing("vllm")
    with pytest.raises(RequestRefused, match="HTTP 400"):
        train_drafter(cfg(tmp_path / "e"), tgt, E, engine=refusing)
    assert len(refusing.calls) == 1  # tried once, not for features.retry_timeout_s


def test_replies_of_another_target_or_template_and_bad_settings_are_refused(tmp_path, tiny_target_dir):
    write_toy(tmp_path / "r", features=False, content_hash="sha256:other")
    engine = ToyEngine()
    with pytest.raises(Eagle3Error, match="target weights sha256:other"):
        train_drafter(make_cfg(tmp_path / "r", tmp_path / "a", **{"features.mode": "online"}), tiny_target(), embed(),
                      engine=engine)
    assert engine.calls == []  # refused before anything was captured
    write_toy(tmp_path / "r2", features=False)
    with pytest.raises(Eagle3Error, match="holds the kept replies alone.*features=online"):
        train_drafter(make_cfg(tmp_path / "r2", tmp_path / "b"), tiny_target(), embed())
    with pytest.raises(Eagle3Error, match="features.cache_gb.*needs features=online"):
        train_drafter(make_cfg(tmp_path / "r2", tmp_path / "c", **{"features.cache_gb": 1.0}), tiny_target(), embed())
    with pytest.raises(Eagle3Error, match="features=none is not a training mode"):
        train_drafter(make_cfg(tmp_path / "r2", tmp_path / "d", **{"features.mode": "none"}), tiny_target(), embed())
    with pytest.raises(Eagle3Error, match="features.queue_depth=0"):
        train_drafter(make_cfg(tmp_path / "r2", tmp_path / "e", **{"features.mode": "online",
                                                                   "features.queue_depth": 0}), tiny_target(), embed())


def test_a_producer_error_reaches_the_trainer_without_a_hang(tmp_path):
    write_toy(tmp_path / "r", features=False)

    class Broken(ToyEngine):
        def capture(self, seqs, top_k):
            return [toy_capture(s[:-1]) for s in seqs]  # one position short

    with pytest.raises(Eagle3Error, match="returned .* positions for the"):
        train_drafter(make_cfg(tmp_path / "r", tmp_path / "a", **{"features.mode": "online"}), tiny_target(), embed(),
                      engine=Broken())


# ---------------------------------------------------------------- the real (tiny) target, engine=hf
def _extract(tiny_target_dir, tmp_path, out, mode="offline"):
    from eagle3.config import FeaturesConfig, HFEngineConfig
    from eagle3.extract.run import run_extract
    from test_extract import CHATS, _cfg, _write_jsonl

    data = _write_jsonl(tmp_path / "chats.jsonl", CHATS)
    cfg = _cfg(tiny_target_dir, tmp_path, data, out)
    cfg.engine = HFEngineConfig(device="cpu", generate_batch_size=2, capture_batch_size=1, max_batch_tokens=512)
    cfg.features = FeaturesConfig(mode=mode)
    return run_extract(cfg)


def _train_cfg(tiny_target_dir, tmp_path, features_dir, out, **over):
    cfg = make_cfg(features_dir, out, **{"model.source": str(tiny_target_dir), "cache_dir": str(tmp_path / "cache"),
                                         "drafter.draft_vocab_size": None, "loop.max_tokens_per_batch": 256,
                                         "engine.device": "cpu", "engine.capture_batch_size": 1, **over})
    return cfg


def test_extract_features_none_writes_the_kept_replies_alone(tiny_target_dir, tmp_path, capsys):
    full = _extract(tiny_target_dir, tmp_path, tmp_path / "offline")
    replies = _extract(tiny_target_dir, tmp_path, tmp_path / "replies", mode="none")
    out = capsys.readouterr().out
    assert "kept replies alone, features=none" in out
    # the same replies (greedy, same seed), ids and masks only
    assert (replies["samples"], replies["tokens"], replies["masked_tokens"]) == (full["samples"], full["tokens"],
                                                                                 full["masked_tokens"])
    assert replies["features"] == "none" and replies["offline_bytes_per_token"] == 3 * 64 * 2 + 4 * 8 + 5
    assert 5 <= replies["bytes_per_token"] < 0.05 * full["bytes_per_token"]
    m = json.loads((tmp_path / "replies" / "manifest.json").read_text())
    assert m["metadata"]["features"] == "none" and "features" not in json.loads(
        (tmp_path / "offline" / "manifest.json").read_text())["metadata"]
    for sh in m["shards"]:
        if sh["file"]:
            assert sorted(load_file(str(tmp_path / "replies" / sh["file"]))) == ["input_ids", "loss_mask", "offsets"]
    a = FeatureDataset(tmp_path / "offline", splits=("train", "validation"), features=False)
    b = FeatureDataset(tmp_path / "replies", splits=("train", "validation"), features=False)
    assert a.sample_ids == b.sample_ids
    for i in range(len(a)):
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"]) and torch.equal(a[i]["loss_mask"], b[i]["loss_mask"])
    with pytest.raises(Eagle3Error, match="holds the kept replies alone"):
        FeatureDataset(tmp_path / "replies")


def test_online_features_equal_offline_features_and_one_step_gives_the_same_loss(tiny_target_dir, tmp_path):
    """Same engine (hf, CPU), dtype (bf16) and batch shape (one sequence a capture forward): online
    features are the offline ones bit for bit (tolerance 0), and so is a training step."""
    from eagle3.config import HFEngineConfig, ModelConfig
    from eagle3.engines.hf.engine import HFEngine
    from eagle3.train.online import OnlineFeatures
    from eagle3.train.run import run_train

    _extract(tiny_target_dir, tmp_path, tmp_path / "offline")
    stored = FeatureDataset(tmp_path / "offline", splits=("train", "validation"))
    ids_only = FeatureDataset(tmp_path / "offline", splits=("train", "validation"), features=False)
    engine = HFEngine.from_config(ModelConfig(name="tiny", source=str(tiny_target_dir)),
                                  HFEngineConfig(device="cpu", capture_batch_size=1), tmp_path / "cache")
    online = OnlineFeatures(engine, top_k=4, max_length=4096)
    got = online.features_of([ids_only[i] for i in range(len(ids_only))])
    for i, g in enumerate(got):
        for k in ("aux_hidden_states", "topk_ids", "topk_logprobs"):
            assert torch.equal(g[k], stored[i][k]), (stored[i]["sample_id"], k)
    over = {"loop.max_steps": 1, "loop.max_tokens_per_batch": 4096}
    off = run_train(_train_cfg(tiny_target_dir, tmp_path, tmp_path / "offline", tmp_path / "a", **over))
    on = run_train(_train_cfg(tiny_target_dir, tmp_path, tmp_path / "offline", tmp_path / "b", **over,
                              **{"features.mode": "online"}))
    assert on["train_run"]["loss"] == off["train_run"]["loss"] and on["features"]["engine"]["name"] == "hf"
    assert_same_weights(weights(tmp_path / "a", 1), weights(tmp_path / "b", 1))


def test_replies_rendered_with_another_chat_template_are_refused_before_the_first_step(tiny_target_dir, tmp_path):
    from eagle3.train.run import run_train

    _extract(tiny_target_dir, tmp_path, tmp_path / "replies", mode="none")
    path = tmp_path / "replies" / "manifest.json"
    m = json.loads(path.read_text())
    m["metadata"]["chat_template_hash"] = "sha256:another"
    path.write_text(json.dumps(m))
    with pytest.raises(Eagle3Error, match="rendered with chat template sha256:another"):
        run_train(_train_cfg(tiny_target_dir, tmp_path, tmp_path / "replies", tmp_path / "a",
                             **{"features.mode": "online"}))
    assert not (tmp_path / "a" / "checkpoints").exists()


@pytest.mark.parametrize("setting, want", [(None, True), (False, False), (True, True)])
def test_the_in_process_capture_engine_of_online_training_compiles_its_layers_by_default(tmp_path, monkeypatch,
                                                                                        setting, want):
    """``engine.compile_layers=null`` (auto) builds online training's hf engine with compiled layers
    (on CUDA; ``wants_compile`` keeps them eager off it); an explicit setting is kept."""
    import types

    import eagle3.engines as engines
    from eagle3.config import FeaturesConfig, HFEngineConfig
    from eagle3.train.online import build_online

    seen = {}

    class Engine:
        tokenizer = object()  # the replies record no template hash, so it is not rendered

        def info(self):
            return {"name": "hf"}

        def close(self):
            pass

    def fake_build(model_cfg, engine_cfg, cache_dir, run_dir=None):
        seen["cfg"] = engine_cfg
        return Engine()

    monkeypatch.setattr(engines, "build_engine", fake_build)
    cfg = types.SimpleNamespace(engine=HFEngineConfig(device="cpu", compile_layers=setting), model=None,
                                cache_dir=tmp_path, features=FeaturesConfig(), features_dir=tmp_path)
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), num_processes=1, process_index=0)
    ds = types.SimpleNamespace(metadata={})
    online = build_online(cfg, None, ds, tmp_path, accelerator, 1024, engine=None)
    assert seen["cfg"].compile_layers is want and seen["cfg"].device == "cpu"
    online.close()
