"""Inductor-compiled decoder layers: fused kernels inside this project's CUDA graphs.

A CUDA graph (:mod:`eagle3.runtime.graphs`) removes launch and Python cost but replays the
eager kernels one by one. A transformers Llama layer launches about 35 of them per
forward (RMSNorm alone is six: pow, mean, add, rsqrt, mul, cast; rotary, SiLU-and-multiply
and the residual adds the rest), each a few microseconds on a tensor of ``[B, n, 576]``.
On one H200 the batched decoder (:mod:`eagle3.engines.hf.batch_decode`) replaying those
kernels reached 0.56x transformers' compiled static-cache ``generate`` at batch 256
(``docs/performance.md``), which fuses them.

:func:`compile_decoder_layers` compiles each decoder layer (and the final norm) with
``torch.compile(dynamic=True)``, so that:

* one compilation serves every layer: the layers share one code object, their
  parameters are graph inputs (Dynamo's ``inline_inbuilt_nn_modules``, the default), and
  ``layer_idx``, an ``int`` attribute Dynamo would otherwise specialise per layer, is left
  unspecialised (``torch._dynamo.config.allow_unspec_int_on_nn_module``);
* one compilation serves every batch shape: sizes are symbolic, so a new prompt width
  or batch size is a guard check, not a compilation (what made transformers' static
  cache lose on real extraction: a compilation per prompt width). Dynamo still keeps
  separate graphs for a single new token and for several (it specialises sizes 0 and 1),
  so there are a handful of compilations per process in all;
* the KV-cache write stays eager: :meth:`eagle3.runtime.slots.SlotCache.update` and
  :meth:`eagle3.engines.hf.batch_decode.FlatSlotCache.update` are
  ``torch.compiler.disable``-d (two ``index_copy_`` kernels; the layer is compiled in
  two pieces around them), so the caches' Python lists and slot tensors are never traced.

Forward hooks (the aux hidden states of :mod:`eagle3.spec.target` and of capture) run
in ``nn.Module.__call__``, outside the compiled ``forward``, as before. The compiled
kernels are launched like any other inside :class:`eagle3.runtime.graphs.GraphedCall`'s
warm-up runs (which is when compilation happens) and recorded by its capture.

``attention_in_graph=False`` keeps the attention kernel itself out of the compiled code: the
model's attention implementation becomes :data:`SDPA_OUTSIDE_COMPILE`, transformers' own
``sdpa_attention_forward`` wrapped in ``torch.compiler.disable`` and registered with
transformers' ``AttentionInterface`` (and its mask with ``AttentionMaskInterface``), so each
layer compiles in two pieces around an eager SDPA call that reads the mask by broadcasting.
Measured on one H200 at batch 256 with attention compiled, inductor's lowering of the masked
SDPA spent 82-89% of the GPU time in a prologue that materialises the mask per layer and step,
whichever SDPA kernel followed (``docs/performance.md``); this is the variant that avoids it.
Any transformers model whose layers call ``ALL_ATTENTION_FUNCTIONS`` (Llama, DeepSeek-V3)
takes it; the drafter's attention (:class:`eagle3.model.drafter.DrafterAttention`) does not.
Timed by ``benchmarks/regenerate_speed.py --compile-layers`` (``graphs_compiled_sdpa_eager``).

On CPU this works too (inductor's C++ backend) but is not what the project runs there
(compilation costs more than a CPU run of the test sizes gains); ``engine.compile_layers``
applies it on CUDA only.
"""

from __future__ import annotations

import torch

from eagle3.devices import compile_in_place
from eagle3.gqa import GQA_SDPA, GQA_SDPA_OUTSIDE_COMPILE
from eagle3.errors import Eagle3Error
# the attention keys kept outside compiled code (module docstring), defined beside the masks that read them
from eagle3.runtime.mask import OUTSIDE_COMPILE, SDPA_OUTSIDE_COMPILE  # noqa: F401


