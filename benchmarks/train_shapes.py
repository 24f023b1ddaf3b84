"""Training steps over the batch shapes a real run meets: what a new shape costs.

    python benchmarks/train_shapes.py --device cuda --steps 600 --pad-multiple 16,128
    python benchmarks/train_shapes.py --device cuda --steps 600 --sdpa both        # SDPA with and without its cuDNN backend
    python benchmarks/train_shapes.py --device cpu --steps 6 --max-tokens 1024   # CI size
    python benchmarks/train_shapes.py --project shapes.json --steps 8544          # a whole run, projected (no GPU)

Full-size runs start slowly: 480 steps in 100 s, then about 16 steps/s (docs/performance.md).
Length-bucketed batches (``eagle3.train.data.length_bucketed_batches``) give a new ``(B, T)``
shape in about a third of the first 500 steps, and each shape that attention meets for the first
time may cost its kernels a setup (cuDNN builds and caches an execution plan per shape). This
benchmark replays that: sample lengths drawn from a log-normal (``--length-mean``,
``--length-sigma``; the full-size extractions average about 500 tokens), the batches of
``--steps`` steps in the order training takes them, synthetic features of those lengths
(``--loss-fraction`` of each sample assistant tokens), and one optimizer step each on the
SmolLM2-sized drafter (``--model``), timed with a synchronisation per step. It prints, per
variant, the steps that met a new shape and their median time against the steps that repeated
one, and the time of the whole replay.

Each variant runs in its own process (``--variant``), so no kernel cache carries over.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.train_throughput import SHAPES  # noqa: E402
from eagle3.train.data import length_bucketed_batches  # noqa: E402
from eagle3.model.drafter import Eagle3Drafter  # noqa: E402
from eagle3.train.ttt import TTTCollator, batch_to, target_to_draft_index, ttt_forward  # noqa: E402


def batch_plan(args) -> tuple[list[int], list[list[int]]]:
    """Sample lengths and the first ``args.steps`` batches (sample indices), epochs concatenated."""
    g = torch.Generator().manual_seed(0)
    mu = math.log(args.length_mean) - args.length_sigma ** 2 / 2  # a log-normal of that mean
    lengths = (torch.randn(args.samples, generator=g) * args.length_sigma + mu).exp()
    lengths = lengths.clamp(16, args.max_length).long().tolist()
    batches: list[list[int]] = []
    epoch = 0
    while len(batches) < args.steps:
        batches += length_bucketed_batches(lengths, args.max_tokens, 0, epoch)
        epoch += 1
    return lengths, batches[: args.steps]


def run_variant(args) -> dict:
    arch = SHAPES[args.model]
    dev = torch.device(args.device)
    if dev.type == "cuda" and args.variant_sdpa == "no-cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(arch).to(dev)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=dev.type == "cuda")
    lengths, batches = batch_plan(args)
    g = torch.Generator().manual_seed(1)
    L = args.max_length
    pool = {  # one long synthetic sample, sliced to each length
        "input_ids": torch.randint(0, arch.draft_vocab_size, (L,), generator=g, dtype=torch.int32),
        "aux_hidden_states": torch.randn(L, 3, arch.target_hidden_size, generator=g).bfloat16(),
        "topk_ids": torch.randint(0, arch.draft_vocab_size, (L, 20), generator=g, dtype=torch.int32),
        "topk_logprobs": torch.log_softmax(torch.randn(L, 20, generator=g), -1),
    }
    d2t = torch.zeros(arch.draft_vocab_size, dtype=torch.int64)
    collate = TTTCollator(target_to_draft_index(d2t, arch.vocab_size), args.ttt_steps, args.max_length,
                          pad_multiple=args.variant_pad)
    amp = dev.type == "cuda"
    seen: set = set()
    new_ms, old_ms, shapes = [], [], []

    def sample(i: int) -> dict:
        n = lengths[i]
        mask = torch.zeros(n, dtype=torch.uint8)
        mask[int(n * (1 - args.loss_fraction)):] = 1
        return {"sample_id": str(i), "loss_mask": mask, **{k: v[:n] for k, v in pool.items()}}

    t_all = 0.0
    for idx in batches:
        batch = collate([sample(i) for i in idx])
        shape = (len(idx), batch["input_ids"].shape[1], batch["chain_rows"].shape[1])
        batch = batch_to(batch, dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            out = ttt_forward(drafter, batch, args.ttt_steps)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t) * 1e3
        t_all += ms / 1e3
        (old_ms if shape in seen else new_ms).append(ms)
        seen.add(shape)
        shapes.append(shape)
    return {
        "pad_multiple": args.variant_pad, "sdpa": args.variant_sdpa, "steps": len(batches),
        "distinct_shapes": len(seen), "new_shape_steps": len(new_ms),
        "new_shape_median_ms": statistics.median(new_ms) if new_ms else None,
        "repeat_median_ms": statistics.median(old_ms) if old_ms else None,
        "replay_s": t_all,
        "padded_tokens": sum(s[0] * s[1] for s in shapes),
        "real_tokens": sum(lengths[i] for b in batches for i in b),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
    }


def shape_sequence(args, pad: int) -> list[tuple[int, int, int]]:
    """The ``(B, T, T')`` batch shapes of the first ``args.steps`` steps, collated from tiny
    synthetic samples (the shapes depend on the lengths and loss masks alone)."""
    lengths, batches = batch_plan(args)
    L = args.max_length
    pool = {"input_ids": torch.zeros(L, dtype=torch.int32), "aux_hidden_states": torch.zeros(L, 3, 1).bfloat16(),
            "topk_ids": torch.zeros(L, 1, dtype=torch.int32), "topk_logprobs": torch.zeros(L, 1)}
    collate = TTTCollator(target_to_draft_index(torch.zeros(4, dtype=torch.int64), 8), args.ttt_steps, L,
                          pad_multiple=pad)
    out = []
    for idx in batches:
        samples = []
        for i in idx:
            n = lengths[i]
            mask = torch.zeros(n, dtype=torch.uint8)
            mask[int(n * (1 - args.loss_fraction)):] = 1
            samples.append({"sample_id": str(i), "loss_mask": mask, **{k: v[:n] for k, v in pool.items()}})
        b = collate(samples)
        out.append((len(idx), b["input_ids"].shape[1], b["chain_rows"].shape[1]))
    return out


def project(args) -> dict:
    """Project a whole run's attention cost per batch-shape policy from a GPU replay's JSON
    (``--project``): its ``default`` and ``no-cudnn`` rows of one pad multiple give the cost of a
    new shape's cuDNN plan (new-shape median minus repeated-shape median) and the two steady
    step times; the shapes of ``--steps`` steps are replayed here without a model. A projection
    from measured constants, not a measurement."""
    rows = json.load(open(args.project))
    pad = int(args.pad_multiple.split(",")[0])
    cud = next(r for r in rows if r["pad_multiple"] == pad and r["sdpa"] == "default")
    off = next(r for r in rows if r["pad_multiple"] == pad and r["sdpa"] == "no-cudnn")
    plan, fast, slow = (cud["new_shape_median_ms"] - cud["repeat_median_ms"]), cud["repeat_median_ms"], off["repeat_median_ms"]
    uses: dict = {}
    for sh in shape_sequence(args, pad):
        uses[sh] = uses.get(sh, 0) + 1
    k = math.ceil(plan / max(slow - fast, 1e-9))  # uses after which a cuDNN plan has paid for itself
    always = sum(plan + fast * n for n in uses.values()) / 1e3
    never = sum(slow * n for n in uses.values()) / 1e3
    after_k = sum(slow * min(n, k) + ((plan + fast * (n - k)) if n > k else 0.0) for n in uses.values()) / 1e3
    res = {"steps": args.steps, "pad_multiple": pad, "distinct_shapes": len(uses), "plan_ms": plan,
           "cudnn_step_ms": fast, "no_cudnn_step_ms": slow, "break_even_uses": k,
           "projected_s": {"cudnn always": always, "cudnn never": never, f"cudnn after {k} uses": after_k}}
    print(f"{args.steps} steps, pad {pad}: {len(uses)} distinct shapes; a cuDNN plan {plan:.0f} ms, steps "
          f"{fast:.1f} ms (cuDNN) / {slow:.1f} ms (without); break-even after {k} uses of a shape")
    for name, sec in res["projected_s"].items():
        print(f"  {name:22s} {sec:8.1f} s")
    return res


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--samples", type=int, default=17_000, help="training samples (the full-size runs: about 17 K)")
    p.add_argument("--length-mean", type=float, default=500.0)
    p.add_argument("--length-sigma", type=float, default=0.6)
    p.add_argument("--max-tokens", type=int, default=16384, help="loop.max_tokens_per_batch")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--loss-fraction", type=float, default=0.6)
    p.add_argument("--pad-multiple", default="16", help="comma-separated loop.pad_multiple values")
    p.add_argument("--sdpa", choices=["default", "no-cudnn", "both"], default="default",
                   help="no-cudnn: SDPA's cuDNN backend off (CUDA only)")
    p.add_argument("--json", default=None)
    p.add_argument("--project", default=None, metavar="JSON",
                   help="no training: project --steps steps' attention cost per cuDNN policy from a GPU run's --json")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # "<pad>:<sdpa>", run in a child process
    args = p.parse_args(argv)
    if args.project:
        return [project(args)]
    if args.variant:
        pad, sdpa = args.variant.split(":")
        args.variant_pad, args.variant_sdpa = int(pad), sdpa
        print(json.dumps(run_variant(args)))
        return []
    sdpas = ["default", "no-cudnn"] if args.sdpa == "both" else [args.sdpa]
    fmt = (lambda v: f"{v:.1f}" if v is not None else "-")
    results = []
    for pad in [int(x) for x in args.pad_multiple.split(",")]:
        for sdpa in sdpas:
            cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
                   "--variant", f"{pad}:{sdpa}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"variant pad {pad}, {sdpa} failed:\n{proc.stderr[-3000:]}")
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            if len(results) == 1:  # each row as its variant ends: a run stopped by a time limit keeps them
                print(f"\n{args.model} drafter, {args.steps} steps of <= {args.max_tokens} tokens, TTT {args.ttt_steps}, "
                      f"lengths log-normal mean {args.length_mean:g}, on {results[0]['device']}")
                print("| pad multiple | SDPA | distinct shapes | steps on a new shape | new-shape step ms (median) "
                      "| repeated-shape step ms (median) | replay s | padding |")
                print("|---|---|---:|---:|---:|---:|---:|---:|")
            r = results[-1]
            print(f"| {r['pad_multiple']} | {r['sdpa']} | {r['distinct_shapes']} | {r['new_shape_steps']} | "
                  f"{fmt(r['new_shape_median_ms'])} | {fmt(r['repeat_median_ms'])} | {r['replay_s']:.1f} | "
                  f"{100 * (r['padded_tokens'] / r['real_tokens'] - 1):.1f}% |", flush=True)
            if args.json:
                with open(args.json + ".tmp", "w") as f:
                    json.dump(results, f, indent=1)
                os.replace(args.json + ".tmp", args.json)
    return results


if __name__ == "__main__":
    main()
