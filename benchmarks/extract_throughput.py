"""Capture throughput of the hf engine against a bare forward pass of the same model and batch.

    python benchmarks/extract_throughput.py --model smollm2-135m-int4 --batch-size 8 --seq-len 512 --iters 5

The bare pass is ``model(input_ids).logits`` (what any forward costs); the capture pass is
``HFEngine.capture`` (aux hidden states through hooks, float32 top-k log-probs over the
full vocabulary, copies to CPU), timed twice: as it runs (two-stage ranking, fused
log-normaliser, copies overlapped with the next batch; :mod:`eagle3.engines.hf.capture`) and
on the float32 reference path (``capture_fast = False``). All three run on the same random
full-length sequences, interleaved iteration by iteration (the order rotating); the ratio
capture/bare tokens/s says what capturing costs, with its spread over iterations. ``--device auto`` picks
cuda when available. ``--random-shape`` uses a random-weight Llama of SmolLM2-135M's shape
instead of a built target (speed does not depend on the weights; no chat template). The
last line times the ranking and log-probs alone on one ``[chunk, V]`` chunk of logits, both
paths (a capture batch of ``N`` tokens runs ``N / chunk`` of them).
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


def _random_engine(eng_cfg, dtype: str):
    """An HFEngine on a random-weight Llama of SmolLM2-135M's shape (aux ids 2, 15, 27)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.spec_decode_speed import SMOLLM2_135M
    from eagle3.devices import resolve_device
    from eagle3.engines.hf.engine import HFEngine
    from eagle3.target import TargetInfo

    class NoTemplate:  # the engine reads EOS, pad and (here absent) the end-of-turn marker
        eos_token_id, pad_token_id = 0, 0

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            return ""

    device = resolve_device(eng_cfg.device)
    torch.manual_seed(0)
    cfg = LlamaConfig(**SMOLLM2_135M)
    cfg._attn_implementation = eng_cfg.attn_implementation
    model = LlamaForCausalLM(cfg).to(device=device, dtype=getattr(torch, dtype)).eval()
    info = TargetInfo(name="random-smollm2-135m", source="random", path=None, architecture="LlamaForCausalLM",
                      num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                      aux_layer_ids=[2, 15, 27], content_hash="random", quantization={}, dtype=dtype)
    return HFEngine(model, NoTemplate(), info, eng_cfg, device)


def _topk_step(engine, k: int, iters: int) -> dict:
    """Ranking and log-probs alone on one chunk of model-dtype logits (ms per chunk), both paths.

    ``reference``: float32 copy, :func:`rank_top_k` over the whole row, ``log_softmax``;
    ``fast``: :func:`rank_top_k_blocks` on the logits as computed plus the fused log-normaliser.
    """
    from eagle3.engines.hf.capture import LOGITS_CHUNK_BYTES, block_max_and_logsumexp, rank_top_k_blocks
    from eagle3.features.format import rank_top_k

    V = engine.target.vocab_size
    dtype = next(engine.model.parameters()).dtype
    n = max(1, LOGITS_CHUNK_BYTES // (torch.finfo(dtype).bits // 8 * V))
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(n, V, generator=g) * 3).to(dtype).to(engine.device)

    def reference():
        x = logits.float()
        ids, _ = rank_top_k(x, k)
        return torch.log_softmax(x, dim=-1).gather(-1, ids)

    def fast():
        bmax, lse = block_max_and_logsumexp(logits)
        ids, v = rank_top_k_blocks(logits, k, block_max=bmax)
        return v.float() - lse.unsqueeze(-1)

    out = {"topk_rows": n}
    for name, fn in (("reference", reference), ("fast", fast)):
        fn()
        _sync(engine.device)
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(engine.device)
        out[f"topk_logprobs_ms_{name}"] = (time.perf_counter() - t) / iters * 1e3
    return out


