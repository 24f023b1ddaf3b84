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

``quantization.method=w4a16-dequant`` is the other direction, the way a "BF16" release
of a natively INT4 model (Kimi-K2.5) is made: the W4A16 checkpoint (the build above, or
the source itself with ``prequantized=true``) with every packed Linear dequantised to a
dense weight ``scale * q`` (:func:`dequantize_packed`), saved as a plain safetensors folder
without ``quantization_config``. Its weights are exactly the ones the hf engine computes
with on the W4A16 folder; servers that cannot load W4A16 (SGLang on CPU) or that would
run their INT4 kernels on it (vLLM) serve it as an ordinary bf16 model.
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
    """Quantise the dense HF folder ``dense_dir`` (W4A16) and save it ``pack-quantized``.

    ``q['algorithm']``: ``rtn`` here (:func:`quantize_w4a16_`), ``gptq`` in
    :func:`eagle3.target.gptq.build_gptq`.
    """
    from compressed_tensors.compressors import ModelCompressor
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if q.get("algorithm", "rtn") == "gptq":
        from eagle3.target.gptq import build_gptq

        return build_gptq(dense_dir, q, dtype, out, w4a16_quantization_config(q))
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=dtype)
    n = quantize_w4a16_(model, q)
    if n == 0:
        raise Eagle3Error("quantization matched no Linear layer; check quantization.ignore")
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=q["format"])
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    AutoTokenizer.from_pretrained(dense_dir).save_pretrained(out)


# ------------------------------------------------------- the dequantised (dense) build
def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Signed integers ``[rows, cols]`` int8 from compressed-tensors ``weight_packed`` ``[rows, words]`` int32.

    The ``pack-quantized`` layout (compressed-tensors ``pack_to_int32``, ``packed_dim=1``):
    each value is stored as ``q + 2**(bits-1)`` (unsigned) and element ``i`` of a row
    occupies bits ``[i*bits, (i+1)*bits)`` of the row's words, least significant first,
    so for int4 word ``j`` holds elements ``8j .. 8j+7``, element ``8j+k`` at bits
    ``4k .. 4k+3``. Only ``bits`` that divide 32 (1, 2, 4, 8) are supported.

    Raises:
        Eagle3Error: ``bits`` does not divide 32, or the words hold fewer than ``cols`` values.
    """
    if bits not in (1, 2, 4, 8):
        raise Eagle3Error(f"quantization.bits={bits} cannot be unpacked here; use a W4A16 (bits=4) checkpoint")
    per_word = 32 // bits
    rows, words = packed.shape
    if words * per_word < cols:
        raise Eagle3Error(f"a packed weight holds {words * per_word} values per row, fewer than its {cols} columns")
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    u = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, words, per_word]
    return (u.reshape(rows, words * per_word)[:, :cols] - (1 << (bits - 1))).to(torch.int8)


def dequantize_packed(packed, scale, shape, bits: int, zero_point=None, dtype=torch.bfloat16) -> torch.Tensor:
    """The dense weight ``[out, in]`` in ``dtype`` of one pack-quantized Linear.

    ``w[o, i] = scale[o, i // g] * (q[o, i] - zero_point[o, i // g])`` with
    ``g = in / scale.shape[1]`` (group quantization; ``zero_point`` None or zeros when
    symmetric), computed in float32 (exact: a bf16 scale times a 4-bit integer) and
    rounded once to ``dtype``, which is what compressed-tensors' decompression on load
    (``AutoModelForCausalLM.from_pretrained`` of the W4A16 folder) produces in ``dtype``.
    """
    out_f, in_f = int(shape[0]), int(shape[1])
    q = unpack_int32(packed, bits, in_f).to(torch.float32)
    g = in_f // scale.shape[1]
    s = scale.to(torch.float32).repeat_interleave(g, dim=1)
    if zero_point is not None:
        q = q - zero_point.to(torch.float32).reshape(out_f, -1).repeat_interleave(g, dim=1)
    return (q * s).to(dtype)


def _packed_bits(config: dict) -> int:
    qc = config.get("quantization_config") or config.get("compression_config") or {}
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "pack-quantized":
        raise Eagle3Error("the folder to dequantise is not a compressed-tensors pack-quantized checkpoint; "
                          "point model.source at a W4A16 folder or set quantization.prequantized=false")
    bits = {g["weights"]["num_bits"] for g in qc["config_groups"].values() if g.get("weights")}
    if len(bits) != 1:
        raise Eagle3Error(f"the checkpoint mixes weight widths {sorted(bits)}; only one width can be dequantised")
    return int(bits.pop())


def dequantize_state(tensors: dict, bits: int, dtype: torch.dtype) -> tuple[dict, int]:
    """A pack-quantized state dict -> ``(dense state dict, number of Linear weights dequantised)``.

    Each ``<m>.weight_packed`` / ``weight_scale`` / ``weight_shape`` (/ ``weight_zero_point``)
    becomes ``<m>.weight`` (:func:`dequantize_packed`); other floating tensors are cast to
    ``dtype``, integer ones kept.
    """
    out, n = {}, 0
    for key, t in tensors.items():
        if key.endswith(".weight_packed"):
            m = key[: -len(".weight_packed")]
            out[m + ".weight"] = dequantize_packed(t, tensors[m + ".weight_scale"], tensors[m + ".weight_shape"].tolist(),
                                                   bits, tensors.get(m + ".weight_zero_point"), dtype)
            n += 1
        elif not key.endswith((".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_g_idx")):
            out[key] = t.to(dtype) if t.is_floating_point() else t
    return out, n


def _build_dequant(packed_dir: Path, dtype: torch.dtype, out: Path) -> None:
    """Write ``out``: the W4A16 folder ``packed_dir`` with every Linear dequantised to dense ``dtype``.

    Plain safetensors (one output file per input file, same names, the index rewritten),
    ``config.json`` without ``quantization_config``, every other file (tokenizer,
    chat template, generation config) copied.
    """
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    config = json.loads((packed_dir / "config.json").read_text())
    bits = _packed_bits(config)
    total, weight_map = 0, {}
    for f in sorted(packed_dir.glob("*.safetensors")):
        dense, n = dequantize_state(load_file(str(f)), bits, dtype)
        total += n
        weight_map.update({k: f.name for k in dense})
        save_file(dense, str(out / f.name), metadata={"format": "pt"})
        (out / f.name).chmod(0o644)
    if total == 0:
        raise Eagle3Error(f"{packed_dir} has no weight_packed tensors; it is not a W4A16 checkpoint")
    for key in ("quantization_config", "compression_config"):
        config.pop(key, None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for p in packed_dir.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in ("config.json",):
            if p.name.endswith(".safetensors.index.json"):
                index = json.loads(p.read_text())
                index["weight_map"] = weight_map
                (out / p.name).write_text(json.dumps(index, indent=2) + "\n")
            else:
                shutil.copy2(p, out / p.name)
