"""Inductor-fused elementwise work of the drafter for training (``loop.compile_drafter``).

A training step of the Kimi-K2.5-shaped drafter spends 29% of its GPU kernel time outside
the matrix multiplies and the attention, in many small memory-bound kernels: RMSNorm alone
is six kernels forward (pow, mean, add, rsqrt, mul, cast) and more backward, SwiGLU's SiLU and
product two more, plus casts (``docs/performance.md``, "Training: where a step's time goes").
:func:`compile_drafter_elementwise` compiles, in place, the modules made of that work: each
drafter layer's RMSNorms (``input_layernorm``, ``hidden_norm``, ``post_attention_layernorm``),
its MLP (the two projections stay cuBLAS calls; SiLU-and-multiply fuses around them) and the
final ``norm``, each with ``nn.Module.compile(dynamic=True)``:

* the parameters keep their names (``Module.compile`` wraps the call, not the module), so
  checkpoints, exports and resumes are those of the eager drafter;
* sizes are symbolic, so the length-bucketed batches (a new padded length every few steps)
  reuse one compilation instead of compiling per shape;
* the attention (its KV cache, the TTT masks, :class:`eagle3.train.ttt_attention.ChainMask`),
  ``fc``, ``lm_head`` and the loss stay eager: they are cuBLAS/cuDNN calls already, or Python
  structures Dynamo would break on.

Backward runs through AOTAutograd, so the backward kernels of these modules are fused too.
Off by default until timed on a GPU (``benchmarks/train_throughput.py --compile``); CPU runs
it too (inductor's C++ backend), for the tests.
"""

from __future__ import annotations

import torch

from eagle3.devices import compile_in_place

#: submodule names compiled in each drafter layer (those that exist)
LAYER_PARTS = ("input_layernorm", "hidden_norm", "post_attention_layernorm", "mlp")


def compile_drafter_elementwise(drafter: torch.nn.Module) -> int:
    """Compile the drafter's norms and MLPs in place (module docstring). Idempotent.

    Args:
        drafter: an :class:`eagle3.model.drafter.Eagle3Drafter` (``layers``, ``norm``).

    Returns:
        how many modules were compiled by this call (0 when already done).
    """
    modules = [getattr(layer, name) for layer in drafter.layers for name in LAYER_PARTS if hasattr(layer, name)]
    modules.append(drafter.norm)
    return compile_in_place(modules)