def main(argv=None) -> dict:
    import eagle3  # noqa: F401
    from eagle3.config import HFEngineConfig
    from eagle3.engines.hf.engine import HFEngine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-int4", help="a conf/model name")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--batches", type=int, default=1,
                    help="capture batches per call (a shard is several; the copies of one overlap the next's "
                         "forward); the bare side runs as many forwards")
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="override model.dtype (e.g. float32 on CPUs without bf16)")
    ap.add_argument("--cache-dir", default=str(ROOT / "data" / "models"))
    ap.add_argument("--profile", action="store_true", help="one more capture call under torch.profiler: top ops")
    ap.add_argument("--random-shape", action="store_true", help="random SmolLM2-135M-shaped target")
    a = ap.parse_args(argv)

    B, T, NB = a.batch_size, a.seq_len, a.batches
    eng_cfg = HFEngineConfig(device=a.device, capture_batch_size=B, max_batch_tokens=B * T)
    if a.random_shape:
        engine = _random_engine(eng_cfg, a.dtype or "bfloat16")
        a.model = "random SmolLM2-135M shape"
    else:
        model_cfg = _model_cfg(a.model)
        if a.dtype:
            model_cfg.dtype = a.dtype
        engine = HFEngine.from_config(model_cfg, eng_cfg, a.cache_dir)
    dev = engine.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, engine.target.vocab_size, (NB * B, T), generator=g)
    seqs = ids.tolist()
    ids_dev = ids.to(dev)

    def bare():
        with torch.inference_mode():
            for b in range(NB):
                engine.model(input_ids=ids_dev[b * B : (b + 1) * B], use_cache=False).logits

    def capture():
        engine.capture_fast = True
        engine.capture(seqs, a.top_k)

    def capture_reference():
        engine.capture_fast = False
        engine.capture(seqs, a.top_k)

    def timed(fn) -> float:
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        return time.perf_counter() - t

    methods = [("bare_forward", bare), ("capture", capture), ("capture_reference", capture_reference)]
    for _, fn in methods:  # warm-up (the fused log-normaliser compiles here)
        fn()
    secs: dict[str, list[float]] = {name: [] for name, _ in methods}
    ratios: dict[str, list[float]] = {"capture": [], "capture_reference": []}
    for i in range(a.iters):  # interleaved, the order rotating, so a change of load hits every side
        for name, fn in methods[i % 3:] + methods[: i % 3]:
            secs[name].append(timed(fn))
        for name in ratios:
            ratios[name].append(secs["bare_forward"][-1] / secs[name][-1])
    out = {name: NB * B * T * len(v) / sum(v) for name, v in secs.items()}
    for name in ratios:
        out[f"ratio_{name}"] = out[name] / out["bare_forward"]
        out[f"ratio_{name}_min"], out[f"ratio_{name}_max"] = min(ratios[name]), max(ratios[name])
    out.update(_topk_step(engine, a.top_k, a.iters))
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            capture()
            _sync(dev)
        key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
    print(
        f"{a.model} on {dev} ({engine.info()['dtype']}), {NB} batch(es) of {B} x {T} tokens, top-k {a.top_k}, "
        f"{a.iters} iters\n"
        f"  bare forward      : {out['bare_forward']:10.1f} tokens/s\n"
        f"  capture           : {out['capture']:10.1f} tokens/s, {out['ratio_capture']:.3f} of bare "
        f"(per iteration {out['ratio_capture_min']:.3f}-{out['ratio_capture_max']:.3f})\n"
        f"  capture, reference: {out['capture_reference']:10.1f} tokens/s, {out['ratio_capture_reference']:.3f} of bare "
        f"(per iteration {out['ratio_capture_reference_min']:.3f}-{out['ratio_capture_reference_max']:.3f})\n"
        f"  ranking + log-probs of one chunk of {out['topk_rows']} rows x V: "
        f"{out['topk_logprobs_ms_fast']:.2f} ms (reference {out['topk_logprobs_ms_reference']:.2f} ms)"
    )
    engine.close()
    return out


if __name__ == "__main__":
    main()