def use_sdpa_outside_compile(model) -> None:
    """Switch a transformers model from ``sdpa`` to :data:`SDPA_OUTSIDE_COMPILE` (the same
    function and mask, never traced by Dynamo), or from the folded GQA attention
    (:data:`eagle3.gqa.GQA_SDPA`) to its compile-disabled twin; registers the
    key on first use. Idempotent.

    Raises:
        Eagle3Error: a model without ``set_attn_implementation`` (the drafter), or one whose
            attention implementation is neither ``sdpa`` nor the folded GQA attention.
    """
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl in OUTSIDE_COMPILE:
        return
    if impl == GQA_SDPA:  # the folded GQA attention (eagle3.gqa) has its own compile-disabled twin
        model.set_attn_implementation(GQA_SDPA_OUTSIDE_COMPILE)
        return
    if not hasattr(model, "set_attn_implementation") or impl != "sdpa":
        raise Eagle3Error(f"{type(model).__name__} (attention {impl!r}) cannot keep its attention outside the "
                          "compiled layers: that needs a transformers model with attn_implementation='sdpa'")
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if SDPA_OUTSIDE_COMPILE not in AttentionInterface._global_mapping:
        AttentionInterface.register(SDPA_OUTSIDE_COMPILE, torch.compiler.disable(sdpa_attention_forward))
        AttentionMaskInterface.register(SDPA_OUTSIDE_COMPILE, sdpa_mask)
    model.set_attn_implementation(SDPA_OUTSIDE_COMPILE)


def _owner(model) -> torch.nn.Module:
    """The module holding ``layers`` (and ``norm``): the drafter itself
    (:class:`eagle3.model.drafter.Eagle3Drafter`) or a transformers causal LM's decoder."""
    if isinstance(getattr(model, "layers", None), torch.nn.ModuleList):
        return model
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    if not isinstance(getattr(base, "layers", None), torch.nn.ModuleList):
        raise Eagle3Error(f"{type(model).__name__} has no decoder layers (model.model.layers or .layers) to compile; "
                          "set engine.compile_layers=false")
    return base


def wants_compile(setting, device_type: str, default: bool) -> bool:
    """``engine.compile_layers`` resolved: never off CUDA; ``None`` (auto) gives ``default``
    (the measured choice of the calling stage)."""
    if device_type != "cuda":
        return False
    return bool(default) if setting is None else bool(setting)


def decoder_layers(model) -> torch.nn.ModuleList:
    """The ``[L]`` decoder layers of a transformers causal LM (``model.model.layers``) or of the
    drafter (``drafter.layers``).

    Raises:
        Eagle3Error: the model has neither.
    """
    return _owner(model).layers


def compile_decoder_layers(model, attention_in_graph: bool = True) -> int:
    """Compile every decoder layer of ``model`` and its final norm in place (module docstring).

    Idempotent: a layer already compiled is left as it is.

    Args:
        model: a transformers causal LM (``model.model.layers``, ``model.model.norm``) or the
            EAGLE-3 drafter (``drafter.layers``, ``drafter.norm``; its lm_head and the d2t
            lookup stay eager).
        attention_in_graph: ``False`` keeps the SDPA call eager between two compiled pieces
            of each layer (:func:`use_sdpa_outside_compile`; transformers models only).

    Returns:
        how many modules were compiled now (``L + 1`` the first time, 0 after).

    Raises:
        Eagle3Error: as :func:`decoder_layers` and :func:`use_sdpa_outside_compile`; layers
            already compiled with the other ``attention_in_graph``.
    """
    owner = _owner(model)
    outside = getattr(getattr(model, "config", None), "_attn_implementation", None) in OUTSIDE_COMPILE
    if layers_compiled(model) and outside == attention_in_graph:
        raise Eagle3Error(f"the layers of this {type(model).__name__} are already compiled with the attention "
                          f"{'outside' if outside else 'inside'} the compiled code; compile a fresh copy to change it")
    if not attention_in_graph:
        use_sdpa_outside_compile(model)
    torch._dynamo.config.allow_unspec_int_on_nn_module = True  # layer_idx: one compilation for all layers
    modules = list(owner.layers) + ([owner.norm] if getattr(owner, "norm", None) is not None else [])
    return compile_in_place(modules)


def layers_compiled(model) -> bool:
    """Whether :func:`compile_decoder_layers` has been applied to ``model``."""
    try:
        return all(getattr(m, "_compiled_call_impl", None) is not None for m in decoder_layers(model))
    except Eagle3Error:
        return False
