"""The GPTQ W4A16 build: quantisation with calibration data, the way released W4A16 checkpoints are made.

``quantization.algorithm=gptq`` replaces round-to-nearest (:func:`eagle3.target.quantize.quantize_w4a16_`)
with GPTQ (Frantar et al., 2022, arXiv 2210.17323): each Linear's int4 weights are
chosen column by column to minimise the layer's output error on calibration
activations, ``||X W^T - X Q^T||^2``, using the inverse Hessian ``(X^T X + damp I)^-1``.
The work is done by llmcompressor's ``GPTQModifier`` run through ``oneshot`` with its
sequential pipeline (one decoder layer at a time, each layer's inputs taken from the
already-quantised layers before it); the scheme is the same compressed-tensors W4A16
group scheme as the round-to-nearest build (:func:`w4a16_quantization_config`), so the
checkpoint is the same ``pack-quantized`` format that transformers, vLLM and Marlin load.

Calibration data: the first ``quantization.calibration_samples`` ShareGPT conversations
of the ``train`` split (the split extraction draws from, so evaluation prompts stay
unseen), rendered with the target's chat template, the original replies included,
each cut to ``quantization.calibration_max_tokens`` tokens.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from eagle3.errors import Eagle3Error

log = logging.getLogger(__name__)


def calibration_ids(tokenizer, num_samples: int, max_tokens: int, min_tokens: int = 64) -> list[list[int]]:
    """Token ids ``[num_samples][<= max_tokens]`` of ShareGPT ``train`` conversations for calibration.

    Conversations are taken in source order from the default ShareGPT data config (its
    seed and split fractions), rendered with :func:`eagle3.target.chat.render_conversation`
    (user turns and the dataset's own replies), cut to ``max_tokens``; conversations
    shorter than ``min_tokens`` are skipped.

    Raises:
        Eagle3Error: fewer than ``num_samples`` usable conversations.
    """
    from eagle3.config import DataConfig
    from eagle3.prompts.load import load_conversations
    from eagle3.target.chat import render_conversation

    rows: list[list[int]] = []
    for rec in load_conversations(DataConfig(name="sharegpt", source="sharegpt")):
        if rec["split"] != "train":
            continue
        ids, _ = render_conversation(tokenizer, rec["messages"])
        if len(ids) >= min_tokens:
            rows.append(ids[:max_tokens])
        if len(rows) == num_samples:
            return rows
    raise Eagle3Error(f"only {len(rows)} ShareGPT conversations are usable for GPTQ calibration; "
                      f"lower model.quantization.calibration_samples to {len(rows)} or fewer")


def gptq_quantize_(model: torch.nn.Module, q: dict, samples: list[list[int]], qconfig) -> None:
    """Quantise ``model`` in place with GPTQ (llmcompressor ``oneshot``, sequential pipeline).

    ``q`` is the quantization dict (``ignore``, ``dampening``); ``qconfig`` its
    compressed-tensors ``QuantizationConfig``
    (:func:`eagle3.target.quantize.w4a16_quantization_config`); ``samples`` the
    calibration token ids. Afterwards every
    targeted Linear carries ``weight_scale`` [out, in/group] (and ``weight_zero_point``)
    and a weight on that grid, ready for compressed-tensors' ``pack-quantized`` compressor.

    Raises:
        Eagle3Error: llmcompressor is not installed (with the install line).
    """
    try:
        import datasets
        from llmcompressor import oneshot
        from llmcompressor.modifiers.gptq import GPTQModifier
    except ImportError as e:
        raise Eagle3Error("model.quantization.algorithm=gptq needs llmcompressor: "
                          "pip install llmcompressor==0.14.0.1 (or use algorithm=rtn)") from e
    scheme = qconfig.config_groups["group_0"]
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=list(q["ignore"]),
                          dampening_frac=float(q["dampening"]))
    from loguru import logger as loguru_logger

    ds = datasets.Dataset.from_dict({"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]})
    max_len = max(len(s) for s in samples)
    log.info("GPTQ: %d calibration sequences, %d tokens, one decoder layer at a time (progress bars below)",
             len(samples), sum(map(len, samples)))
    t0 = time.monotonic()
    quiet = ("llmcompressor", "compressed_tensors")  # three INFO lines per Linear otherwise
    for name in quiet:
        loguru_logger.disable(name)
    try:
        oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=max_len,
                num_calibration_samples=len(samples), pipeline="sequential")
    finally:
        for name in quiet:
            loguru_logger.enable(name)
    log.info("GPTQ done in %.0f s", time.monotonic() - t0)


def build_gptq(dense_dir: Path, q: dict, dtype: torch.dtype, out: Path, qconfig) -> None:
    """Write ``out``: the GPTQ W4A16 ``pack-quantized`` build of the dense HF folder ``dense_dir``
    under the compressed-tensors ``qconfig`` (as :func:`gptq_quantize_`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dense_dir)
    samples = calibration_ids(tok, int(q["calibration_samples"]), int(q["calibration_max_tokens"]))
    # float32 calibration (bf16 matmuls are several times slower than float32 on CPUs
    # without native bf16), on the GPU when there is one; cast to the serving dtype
    # afterwards: the int4 values survive the cast (|q| <= 8, scale rounding < 2^-8).
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    if torch.cuda.is_available():
        model = model.to("cuda")
    torch.manual_seed(0)
    gptq_quantize_(model, q, samples, qconfig)
    model = model.to(device="cpu", dtype=dtype)
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)
