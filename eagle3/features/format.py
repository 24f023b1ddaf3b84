"""The features format: what one captured sample holds, how shards and manifests are named, sizes.

A features folder holds ``manifest.json`` and ``shard-NNNNN.safetensors`` files
(:mod:`eagle3.features.writer` writes them, :mod:`eagle3.features.reader` reads them).

Record (one sample; see docs/design.md):

============================  ===========  ==========================================
key                           shape        dtype
============================  ===========  ==========================================
``input_ids``                 ``[T]``      int32
``loss_mask``                 ``[T]``      uint8, 1 = assistant token (trainable label)
``aux_hidden_states``         ``[T, 3, H]`` bfloat16, HF ``output_hidden_states`` ids
``topk_ids``                  ``[T, k]``   int32, target's top-k next-token ids at t
``topk_logprobs``             ``[T, k]``   float32, their log-probs (full-vocab softmax)
============================  ===========  ==========================================

A shard concatenates its samples along the token axis and adds ``offsets [n+1]``
(int64): sample ``i`` is rows ``offsets[i]:offsets[i+1]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.errors import Eagle3Error

FORMAT = "eagle3-features"
VERSION = 1
MANIFEST = "manifest.json"
TENSOR_KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "topk_ids", "topk_logprobs")
DTYPES = {
    "input_ids": torch.int32,
    "loss_mask": torch.uint8,
    "aux_hidden_states": torch.bfloat16,
    "topk_ids": torch.int32,
    "topk_logprobs": torch.float32,
}
# Metadata keys that must agree between feature folders trained on together.
COMPATIBILITY_KEYS = (
    ("target", "content_hash"),
    ("target", "hidden_size"),
    ("target", "vocab_size"),
    ("target", "quantization"),
    ("aux_layer_ids",),
    ("chat_template_hash",),
    ("capture", "top_k"),
)


@dataclass
class Capture:
    """What an engine returns for one token sequence of length T.

    Attributes:
        aux_hidden_states: ``[T, 3, H]`` bfloat16, the residual stream entering the
            three aux layers (HF ``output_hidden_states`` ids) at every position.
        topk_ids: ``[T, k]`` int32, the target's top-k next-token ids at position t
            (the distribution of token t+1), most likely first.
        topk_logprobs: ``[T, k]`` float32, their log-probabilities under the full
            target vocabulary (log-softmax of the target's logits).
    """

    aux_hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor


@dataclass
class Record:
    """One captured sample: ids ``[T]`` int32, loss mask ``[T]`` uint8, and its capture."""

    sample_id: str
    split: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    capture: Capture

    def tensors(self) -> dict[str, torch.Tensor]:
        """The five stored tensors, cast to the stored dtypes and checked for shape.

        Raises:
            Eagle3Error: lengths disagree, or the aux states are not ``[T, 3, H]``.
        """
        out = {
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "aux_hidden_states": self.capture.aux_hidden_states,
            "topk_ids": self.capture.topk_ids,
            "topk_logprobs": self.capture.topk_logprobs,
        }
        out = {k: v.detach().to("cpu", DTYPES[k]).contiguous() for k, v in out.items()}
        T = out["input_ids"].shape[0]
        aux = out["aux_hidden_states"]
        if aux.dim() != 3 or aux.shape[:2] != (T, 3):
            raise Eagle3Error(
                f"sample {self.sample_id}: aux_hidden_states has shape {tuple(aux.shape)}, "
                f"expected [{T}, 3, H]; the engine must capture exactly three aux layers"
            )
        for k in ("loss_mask", "topk_ids", "topk_logprobs"):
            if out[k].shape[0] != T:
                raise Eagle3Error(
                    f"sample {self.sample_id}: {k} has {out[k].shape[0]} rows for {T} tokens"
                )
        return out


def bytes_per_token(hidden_size: int, top_k: int) -> int:
    """Stored bytes per token: aux ``3H`` bf16 + top-k ids and log-probs + id + mask."""
    return 3 * hidden_size * 2 + top_k * (4 + 4) + 4 + 1


def estimate_bytes(num_tokens: int, hidden_size: int, top_k: int) -> int:
    """Bytes a capture of ``num_tokens`` tokens will take on disk (within a few %)."""
    return int(num_tokens) * bytes_per_token(hidden_size, top_k)


def samples_per_shard(shard_size_mb: float, hidden_size: int, top_k: int, tokens_per_sample: float) -> int:
    """How many samples of ``tokens_per_sample`` tokens fill a shard of ``shard_size_mb`` MB."""
    per_sample = max(1.0, tokens_per_sample) * bytes_per_token(hidden_size, top_k)
    return max(1, int(shard_size_mb * 1e6 // per_sample))



def shard_name(index: int) -> str:
    """File name of shard ``index`` in a features folder: ``shard-NNNNN.safetensors`` (5 digits)."""
    return f"shard-{index:05d}.safetensors"


def part_manifest_name(worker: int, workers: int) -> str:
    """``manifest.part-W-of-N.json``: the shards extracted by one data-parallel worker."""
    return f"manifest.part-{worker}-of-{workers}.json"
