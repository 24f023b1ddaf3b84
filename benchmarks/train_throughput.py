"""Training throughput of the EAGLE-3 drafter: tokens/s and model FLOPs utilisation.

Runs full training steps (TTT unroll over ``--ttt-steps`` steps, float32 KL loss,
backward, AdamW) on synthetic features for two drafters:

* ``smollm2``: the embedded target's drafter (hidden 576, 9 heads x 64, 3 KV heads,
  FFN 1536, target vocabulary 49152, draft vocabulary 32000);
* ``kimi``: a Kimi-K2.5-shaped drafter (hidden 7168, 64 heads x 128, 8 KV heads,
  FFN 18432, target vocabulary 163840, draft vocabulary 32000).

Model FLOPs per step (the useful work, counted analytically; backward = 2 x forward):
``fc`` once, the decoder layer (q/k/v from 2H, o, SwiGLU MLP) on every real token at
step 0 and on the chain rows (rows with loss at a later step) at steps >= 1, attention
over the causal prefix plus the step's own chain (``4 * heads * head_dim`` per
query-key pair), and ``lm_head`` + softmax on the rows that carry loss. MFU = model FLOPs / time / peak (``--peak-tflops``; H200 dense
bf16 ~989). The FLOPs torch actually executed (``torch.utils.flop_counter``; the
masked attention computes every step's full key range) are printed next to it.

    python benchmarks/train_throughput.py                 # both drafters, device auto
    python benchmarks/train_throughput.py --model smollm2 --device cpu --iters 2
    python benchmarks/train_throughput.py --model kimi --profile   # where a step's GPU time goes
    python benchmarks/train_throughput.py --model kimi --chain-chunks 0,256   # dense vs chunked TTT attention
    python benchmarks/train_throughput.py --model kimi --compile both --rounds 2   # loop.compile_drafter off/on
    python benchmarks/train_throughput.py --fused-loss both --rounds 2              # loop.fused_loss off/on
    python benchmarks/train_throughput.py --model kimi --attention both --rounds 2  # drafter.ttt_attention dense/flex (CUDA)

``--profile`` runs one more step under ``torch.profiler`` and prints the GPU kernel time
by kind (attention kernels, matrix multiplies, the rest) and the slowest kernels.

``--compile both`` times the eager drafter and the one with its norms and MLPs compiled
(:mod:`eagle3.train.fused`, ``loop.compile_drafter``) in turn, ``--rounds`` times each
(alternating, so a drift of the machine hits both), and prints the compiled/eager step-time
ratio of every round; compilation happens in the warm-up steps, outside the timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import eagle3.model.drafter as drafter_module  # noqa: E402
from eagle3.model.drafter import DrafterArch, Eagle3Drafter  # noqa: E402
from eagle3.train.fused import compile_drafter_elementwise  # noqa: E402
from eagle3.train.ttt import TTTCollator, batch_to, target_to_draft_index, ttt_forward  # noqa: E402

SHAPES = {
    "smollm2": DrafterArch(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                           intermediate_size=1536, num_layers=1, target_hidden_size=576, vocab_size=49152,
                           draft_vocab_size=32000, rms_norm_eps=1e-5, rope_theta=100000.0),
    "kimi": DrafterArch(hidden_size=7168, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                        intermediate_size=18432, num_layers=1, target_hidden_size=7168, vocab_size=163840,
                        draft_vocab_size=32000, rms_norm_eps=1e-6, rope_theta=50000.0),
}


def synthetic_batch(arch: DrafterArch, batch: int, seq_len: int, ttt_steps: int, loss_fraction: float,
                    top_k: int = 20, seed: int = 0) -> dict:
    """A collated TTT batch of ``batch`` samples of ``seq_len`` tokens whose last
    ``loss_fraction`` are assistant tokens; target top-k drawn inside the draft vocab."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for b in range(batch):
        T = seq_len
        ids = torch.randint(0, arch.draft_vocab_size, (T,), generator=g, dtype=torch.int32)
        mask = torch.zeros(T, dtype=torch.uint8)
        mask[int(T * (1 - loss_fraction)):] = 1
        samples.append({
            "sample_id": str(b), "input_ids": ids, "loss_mask": mask,
            "aux_hidden_states": torch.randn(T, 3, arch.target_hidden_size, generator=g).bfloat16(),
            "topk_ids": torch.randint(0, arch.draft_vocab_size, (T, top_k), generator=g, dtype=torch.int32),
            "topk_logprobs": torch.log_softmax(torch.randn(T, top_k, generator=g), -1),
        })
    d2t = torch.zeros(arch.draft_vocab_size, dtype=torch.int64)
    return TTTCollator(target_to_draft_index(d2t, arch.vocab_size), ttt_steps, seq_len, pad_multiple=16)(samples)


