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
``aux_scales`` (fp8 only)     ``[T, 3]``   float32, see below
============================  ===========  ==========================================

Aux storage (``metadata.capture.aux_dtype``, absent = ``bfloat16``): ``float8_e4m3fn``
stores ``aux_hidden_states`` as OCP FP8 E4M3 with one float32 scale per token and aux
layer (``aux_scales = absmax / 448``, :func:`quantize_aux`), 1,740 bytes a token instead of
3,456 at H = 576, so one disk holds about twice the captured tokens. The reader gives back
bfloat16 (:func:`dequantize_aux`); a non-finite state stays non-finite, so the
non-finite check of training still sees it.

A shard concatenates its samples along the token axis and adds ``offsets [n+1]``
(int64): sample ``i`` is rows ``offsets[i]:offsets[i+1]``.

Sample layout (``metadata.sample_layout`` of the manifest, :func:`sample_layout`):
``target_ids`` -- the ids the target was given and generated, turn after turn, and the
loss mask on exactly the generated ids (regenerated replies); ``template_text`` -- the
conversation rendered as text by the chat template and tokenized, the mask from token
offsets (dataset replies kept). Folders written before the field existed and holding
regenerated replies are ``retokenized_replies``: the target's replies decoded to text
and tokenized again, which can segment them differently from how the target did.

