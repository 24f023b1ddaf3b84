"""The cost of rotary embeddings in the capture engine's layers, alone: q/k projections plus
transformers' ``apply_rotary_pos_emb`` on SmolLM2-135M's shapes (576 wide, 9 query and 3 KV
heads of 64), eager, inductor-compiled with dynamic shapes (what ``engine.compile_layers``
does) and with static shapes, against the projections alone.

    python benchmarks/rope_speed.py            # CUDA

Prints the output strides (the rotated q is a ``[B, H, T, D]`` view of ``[B, T, H, D]``
memory, SDPA's input layout) and microseconds a call (mean of 50 after 5 warm-up calls).
"""

from __future__ import annotations

import time

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


def bench(fn, *args, n: int = 50) -> float:
    """Mean microseconds of ``fn(*args)`` over ``n`` calls (CUDA-synchronised)."""
    for _ in range(5):
        fn(*args)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    for B, T in ((8, 2048), (16, 1024)):
        x = torch.randn(B, T, 576, device=dev, dtype=torch.bfloat16)
        wq = torch.randn(576, 576, device=dev, dtype=torch.bfloat16)
        wk = torch.randn(192, 576, device=dev, dtype=torch.bfloat16)
        cos = torch.randn(B, T, 64, device=dev).bfloat16()
        sin = torch.randn(B, T, 64, device=dev).bfloat16()

        def rope(x):
            q = (x @ wq.T).view(B, T, -1, 64).transpose(1, 2)
            k = (x @ wk.T).view(B, T, -1, 64).transpose(1, 2)
            return apply_rotary_pos_emb(q, k, cos, sin)

        def proj(x):
            return x @ wq.T, x @ wk.T

        dyn, static = torch.compile(rope, dynamic=True), torch.compile(rope, dynamic=False)
        print(B, T, "out strides", dyn(x)[0].stride(), "eager", rope(x)[0].stride())
        print(f"B={B} T={T}: proj only {bench(proj, x):.0f} us | eager {bench(rope, x):.0f} us | compiled dynamic "
              f"{bench(dyn, x):.0f} us | compiled static {bench(static, x):.0f} us")


if __name__ == "__main__":
    main()
