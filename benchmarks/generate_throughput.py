"""Batched greedy generation throughput of the hf engine: its decode attention against plain sdpa.

    python benchmarks/generate_throughput.py --batch-size 64 --prompt-len 256 --new-tokens 128

Both passes run ``model.generate`` on the same left-padded random prompts (a quarter of
the rows padded to half length) for exactly ``--new-tokens`` tokens (EOS ignored), so
they do the same work; the first with the attention the engine uses for generation on
this device (on a CPU: eagle3's GQA decode attention), the second with transformers'
``sdpa``. Prints generated tokens/s of each and their ratio, and how many rows came
out identical (bf16 kernels round differently, so greedy rows may part after a
near-tie). ``--device auto`` picks cuda when available (where both are ``sdpa``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.extract_throughput import _model_cfg  # noqa: E402  (one way to compose a model config)


def main(argv=None) -> dict:
    import eagle3  # noqa: F401
    from transformers import GenerationConfig

    from eagle3.config import HFEngineConfig
    from eagle3.engines.hf.engine import HFEngine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-int4", help="a conf/model name")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="override model.dtype")
    ap.add_argument("--cache-dir", default=str(ROOT / "data" / "models"))
    a = ap.parse_args(argv)

    model_cfg = _model_cfg(a.model)
    if a.dtype:
        model_cfg.dtype = a.dtype
    engine = HFEngine.from_config(model_cfg, HFEngineConfig(device=a.device), a.cache_dir)
    B, T, N = a.batch_size, a.prompt_len, a.new_tokens
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, engine.target.vocab_size, (B, T), generator=g)
    mask = torch.ones_like(ids)
    mask[: B // 4, : T // 2] = 0  # left padding
    ids = ids.masked_fill(mask == 0, engine.pad_id)
    gen = GenerationConfig(max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=engine.pad_id)
    dev = engine.device

    def run():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        with torch.inference_mode():
            out = engine.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), generation_config=gen)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return out[:, T:].cpu(), B * N / (time.perf_counter() - t)

    with engine.generation_attention():
        got, fast = run()
    engine.model.set_attn_implementation("sdpa")
    want, plain = run()
    same = int((got == want).all(dim=1).sum())
    out = {"engine_attention": fast, "sdpa": plain, "ratio": fast / plain, "identical_rows": same}
    print(
        f"{a.model} on {dev} ({engine.info()['dtype']}), batch {B} x {T} prompt tokens, {N} new tokens\n"
        f"  {engine.generate_attn:<18}: {fast:10.1f} tokens/s\n"
        f"  {'sdpa':<18}: {plain:10.1f} tokens/s\n"
        f"  ratio             : {out['ratio']:10.2f} (engine / sdpa); identical rows {same} of {B}"
    )
    engine.close()
    return out


if __name__ == "__main__":
    main()
