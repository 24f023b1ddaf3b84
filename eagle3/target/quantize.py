"""The W4A16 build of a dense target folder, quantised the way Kimi-K2.5 INT4 is.

``quantization.method=w4a16`` with ``prequantized=false`` quantises the dense folder
once, with the compressed-tensors library, the way Kimi-K2.5 INT4 is quantised: int4
symmetric weights with one scale per group of ``group_size`` input channels
(``scale = max|w| / 7.5`` over the group, ``q = clamp(round(w / scale), -8, 7)``:
compressed-tensors' min/max rule), every ``nn.Linear`` except ``quantization.ignore``
(``lm_head``; embeddings are not Linear and stay dense), activations bf16 (W4A16). The
folder is written ``pack-quantized``; ``AutoModelForCausalLM.from_pretrained`` on it
decompresses the weights, so every hidden state the hf engine computes is the INT4
model's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3.errors import Eagle3Error


def w4a16_quantization_config(q: dict):
    """The compressed-tensors ``QuantizationConfig`` of the W4A16 scheme described by ``q``.

    One config group: targets ``Linear``, int weights of ``q['bits']`` bits, strategy
    ``group`` with ``q['group_size']``, symmetric per ``q['symmetric']``, no activation
    quantization; ``ignore`` from ``q['ignore']``; format ``q['format']``.
    """
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    weights = QuantizationArgs(
        num_bits=int(q["bits"]),
        type="int",
        symmetric=bool(q["symmetric"]),
        strategy="group",
        group_size=int(q["group_size"]),
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, format=q["format"])
    return QuantizationConfig(
        config_groups={"group_0": scheme},
        ignore=list(q["ignore"]),
        format=q["format"],
        quant_method="compressed-tensors",
    )


def quantize_w4a16_(model: torch.nn.Module, q: dict) -> int:
    """Quantise ``model`` in place (round to nearest, per group min/max, no calibration).

    Attaches compressed-tensors schemes and sets each quantised Linear's
    ``weight_scale`` [out, in/group_size] (and ``weight_zero_point``) so that the
    stored weight dequantises to ``scale * clamp(round(w / scale), qmin, qmax)``.
    Returns the number of quantised modules.
    """
    from compressed_tensors.quantization import QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    qcfg = w4a16_quantization_config(q)
    apply_quantization_config(model, qcfg, show_progress=False)
    n = 0
    for _, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        args = scheme.weights
        w = module.weight.data
        out_f, in_f = w.shape
        g = args.group_size
        if in_f % g:
            raise Eagle3Error(
                f"a Linear layer has {in_f} input channels, not a multiple of "
                f"quantization.group_size={g}; choose a group size that divides it"
            )
        wg = w.float().reshape(out_f, in_f // g, g)
        scale, zp = calculate_qparams(wg.amin(dim=-1), wg.amax(dim=-1), args)
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zp.to(module.weight_zero_point.dtype))
        # round to nearest in float32 (bf16 division would move ~1% of values across a .5 boundary)
        zp32 = getattr(module, "weight_zero_point", None)
        fq = fake_quantize(w.float(), module.weight_scale.float(), zp32, args)
        module.weight.data.copy_(fq.to(w.dtype))
        module.quantization_status = QuantizationStatus.FROZEN
        n += 1
    return n


def _build_w4a16(dense_dir: Path, q: dict, dtype: torch.dtype, out: Path) -> None:
    """Quantise the dense HF folder ``dense_dir`` (W4A16) and save it ``pack-quantized``."""
    from compressed_tensors.compressors import ModelCompressor
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=dtype)
    n = quantize_w4a16_(model, q)
    if n == 0:
        raise Eagle3Error("quantization matched no Linear layer; check quantization.ignore")
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=q["format"])
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    AutoTokenizer.from_pretrained(dense_dir).save_pretrained(out)