def model_flops(arch: DrafterArch, batch: dict, ttt_steps: int) -> float:
    """Useful forward+backward FLOPs of one training step on ``batch`` (see module doc)."""
    B, T = batch["input_ids"].shape
    H, Ht, nh, nkv, hd, inter = (arch.hidden_size, arch.target_hidden_size, arch.num_attention_heads,
                                 arch.num_key_value_heads, arch.head_dim, arch.intermediate_size)
    real = batch["lengths"].double()
    n0 = float(real.sum())  # step 0: every real token
    fwd = 2 * n0 * 3 * Ht * H  # fc
    per_row = 2 * (2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * inter)  # q/k/v, o, MLP
    later = batch["rows_full"][1:]
    chain = torch.unique(torch.cat(later)) % T if later and sum(x.numel() for x in later) else torch.zeros(0)
    for j in range(ttt_steps):
        if j == 0:  # every row, causal prefix pairs
            fwd += n0 * per_row + 4 * nh * hd * float((real * (real + 1) / 2).sum())
        else:  # chain rows only: prefix r+1 keys plus j chain keys each
            fwd += chain.numel() * per_row + 4 * nh * hd * float((chain + 1 + j).sum())
        rows = batch["rows"][j].numel()
        fwd += 2 * rows * H * arch.draft_vocab_size + 5 * rows * arch.draft_vocab_size  # lm_head + softmax/KL
    return 3.0 * fwd


KERNEL_KINDS = (("attention", ("fmha", "flash", "attention", "efficient")),
                ("matmul", ("gemm", "xmma", "nvjet", "cutlass", "matmul", "splitk")))


def kernel_kind(name: str) -> str:
    """``attention``, ``matmul`` or ``other`` for a CUDA kernel name (attention first: its
    kernels are also built from CUTLASS)."""
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def profile_step(step, sync, top: int = 12) -> dict:
    """GPU kernel time of one ``step()`` under ``torch.profiler``: ``{"total_ms", "by_kind":
    {kind: ms}, "top": [(name, ms, calls)]}``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    by_name: dict[str, list] = {}
    for e in prof.events():
        if str(e.device_type).endswith("CUDA"):  # a kernel (or memcpy/memset) on the GPU
            us = float(e.time_range.elapsed_us())
            acc = by_name.setdefault(e.name, [0.0, 0])
            acc[0] += us / 1e3
            acc[1] += 1
    by_kind: dict[str, float] = {}
    for name, (ms, _) in by_name.items():
        by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + ms
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"total_ms": sum(by_kind.values()), "by_kind": by_kind,
            "top": [(n[:110], round(ms, 3), c) for n, (ms, c) in ranked]}


def profile_ops(step, sync, path: str, title: str, rows: int = 45) -> None:
    """Append to ``path`` the operators of one ``step()`` that launched the most GPU time
    (``torch.profiler``, CPU and CUDA activities, grouped by input shapes, sorted by self device
    time): which ``aten`` call (copy, cat, mul, ...) at which shapes owns a kernel kind of
    :func:`profile_step`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        sync()
    table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_device_time_total", row_limit=rows,
                                                               max_name_column_width=48, max_shapes_column_width=90)
    with open(path, "a") as f:
        f.write(f"## {title}\n{table}\n")


