"""Online against offline training: the drafter's tokens/s when the target captures each
micro-batch's features while the drafter trains (``features=online``, the in-process ``hf``
engine on the same device) against reading them from the feature store (``features=offline``).

    python benchmarks/online_throughput.py --device cuda --samples 3000 --steps 200 --rounds 3
    python benchmarks/online_throughput.py --device cpu --layers 8 --samples 24 --steps 3 --rounds 2 \\
        --max-tokens 1024 --max-len 256

Target: a Llama of SmolLM2-135M's shape with random weights (``--layers`` of them; speed does
not depend on the values) or ``--model-dir``. Replies: ``--samples`` random token sequences
of lengths drawn like ShareGPT's two-turn replies (log-normal, median ``--median-len``, cut to
``--max-len``), the first 30% of each a prompt (loss mask 0), written twice: as kept replies
alone (``extract.py features=none``) and as a full offline store whose features the same
engine captured (timed: the capture and write half of an extraction, regeneration left out).

Training: the repository's ``conf/train.yaml`` composed with ``--experiment`` (default
``h200``: 16K-token batches padded to 128, TTT 3, bf16 autocast, 8 loader workers) and
``loop.max_steps=--steps``; each round trains offline, then online, from scratch on the same
ids (interleaved, so a drift of the machine hits both). Prints, per round: the trainer's
tokens/s (the run's own ``metrics.json``), the whole call's wall time, and for the online run
the idle fraction (time waiting on the capture queue) and the capture engine's tokens/s;
then the online/offline tokens/s ratio of every round after the first (the first compiles
and plans) with min-max, and the bytes a token each store holds on disk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.spec_decode_speed import _target, target_args  # noqa: E402  (the same random SmolLM2-shaped target)

TOP_K = 20
PROMPT_FRACTION = 0.3
TOKENIZER = ROOT / "data" / "models" / "SmolLM2-135M-Instruct.Q4_1-bfloat16"  # what extract.py builds on first use


def target_info(model, name: str = "bench"):
    """The ``TargetInfo`` of a transformers Llama ``model`` (content hash ``sha256:<name>``)."""
    from eagle3.target.layers import default_aux_layer_ids
    from eagle3.target.resolve import TargetInfo

    c = model.config
    heads = c.num_attention_heads
    return TargetInfo(
        name=name, source="benchmark", path=None, architecture="llama", num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size, vocab_size=c.vocab_size, aux_layer_ids=default_aux_layer_ids(c.num_hidden_layers),
        content_hash=f"sha256:{name}", quantization={"method": "none"}, dtype=str(model.dtype).split(".")[-1],
        rms_norm_eps=c.rms_norm_eps, rope_theta=getattr(c, "rope_theta", None) or 10000.0,
        max_position_embeddings=c.max_position_embeddings, num_attention_heads=heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        intermediate_size=c.intermediate_size)


def replies(n: int, vocab: int, median: int, max_len: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` random replies ``(ids [T] int32, loss_mask [T] uint8)``: log-normal lengths
    (median ``median``, sigma 0.7) in ``[32, max_len]``, the first 30% prompt."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=g) * 0.7 + torch.log(torch.tensor(float(median))))
    out = []
    for L in lengths.clamp(32, max_len).long().tolist():
        ids = torch.randint(3, vocab, (L,), generator=g, dtype=torch.int32)
        mask = torch.ones(L, dtype=torch.uint8)
        mask[: int(L * PROMPT_FRACTION)] = 0
        out.append((ids, mask))
    return out


def write_store(folder: Path, info, data, template: str, engine=None, batch: int = 64) -> dict:
    """Write ``data`` as a features folder (every 10th sample validation): the kept replies
    alone when ``engine`` is None, else with the features ``engine`` captures (``batch``
    sequences a call). Returns ``{"seconds", "tokens", "bytes"}`` (wall time, tokens, bytes on disk)."""
    from eagle3.features import FeatureWriter, Record

    meta = {"target": {"content_hash": info.content_hash, "hidden_size": info.hidden_size,
                       "vocab_size": info.vocab_size, "architecture": "llama", "quantization": info.quantization,
                       "name": info.name},
            "aux_layer_ids": list(info.aux_layer_ids), "chat_template_hash": template, "capture": {"top_k": TOP_K},
            "sample_layout": "target_ids"}
    if engine is None:
        meta["features"] = "none"
    plan = [(f"s{i}", "validation" if i % 10 == 9 else "train") for i in range(len(data))]
    t0 = time.perf_counter()
    w = FeatureWriter.open(folder, meta, plan, samples_per_shard=batch)
    for idx, chunk in w.pending():
        rows = [data[int(sid[1:])] for sid, _ in chunk]
        caps = engine.capture([ids.tolist() for ids, _ in rows], TOP_K) if engine is not None else [None] * len(rows)
        w.write_shard(idx, [Record(sid, split, ids, mask, cap)
                            for (sid, split), (ids, mask), cap in zip(chunk, rows, caps)])
    w.finalize()
    return {"seconds": time.perf_counter() - t0, "tokens": sum(len(ids) for ids, _ in data),
            "bytes": sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())}


def train_config(features_dir: Path, out: Path, mode: str, a):
    """``conf/train.yaml`` with ``experiment=<a.experiment>`` and the benchmark's settings, typed
    (``mode`` ``online_cache``: ``features=online`` with ``features.cache_gb=<a.cache_gb>``)."""
    from hydra import compose, initialize_config_dir

    from eagle3.cli import to_typed

    cache = [f"features.cache_gb={a.cache_gb}"] if mode == "online_cache" else []
    mode = "online" if mode == "online_cache" else mode
    over = [f"features_dir={features_dir}", f"output_dir={out}", f"features={mode}", f"device={a.device}", *cache,
            f"loop.max_steps={a.steps}", "loop.tracker=none", "loop.save_every=100000", "export.speculators=false",
            "loop.log_every=1000000", *a.override]
    if a.experiment:
        over.insert(0, f"experiment={a.experiment}")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return to_typed(compose(config_name="train", overrides=over))


def one_run(mode: str, store: Path, work: Path, tag: str, info, embed, engine, a) -> dict:
    """Train ``a.steps`` steps from scratch on ``store`` with ``features=<mode>``; the figures of it."""
    from eagle3.train.run import train_drafter

    cfg = train_config(store, work / tag, mode, a)
    if a.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    m = train_drafter(cfg, info, embed, engine=_Borrowed(engine) if mode != "offline" else None)
    wall = time.perf_counter() - t0
    rep = m.get("features") or {}
    return {"mode": mode, "tokens_per_s": m.get("tokens_per_s"), "wall_s": wall, "steps": m.get("step"),
            "idle_fraction": rep.get("idle_fraction"), "capture_tokens_per_s": rep.get("capture_tokens_per_s"),
            "trainer_tokens_per_s": rep.get("trainer_tokens_per_s")}


def breakdown(engine, store: Path, a, max_tokens: int = 16384, n: int = 30) -> dict:
    """Where an online micro-batch's time goes, with no trainer on the device: ``n`` micro-batches
    of at most ``max_tokens`` tokens (samples in a seeded random order, packed greedily: the
    shapes of training's plan, not its exact batches) timed as ``engine.capture`` alone, as
    :meth:`~eagle3.train.online.OnlineFeatures.features_of`, and with the TTT collation
    (``ttt_steps`` 3, pad 128) and host pinning the producer thread adds. Tokens/s of each."""
    from eagle3.features import FeatureDataset
    from eagle3.train.online import OnlineFeatures
    from eagle3.train.ttt import TTTCollator, target_to_draft_index

    ds = FeatureDataset(store, splits=("train",), features=False)
    items = [ds[i] for i in range(len(ds))]
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(0)).tolist()
    batches, cur, size = [], [], 0
    for i in order:
        L = len(items[i]["input_ids"])
        if cur and size + L > max_tokens:
            batches.append(cur)
            cur, size = [], 0
        cur, size = cur + [i], size + L
    batches = batches[:n]
    tokens = sum(len(items[i]["input_ids"]) for b in batches for i in b)
    V = engine.target.vocab_size
    collate = TTTCollator(target_to_draft_index(torch.zeros(min(32000, V), dtype=torch.int64), V), 3, max_tokens, 128)
    online = OnlineFeatures(engine, TOP_K, max_tokens)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    def timed(fn) -> float:
        fn(batches[0])  # warm-up
        sync()
        t0 = time.perf_counter()
        for b in batches:
            fn(b)
        sync()
        return tokens / (time.perf_counter() - t0)

    out = {"batches": len(batches), "tokens": tokens,
           "capture_tokens_per_s": timed(lambda b: engine.capture([items[i]["input_ids"].tolist() for i in b], TOP_K)),
           "features_of_tokens_per_s": timed(lambda b: online.features_of([items[i] for i in b])),
           "producer_tokens_per_s": timed(lambda b: {k: v.pin_memory() if a.device == "cuda" and
                                                     isinstance(v, torch.Tensor) else v
                                                     for k, v in collate(online.features_of([items[i] for i in b])).items()})}
    if a.profile:
        out["profile"] = profile_capture(engine, [[items[i]["input_ids"].tolist() for i in b] for b in batches[:5]],
                                         a.profile)
    print(f"breakdown, {len(batches)} micro-batches of <= {max_tokens} tokens, no trainer: capture "
          f"{out['capture_tokens_per_s']:,.0f} tok/s | features_of {out['features_of_tokens_per_s']:,.0f} | "
          f"+ collate and pin {out['producer_tokens_per_s']:,.0f}")
    return out


def profile_capture(engine, batches: list[list[list[int]]], path: str) -> dict:
    """``engine.capture`` of each of ``batches`` under ``torch.profiler``: prints the kernels
    that took most device time and the device-busy fraction (kernel time / wall time: well
    below 1 means the host, not the GPU, bounds the capture); the whole table goes to ``path``.
    Returns ``{"wall_s", "device_s", "busy"}`` (seconds, summed over the batches)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    engine.capture(batches[0], TOP_K)  # warm-up outside the trace
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for b in batches:
            engine.capture(b, TOP_K)
        sync()
        wall = time.perf_counter() - t0
    ka = prof.key_averages()
    dev = sum(e.self_device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    table = ka.table(sort_by="self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total",
                     row_limit=40)
    Path(path).write_text(table)
    print("\n".join(table.splitlines()[:28]))
    print(f"profile of {len(batches)} captures: wall {wall * 1e3:.1f} ms, kernels {dev * 1e3:.1f} ms, "
          f"device busy {dev / wall:.1%}")
    return {"wall_s": wall, "device_s": dev, "busy": dev / wall}


class _Borrowed:
    """The benchmark's engine lent to one run: the run closes its engine at the end, the
    benchmark keeps it for the next round (``close`` is a no-op, the rest is the engine's)."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def close(self):
        pass


def _fmt(x, spec=",.0f"):
    return "-" if x is None else format(x, spec)


def main(argv=None) -> dict:
    from eagle3.config import HFEngineConfig
    from eagle3.engines.hf.engine import HFEngine

    ap = target_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--median-len", type=int, default=700)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps of every run")
    ap.add_argument("--rounds", type=int, default=3, help="offline+online pairs; the first is a warm-up")
    ap.add_argument("--cache-gb", type=float, default=0.0,
                    help="> 0: a third run a round, online with features.cache_gb (later epochs read back)")
    ap.add_argument("--experiment", default="h200", help="conf/experiment/<name>.yaml ('' for none)")
    ap.add_argument("--max-tokens", type=int, default=None, help="loop.max_tokens_per_batch (default: the experiment's)")
    ap.add_argument("--capture-batch", type=int, default=None, help="engine.capture_batch_size of the hf engine")
    ap.add_argument("--eager-layers", action="store_true",
                    help="the capture engine with engine.compile_layers=false (default: true, what train.py "
                         "features=online picks on CUDA: inductor-compiled decoder layers)")
    ap.add_argument("--override", action="append", default=[], help="one more train.py override (repeatable)")
    ap.add_argument("--tokenizer", default=str(TOKENIZER),
                    help="a tokenizer folder (the engine reads its end-of-turn ids; default: the built embedded target)")
    ap.add_argument("--work", default=None, help="folder for the stores and runs (default: a temporary one)")
    ap.add_argument("--breakdown", action="store_true",
                    help="first time the producer's parts alone (capture, features_of, collate and pin)")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="with --breakdown: trace five captures with torch.profiler, print the top kernels, "
                         "write the table to FILE")
    ap.add_argument("--json", default=None, help="write the printed figures to this file")
    a = ap.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.max_tokens:
        a.override.append(f"loop.max_tokens_per_batch={a.max_tokens}")
    device = torch.device(a.device)
    model = _target(a, device, getattr(torch, a.dtype))
    info = target_info(model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(a.tokenizer)
    engine = HFEngine(model, tokenizer, info, HFEngineConfig(device=a.device, capture_batch_size=a.capture_batch,
                                                                compile_layers=not a.eager_layers), device)
    embed = model.get_input_embeddings().weight.detach().float().cpu()
    data = replies(a.samples, info.vocab_size, a.median_len, a.max_len)
    work = Path(a.work or tempfile.mkdtemp(prefix="online-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    from eagle3.target import chat_template_hash

    template = chat_template_hash(tokenizer)
    kept = write_store(work / "replies", info, data, template)
    stored = write_store(work / "offline", info, data, template, engine)
    tokens = stored["tokens"]
    print(f"{a.samples} replies, {tokens:,} tokens; target {info.num_layers} layers on {a.device}")
    print(f"offline store: {stored['bytes'] / tokens:,.1f} B/token on disk, captured and written at "
          f"{tokens / stored['seconds']:,.0f} tokens/s; kept replies alone: {kept['bytes'] / tokens:,.1f} B/token")
    split = breakdown(engine, work / "replies", a, a.max_tokens or 16384) if a.breakdown else None
    rounds = []
    modes = ("offline", "online", "online_cache") if a.cache_gb > 0 else ("offline", "online")
    for r in range(a.rounds):
        runs = {m: one_run(m, work / ("offline" if m == "offline" else "replies"), work, f"r{r}-{m}", info, embed,
                           engine, a) for m in modes}
        rounds.append(runs)
        parts = [f"{m} {_fmt(x['tokens_per_s'])} tok/s ({x['wall_s']:.1f} s"
                 + (")" if m == "offline" else f", idle {_fmt(x['idle_fraction'], '.1%')}, capture "
                    f"{_fmt(x['capture_tokens_per_s'])} tok/s)") for m, x in runs.items()]
        print(f"round {r}{' (warm-up)' if r == 0 else ''}: " + " | ".join(parts))
    ratios = {m: [p[m]["tokens_per_s"] / p["offline"]["tokens_per_s"] for p in rounds[1:]
                  if p[m]["tokens_per_s"] and p["offline"]["tokens_per_s"]] for m in modes[1:]}
    result = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "samples": a.samples,
              "tokens": tokens, "steps": a.steps, "experiment": a.experiment, "overrides": a.override,
              "offline_bytes_per_token": stored["bytes"] / tokens, "replies_bytes_per_token": kept["bytes"] / tokens,
              "offline_capture_tokens_per_s": tokens / stored["seconds"], "rounds": rounds, "ratios": ratios,
              "breakdown": split}
    for m, rs in ratios.items():
        if rs:
            print(f"{m}/offline trainer tokens/s: median {statistics.median(rs):.3f} "
                  f"(min {min(rs):.3f}, max {max(rs):.3f}) over {len(rs)} rounds")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
