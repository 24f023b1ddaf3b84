"""How many training batches per second the data path delivers, against the training step it feeds.

Training reads each micro-batch from the features shards (``FeatureDataset``, safetensors
memory-mapped), collates it (:class:`eagle3.train.ttt.TTTCollator`: padding, non-finite
check, loss rows and target distributions of every TTT step) in ``loop.num_workers``
DataLoader workers, and, on CUDA, pins it and copies it to the GPU in the main process.
When that path delivers fewer batches per second than the GPU trains, the GPU waits (a
one-layer drafter on one H200 trains 14-17 steps/s, docs/notebook/results.md). This benchmark
writes a features folder of synthetic samples in the real on-disk format and times:

* ``read``: ``ds[i]`` for every sample of a batch (one process);
* ``collate``: the collator on already-read samples (one process), and its parts;
* ``loader``: the whole DataLoader (read + collate in ``--workers`` processes, pinning and
  the host-to-device copy when ``--device cuda``), batches/s over ``--batches`` batches.

    python benchmarks/train_loader.py                               # CPU, 0 and 2 workers
    python benchmarks/train_loader.py --device cuda --workers 0,4,8  # on a GPU machine

The batches are those training makes (``length_bucketed_batches`` at ``--max-tokens``
padded tokens); sample lengths are drawn uniformly from ``--min-len .. --max-len``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from eagle3.features import Capture, FeatureDataset, FeatureWriter, Record  # noqa: E402
from eagle3.train.data import length_bucketed_batches, make_loader  # noqa: E402
from eagle3.train.ttt import TTTCollator, batch_to, target_to_draft_index  # noqa: E402


def write_features(out: Path, samples: int, hidden: int, top_k: int, vocab: int, min_len: int, max_len: int,
                   per_shard: int = 256, seed: int = 0) -> Path:
    """A finished features folder of ``samples`` synthetic training samples (lengths uniform
    in ``min_len..max_len``, the second half of each an assistant reply)."""
    g = torch.Generator().manual_seed(seed)
    meta = {"target": {"content_hash": "synthetic", "hidden_size": hidden, "vocab_size": vocab},
            "aux_layer_ids": [2, 15, 27], "capture": {"top_k": top_k}, "sample_layout": "target_ids"}
    ids = [(f"s{i}", "train") for i in range(samples)]
    w = FeatureWriter.open(out, meta, ids, samples_per_shard=per_shard)
    for idx, chunk in w.pending():
        recs = []
        for sid, split in chunk:
            T = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
            mask = torch.zeros(T, dtype=torch.uint8)
            mask[T // 2:] = 1
            lp = torch.log_softmax(torch.randn(T, top_k, generator=g), -1).sort(-1, descending=True).values
            cap = Capture(torch.randn(T, 3, hidden, generator=g).bfloat16(),
                          torch.randint(0, vocab, (T, top_k), generator=g, dtype=torch.int32), lp)
            recs.append(Record(sid, split, torch.randint(0, vocab, (T,), generator=g, dtype=torch.int32), mask, cap))
        w.write_shard(idx, recs)
    w.finalize({})
    return out


def _rate(fn, n: int) -> float:
    """Calls of ``fn`` per second over ``n`` calls (after one warm-up call)."""
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return n / (time.perf_counter() - t)


def time_loader(ds, batches, collator, workers: int, device: torch.device, pin: bool) -> float:
    """Batches per second of the whole DataLoader (read, collate, pin, copy) over ``batches``."""
    loader = make_loader(ds, batches, collator, workers, pin)
    it = iter(loader)
    batch_to(next(it), device)  # workers started, first batch out
    t = time.perf_counter()
    n = 0
    for b in it:
        batch_to(b, device)
        n += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return n / (time.perf_counter() - t)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=576, help="target hidden size (aux states are 3 x this wide)")
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16384, help="padded tokens per micro-batch (experiment=h200)")
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--workers", default="0,2", help="comma-separated DataLoader worker counts")
    ap.add_argument("--batches", type=int, default=24, help="batches timed per measurement")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", default=None, help="features folder to write (default: a temporary one)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    try:
        workers = [int(x) for x in a.workers.split(",")]
    except ValueError:
        ap.error(f"--workers {a.workers!r}: give comma-separated worker counts, e.g. 0,2")
    for name in ("samples", "batches", "hidden", "top_k", "vocab", "draft_vocab", "min_len", "max_tokens", "ttt_steps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.max_len < a.min_len or a.draft_vocab > a.vocab or min(workers) < 0:
        ap.error("need --min-len <= --max-len, --draft-vocab <= --vocab and worker counts >= 0")
    device = torch.device(a.device)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(a.dir or tmp) / "features"
        t0 = time.perf_counter()
        if not (folder / "manifest.json").exists():
            write_features(folder, a.samples, a.hidden, a.top_k, a.vocab, a.min_len, a.max_len)
        written = time.perf_counter() - t0
        ds = FeatureDataset([folder])
        d2t = torch.zeros(a.draft_vocab, dtype=torch.int64)  # draft id i is target id i
        collator = TTTCollator(target_to_draft_index(d2t, a.vocab), a.ttt_steps, a.max_tokens, pad_multiple=16)
        batches = length_bucketed_batches(ds.lengths, a.max_tokens, seed=0, epoch=0)
        sizes = [sum(min(ds.lengths[i], a.max_tokens) for i in b) for b in batches]
        timed = (batches * (1 + a.batches // max(1, len(batches))))[: a.batches]

        k = iter(range(10**9))
        read_rate = _rate(lambda: [ds[i] for i in timed[next(k) % len(timed)]], len(timed))
        read = [[ds[i] for i in b] for b in timed[:8]]
        k = iter(range(10**9))
        collate_rate = _rate(lambda: collator(read[next(k) % len(read)]), 2 * len(read))
        finite_rate = _rate(lambda: [collator.is_finite(s) for s in read[0]], 8)
        out = {"samples": len(ds), "batches_per_epoch": len(batches), "tokens_per_batch": statistics.mean(sizes),
               "write_s": written, "read_batches_per_s": read_rate, "collate_batches_per_s": collate_rate,
               "finite_check_batches_per_s": finite_rate, "loader": {}}
        for w in workers:
            out["loader"][w] = time_loader(ds, timed, collator, w, device, pin=device.type == "cuda")

    print(f"{out['samples']} samples ({a.min_len}-{a.max_len} tokens, aux 3 x {a.hidden} bf16, top-{a.top_k}), "
          f"{out['batches_per_epoch']} batches of up to {a.max_tokens} padded tokens "
          f"(mean {out['tokens_per_batch']:.0f} tokens), device {device}, {os.cpu_count()} CPUs")
    print(f"  read (one process)    : {read_rate:8.2f} batches/s")
    print(f"  collate (one process) : {collate_rate:8.2f} batches/s  (of which the non-finite check alone "
          f"{finite_rate:.2f} batches/s)")
    for w, r in out["loader"].items():
        print(f"  DataLoader, {w} workers : {r:8.2f} batches/s ({r * out['tokens_per_batch']:,.0f} tokens/s)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