Top-k order (:func:`rank_top_k`): by logit, ties by the lower token id, so that
``topk_ids[t, 0]`` is ``torch.argmax`` of the logits, the token a greedy verifier takes
(:func:`eagle3.spec.accept.accept_greedy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from eagle3.errors import Eagle3Error

FORMAT = "eagle3-features"
VERSION = 1
MANIFEST = "manifest.json"
TENSOR_KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "topk_ids", "topk_logprobs")
REPLY_KEYS = ("input_ids", "loss_mask")  # all that a replies-only folder stores (metadata.features = none)
# metadata.features of a manifest: what its shards hold (absent = offline, folders written before the field)
FEATURES_OFFLINE, FEATURES_NONE = "offline", "none"
DTYPES = {
    "input_ids": torch.int32,
    "loss_mask": torch.uint8,
    "aux_hidden_states": torch.bfloat16,
    "topk_ids": torch.int32,
    "topk_logprobs": torch.float32,
}
# how aux_hidden_states are stored (metadata.capture.aux_dtype; absent = bfloat16)
AUX_BF16, AUX_FP8 = "bfloat16", "float8_e4m3fn"
AUX_DTYPES = (AUX_BF16, AUX_FP8)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
# metadata.sample_layout values (see the module docstring)
LAYOUT_TARGET_IDS = "target_ids"
LAYOUT_TEMPLATE_TEXT = "template_text"
LAYOUT_RETOKENIZED = "retokenized_replies"
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
    """One sample: ids ``[T]`` int32, loss mask ``[T]`` uint8, and its capture (None in a
    replies-only folder, ``extract.py features=none``)."""

    sample_id: str
    split: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    capture: Optional[Capture]

    def tensors(self, aux_dtype: str = AUX_BF16) -> dict[str, torch.Tensor]:
        """The stored tensors, cast to the stored dtypes and checked for shape: the five of the
        module table, and ``aux_scales`` with ``aux_dtype="float8_e4m3fn"`` (:func:`quantize_aux`).

        Without a capture only ``input_ids`` and ``loss_mask`` are returned.

        Raises:
            Eagle3Error: lengths disagree, or the aux states are not ``[T, 3, H]``.
        """
        if self.capture is None:
            out = {"input_ids": self.input_ids, "loss_mask": self.loss_mask}
            out = {k: v.detach().to("cpu", DTYPES[k]).contiguous() for k, v in out.items()}
            if out["loss_mask"].shape[0] != out["input_ids"].shape[0]:
                raise Eagle3Error(f"sample {self.sample_id}: loss_mask has {out['loss_mask'].shape[0]} rows for "
                                  f"{out['input_ids'].shape[0]} tokens")
            return out
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
        if aux_dtype == AUX_FP8:
            out["aux_hidden_states"], out["aux_scales"] = quantize_aux(aux)
        return out


def quantize_aux(aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Aux states ``[T, 3, H]`` (any float dtype) -> ``(q [T, 3, H] float8_e4m3fn, scales [T, 3]
    float32)`` with ``scales = absmax over H / 448`` (the per-token, per-tensor scaling of
    FP8 activation quantization, e.g. vLLM's dynamic per-token FP8): each state's largest
    element maps to E4M3's largest finite value, and every element keeps 3 mantissa bits:
    ``q * scale`` is within a relative 2^-4 of the element above E4M3's normal range
    (``2^-6 * scale``) and within an absolute ``2^-10 * scale`` below it; the bf16 result of
    :func:`dequantize_aux` adds bf16's own rounding (relative 2^-9) to that. An all-zero
    state gets scale 1. A state with a NaN or an infinity gets a non-finite scale and
    dequantizes to NaN."""
    x = aux.float()
    amax = x.abs().amax(dim=-1)  # [T, 3]; NaN or inf propagate
    scales = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
    q = (x / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales


def dequantize_aux(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``q [T, 3, H]`` float8_e4m3fn and ``scales [T, 3]`` float32 -> ``[T, 3, H]`` bfloat16
    (:func:`quantize_aux`'s inverse up to its rounding)."""
    return (q.float() * scales[..., None].float()).to(torch.bfloat16)


def bytes_per_token(hidden_size: int, top_k: int, aux_dtype: str = AUX_BF16, features: str = FEATURES_OFFLINE) -> int:
    """Stored bytes per token: aux ``3H`` bf16 (or ``3H`` fp8 + three float32 scales) + top-k
    ids and log-probs + id + mask; a replies-only folder (``features="none"``) stores the id
    and the mask alone (5 bytes)."""
    if features == FEATURES_NONE:
        return 4 + 1
    aux = 3 * hidden_size + 3 * 4 if aux_dtype == AUX_FP8 else 3 * hidden_size * 2
    return aux + top_k * (4 + 4) + 4 + 1


def estimate_bytes(num_tokens: int, hidden_size: int, top_k: int, aux_dtype: str = AUX_BF16,
                   features: str = FEATURES_OFFLINE) -> int:
    """Bytes a capture of ``num_tokens`` tokens will take on disk (within a few %)."""
    return int(num_tokens) * bytes_per_token(hidden_size, top_k, aux_dtype, features)


def samples_per_shard(shard_size_mb: float, hidden_size: int, top_k: int, tokens_per_sample: float,
                      aux_dtype: str = AUX_BF16, features: str = FEATURES_OFFLINE) -> int:
    """How many samples of ``tokens_per_sample`` tokens fill a shard of ``shard_size_mb`` MB."""
    per_sample = max(1.0, tokens_per_sample) * bytes_per_token(hidden_size, top_k, aux_dtype, features)
    return max(1, int(shard_size_mb * 1e6 // per_sample))



def stored_features(metadata: dict) -> str:
    """What a manifest's shards hold: ``offline`` (the features) or ``none`` (the kept replies
    alone, ``extract.py features=none``); absent = ``offline``."""
    return str(metadata.get("features", FEATURES_OFFLINE))


def sample_layout(metadata: dict) -> str:
    """The sample layout of a manifest's ``metadata`` (see the module docstring).

    A manifest without ``sample_layout`` predates the field: ``retokenized_replies`` when
    it regenerated the replies (``metadata.regenerate`` true or absent), else
    ``template_text`` (the text path has not changed).
    """
    layout = metadata.get("sample_layout")
    if layout is not None:
        return str(layout)
    return LAYOUT_RETOKENIZED if metadata.get("regenerate", True) else LAYOUT_TEMPLATE_TEXT


def rank_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits of each row, largest first, equal logits by the lower token id.

    ``torch.topk`` leaves the order of equal values unspecified (on a CPU it returns
    tied ids out of order, and with more ties than ``k`` it may leave the lowest tied id
    out); ``torch.argmax`` returns the first maximal index, which is what a greedy
    verifier takes (:func:`eagle3.spec.accept.accept_greedy`, SGLang's greedy sampler).
    Here the result is that of a stable descending sort cut at ``k``, so
    ``ids[:, 0] == logits.argmax(-1)``: the values above the ``k``-th largest come from
    ``topk`` (ordered by value, then id), the rest are the lowest ids holding the ``k``-th
    largest value (one more pass over the row, no full sort).

    Args:
        logits: ``[n, V]`` float logits (compared as given; a bf16 -> float32 cast
            changes no order).
        k: ``1 <= k <= V``.

    Returns:
        ``(ids [n, k] int64, values [n, k])``, values in the dtype of ``logits``.
    """
    vals, ids = logits.topk(k, dim=-1)  # the k largest values, ties in any order
    kth = vals[:, -1:]  # [n, 1]
    above = (vals > kth).sum(-1, keepdim=True)  # [n, 1]: values above the k-th, in every top-k set
    ids, perm = ids.sort(dim=-1)  # by id ...
    vals, perm2 = vals.gather(-1, perm).sort(dim=-1, descending=True, stable=True)  # ... then by value
    ids = ids.gather(-1, perm2)
    V = logits.shape[-1]
    lower_first = torch.arange(V, 0, -1, dtype=torch.float32, device=logits.device)  # V .. 1: larger for lower ids
    low = torch.where(logits == kth, lower_first, 0.0).topk(k, dim=-1).indices  # lowest ids at the k-th value
    j = torch.arange(k, device=logits.device).unsqueeze(0)
    ids = torch.where(j < above, ids, low.gather(-1, (j - above).clamp(min=0)))
    return ids, logits.gather(-1, ids)


def shard_name(index: int) -> str:
    """File name of shard ``index`` in a features folder: ``shard-NNNNN.safetensors`` (5 digits)."""
    return f"shard-{index:05d}.safetensors"


def part_manifest_name(worker: int, workers: int) -> str:
    """``manifest.part-W-of-N.json``: the shards extracted by one data-parallel worker."""
    return f"manifest.part-{worker}-of-{workers}.json"