def run(name: str, args) -> dict:
    arch = SHAPES[name]
    if args.draft_vocab:
        arch = DrafterArch(**{**arch.__dict__, "draft_vocab_size": args.draft_vocab})
    dev = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(arch).to(dev)
    compiled = bool(getattr(args, "compiled", False))
    fused = bool(getattr(args, "fused", False))
    attention = "flex" if getattr(args, "flex", False) else "dense"
    gqa = bool(getattr(args, "gqa_on", False))
    drafter_module.GQA_IN_KERNEL = gqa
    if compiled:
        compile_drafter_elementwise(drafter)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=dev.type == "cuda")
    seq = args.seq_len
    nb = max(1, args.tokens // seq)
    batch = synthetic_batch(arch, nb, seq, args.ttt_steps, args.loss_fraction)
    flops = model_flops(arch, batch, args.ttt_steps)
    batch = batch_to(batch, dev)
    amp = dev.type == "cuda" and not args.fp32

    chunk = getattr(args, "chain_chunk", 0) or None

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            out = ttt_forward(drafter, batch, args.ttt_steps, chain_chunk=chunk, fused_loss=fused, attention=attention)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        step()
    sync()
    dt = (time.perf_counter() - t0) / args.iters
    kernels = profile_step(step, sync) if args.profile and dev.type == "cuda" else None
    if getattr(args, "profile_ops", None):
        profile_ops(step, sync, args.profile_ops, f"{name} compiled={compiled} fused={fused} {attention} gqa={gqa}")
    executed = None
    if args.count_executed:
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as fc:
            step()
        executed = float(fc.get_total_flops())
    tokens = int(batch["num_tokens"])
    res = {
        "drafter": name,
        "chain_chunk": chunk,
        "compiled": compiled,
        "fused_loss": fused,
        "flex": attention == "flex",
        "gqa": gqa,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": "bf16 autocast" if amp else "fp32",
        "hidden": arch.hidden_size,
        "draft_vocab": arch.draft_vocab_size,
        "ttt_steps": args.ttt_steps,
        "tokens_per_step": tokens,
        "step_s": dt,
        "tokens_per_s": tokens / dt,
        "model_tflops_per_step": flops / 1e12,
        "achieved_tflops": flops / dt / 1e12,
        "mfu": flops / dt / (args.peak_tflops * 1e12),
        "executed_tflops_per_step": executed / 1e12 if executed else None,
        "trainable_params_m": sum(p.numel() for p in params) / 1e6,
        "peak_memory_gb": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
        "kernels": kernels,
    }
    del drafter, opt, batch
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["smollm2", "kimi", "all"], default="all")
    p.add_argument("--device", default="auto")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per training step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--loss-fraction", type=float, default=0.6, help="share of tokens that are assistant labels")
    p.add_argument("--draft-vocab", type=int, default=None)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="device peak (H200 dense bf16: ~989)")
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast on CUDA")
    p.add_argument("--count-executed", action="store_true", help="also count executed FLOPs (one extra step)")
    p.add_argument("--profile", action="store_true", help="GPU kernel time by kind (one extra step, CUDA only)")
    p.add_argument("--profile-ops", default=None, metavar="FILE",
                   help="append the operators (with input shapes) that own the most GPU time of one extra step")
    p.add_argument("--chain-chunks", default="0",
                   help="comma-separated drafter.ttt_chain_chunk values to time in turn (0 = the dense mask)")
    p.add_argument("--compile", choices=["off", "on", "both"], default="off",
                   help="the drafter's norms and MLPs compiled (loop.compile_drafter); both = each in turn")
    p.add_argument("--fused-loss", choices=["off", "on", "both"], default="off",
                   help="the top-k KL loss fused with lm_head (loop.fused_loss); both = each in turn")
    p.add_argument("--attention", choices=["dense", "flex", "both"], default="dense",
                   help="attention of TTT steps >= 1 (drafter.ttt_attention; flex needs CUDA); both = each in turn")
    p.add_argument("--gqa", choices=["off", "on", "both"], default="off",
                   help="grouped-query attention in the SDPA kernel instead of repeat_kv copies; both = each in turn")
    p.add_argument("--rounds", type=int, default=1, help="times each variant is timed, alternating")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    names = ["smollm2", "kimi"] if args.model == "all" else [args.model]
    flag = {"off": [False], "on": [True], "both": [False, True]}
    modes = [(c, f, x, g) for c in flag[args.compile] for f in flag[args.fused_loss]
             for x in {"dense": [False], "flex": [True], "both": [False, True]}[args.attention] for g in flag[args.gqa]]
    results = []
    for n in names:
        for c in [int(x) for x in str(args.chain_chunks).split(",") if x.strip()]:
            for _ in range(args.rounds):
                for compiled, fused, flex, gqa in modes:
                    if flex and c:
                        p.error("--attention flex does not take --chain-chunks other than 0")
                    args.chain_chunk, args.compiled, args.fused, args.flex, args.gqa_on = c, compiled, fused, flex, gqa
                    results.append(run(n, args))
    print(f"\n| drafter | device | dtype | tokens/step | step s | tokens/s | model TFLOP/step | TFLOP/s | MFU "
          f"(peak {args.peak_tflops:g}) | peak mem GB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        mem = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-"
        chunked = ((f", chunks of {r['chain_chunk']}" if r["chain_chunk"] else "") + (", compiled" if r["compiled"] else "")
                   + (", fused loss" if r["fused_loss"] else "") + (", flex attention" if r["flex"] else "")
                   + (", GQA in SDPA" if r["gqa"] else ""))
        print(f"| {r['drafter']} (H={r['hidden']}, Vd={r['draft_vocab']}, TTT {r['ttt_steps']}{chunked}) | {r['device']} | "
              f"{r['dtype']} | {r['tokens_per_step']} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | "
              f"{r['model_tflops_per_step']:.2f} | {r['achieved_tflops']:.1f} | {100 * r['mfu']:.1f}% | {mem} |")
        if r["executed_tflops_per_step"]:
            print(f"  executed FLOPs per step (flop counter): {r['executed_tflops_per_step']:.2f} TFLOP")
        if r["kernels"]:
            k = r["kernels"]
            kinds = ", ".join(f"{kind} {ms:.1f} ms ({100 * ms / k['total_ms']:.0f}%)" for kind, ms in
                              sorted(k["by_kind"].items(), key=lambda kv: -kv[1]))
            print(f"  GPU kernel time of one step: {k['total_ms']:.1f} ms: {kinds}")
            for n, ms, c in k["top"]:
                print(f"    {ms:9.2f} ms {c:5d} x  {n}")
    flags = (("compiled", "compiled / eager", args.compile), ("fused_loss", "fused loss / eager loss", args.fused_loss),
             ("flex", "flex attention / dense mask", args.attention), ("gqa", "GQA in SDPA / repeat_kv", args.gqa))
    for key, what, setting in flags:
        if setting != "both":
            continue
        others = [k for k, _, _ in flags if k != key]
        for i, a in enumerate(results):  # each variant against the one of the same round differing only in this flag
            b = next((r for r in results[i + 1 : i + len(modes)]
                      if r[key] and r["drafter"] == a["drafter"] and all(r[o] == a[o] for o in others)), None)
            if not a[key] and b is not None:
                mem = (f", peak memory {a['peak_memory_gb']:.1f} -> {b['peak_memory_gb']:.1f} GB"
                       if a["peak_memory_gb"] is not None else "")
                print(f"{a['drafter']}: {what} step time {b['step_s'] / a['step_s']:.3f} (MFU {100 * a['mfu']:.1f}% -> "
                      f"{100 * b['mfu']:.1f}%{mem})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
