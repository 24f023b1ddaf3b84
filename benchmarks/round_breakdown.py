"""What one speculative round is made of: each call of the static, CUDA-graph path timed alone.

    python benchmarks/round_breakdown.py --device cuda
    python benchmarks/round_breakdown.py --device cpu --layers 2 --iters 20   # CI size

Same target and drafter as ``benchmarks/spec_decode_speed.py`` (SmolLM2-135M shape, random
weights, 32,000-token draft vocabulary) after a 256-token prefill. Each call is run
``--iters`` times in a row, ``queued`` with one synchronisation at the end (the cost when
the host runs ahead of the GPU) and ``synced`` after every call (host + GPU latency, as in
a round, which reads its acceptance back once). Calls: the target's 1-token decode step,
its 4-token verify pass, the drafter's first step over 1 and over 4 verified positions, one
draft step, the greedy acceptance of a verify pass (its one read-back), and the host-to-
device copy of the accepted tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.spec_decode_speed import _aux_ids, _drafter, _target, target_args  # noqa: E402


def main(argv=None) -> dict:
    from eagle3.spec import DraftTree, SpecSettings, StaticEagle3Proposer, StaticTargetRunner, accept_greedy, synchronize

    ap = target_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--drafter-layers", type=int, default=1, help="the drafter's decoder layers (drafter.num_layers)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--cache-slots", type=int, default=None,
                    help="KV slots of the static caches (default prompt + 64; evaluation's are 2183)")
    ap.add_argument("--min-span", type=int, default=256,
                    help="smallest attention span (SlotCache.span_for); 0 = attend over all slots")
    ap.add_argument("--gqa-fold", action="store_true",
                    help="target and drafter attend with the query heads folded into the query axis (eagle3.gqa)")
    ap.add_argument("--compile-layers", action="store_true",
                    help="compile the target's and the drafter's decoder layers (engine.compile_layers=true)")
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if a.device == "auto" else a.device))
    target = _target(a, dev, getattr(torch, a.dtype))
    aux_ids = _aux_ids(target.config.num_hidden_layers)
    drafter = _drafter(target, a.draft_vocab, dev, getattr(torch, a.dtype), a.drafter_layers)
    if a.gqa_fold:
        from eagle3.gqa import use_gqa_sdpa
        from eagle3.gqa import fold_drafter_attention

        use_gqa_sdpa(target)
        fold_drafter_attention(drafter)
    if a.compile_layers:
        from eagle3.spec.compiled import compile_decoder_layers

        compile_decoder_layers(target)
        compile_decoder_layers(drafter)
    P, max_len = a.prompt_len, a.cache_slots or a.prompt_len + 64
    span = a.min_span or None
    runner = StaticTargetRunner(target, aux_ids, max_len=max_len, min_span=span)
    prop = StaticEagle3Proposer(drafter, aux_ids, max_len=max_len, min_span=span)
    s, _ = SpecSettings.make(3, 1, 4)
    ids = torch.randint(0, target.config.vocab_size, (1, P), device=dev)
    out: dict[str, dict] = {}
    with torch.inference_mode():
        cache = runner.new_cache()
        _, aux = runner.prefill(ids, cache)
        prop.begin(ids[0, 1:].contiguous(), aux[:-1], 0)  # the drafter reads positions 0..P-2
        tok = ids[0, -1:]
        four = ids[0, :4].contiguous()
        depth = torch.arange(4, device=dev)
        logits4, aux4 = runner.verify(four, depth, None, cache, P)
        tree = DraftTree(four, torch.arange(-1, 3, device=dev), depth)
        start = prop.committed

        def begin(m):
            def f():
                prop.committed = start  # read the same positions again: same slots, same work
                prop.begin(four[:m], aux4[:m], start)
            return f

        def step():
            prop._used = 0
            prop.step(four[:1], torch.zeros(1, dtype=torch.long, device=dev), start + 3)

        calls = {
            "target decode step (1 token)": lambda: runner.decode(tok, P, cache),
            "target verify pass (4 tokens)": lambda: runner.verify(four, depth, None, cache, P),
            "drafter first step, 1 position": begin(1),
            "drafter first step, 4 positions": begin(4),
            "drafter draft step": step,
            "greedy acceptance + read-back": lambda: accept_greedy(tree, logits4, s.num_steps),
            "accepted tokens to the device": lambda: torch.tensor([1, 2, 3, 4], device=dev),
        }
        for name, fn in calls.items():
            for _ in range(3):
                fn()  # captures graphs, warms up
            synchronize(dev)
            t = time.perf_counter()
            for _ in range(a.iters):
                fn()
            synchronize(dev)
            queued = (time.perf_counter() - t) / a.iters * 1e3
            t = time.perf_counter()
            for _ in range(a.iters):
                fn()
                synchronize(dev)
            synced = (time.perf_counter() - t) / a.iters * 1e3
            out[name] = {"queued_ms": queued, "synced_ms": synced}
    print(f"\n{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}, {a.dtype}, "
          f"{target.config.num_hidden_layers} layers, prompt {P}, draft vocab {drafter.arch.draft_vocab_size}, "
          f"drafter layers {drafter.arch.num_layers}, GQA folded {a.gqa_fold}, compiled layers {a.compile_layers}, "
          f"CUDA graphs {runner.cuda_graphs}, {a.iters} calls each, {max_len} cache slots, "
          f"attention over {runner.cache.span} of them")
    print(f"{'call':34s} {'queued ms':>10s} {'synced ms':>10s}")
    for name, r in out.items():
        print(f"{name:34s} {r['queued_ms']:10.3f} {r['synced_ms']:10.3f}")
    return out


if __name__ == "__main__":
    main()
