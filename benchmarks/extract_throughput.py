"""Capture throughput of the hf engine against a bare forward pass of the same model and batch.

    python benchmarks/extract_throughput.py --model smollm2-135m-int4 --batch-size 8 --seq-len 512 --iters 5

The bare pass is ``model(input_ids).logits`` (what any forward costs); the capture pass is
``HFEngine.capture`` (aux hidden states through hooks, float32 top-k log-probs over the
full vocabulary, copies to CPU). Both run on the same random full-length sequences;
the ratio capture/bare tokens/s says what capturing costs. ``--device auto`` picks
cuda when available.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _model_cfg(name: str):
    from hydra import compose, initialize_config_dir

    from eagle3.cli import to_typed

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return to_typed(compose("extract", [f"model={name}", "engine=hf"])).model


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> dict:
    import eagle3  # noqa: F401
    from eagle3.config import HFEngineConfig
    from eagle3.engines.hf.engine import HFEngine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-int4", help="a conf/model name")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="override model.dtype (e.g. float32 on CPUs without bf16)")
    ap.add_argument("--cache-dir", default=str(ROOT / "data" / "models"))
    a = ap.parse_args(argv)

    model_cfg = _model_cfg(a.model)
    if a.dtype:
        model_cfg.dtype = a.dtype
    B, T = a.batch_size, a.seq_len
    eng_cfg = HFEngineConfig(device=a.device, capture_batch_size=B, max_batch_tokens=B * T)
    engine = HFEngine.from_config(model_cfg, eng_cfg, a.cache_dir)
    dev = engine.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, engine.target.vocab_size, (B, T), generator=g)
    seqs = ids.tolist()
    ids_dev = ids.to(dev)

    def bare():
        with torch.inference_mode():
            engine.model(input_ids=ids_dev, use_cache=False).logits

    def capture():
        engine.capture(seqs, a.top_k)

    out = {}
    for name, fn in (("bare_forward", bare), ("capture", capture)):
        fn()  # warm-up
        _sync(dev)
        t = time.perf_counter()
        for _ in range(a.iters):
            fn()
        _sync(dev)
        dt = (time.perf_counter() - t) / a.iters
        out[name] = B * T / dt
    out["ratio"] = out["capture"] / out["bare_forward"]
    print(
        f"{a.model} on {dev} ({engine.info()['dtype']}), batch {B} x {T} tokens, top-k {a.top_k}, {a.iters} iters\n"
        f"  bare forward : {out['bare_forward']:10.1f} tokens/s\n"
        f"  capture      : {out['capture']:10.1f} tokens/s\n"
        f"  ratio        : {out['ratio']:10.3f} (capture / bare)"
    )
    engine.close()
    return out


if __name__ == "__main__":
    main()
