"""In-process transformers engine (CPU or GPU).

Generation: ``model.generate`` on length-sorted batches with left padding (the
tokenizer's pad id; attention mask given, so transformers derives position ids from
it), greedy unless ``temperature > 0``, stopping at EOS or the template's end-of-turn
token. On a CPU with ``attn_implementation=sdpa`` the decode steps use the GQA decode
attention of :mod:`eagle3.engines.hf.attention` (prefill stays ``sdpa``); on CUDA
(``engine.gqa_fold``) its folded GQA SDPA (:mod:`eagle3.gqa`); recorded as
``generate_attn`` in :meth:`HFEngine.info`. With ``engine.generate_cache=static`` the
KV cache is transformers' ``StaticCache`` and transformers compiles the decode step
(CUDA graphs on CUDA); prompts are then padded to a multiple of 64 so batches share
compiled shapes (``generate_cache`` in :meth:`HFEngine.info`). With
``engine.generate_cache=graphs`` it is this project's
:class:`eagle3.engines.hf.batch_decode.BatchDecoder`: one preallocated cache, the decode
step of each batch shape captured once as a CUDA graph, nothing compiled. ``auto`` (the
default) is ``graphs`` on CUDA (1.87x the eager path at batch 256 on one H200) and the
dynamic cache on CPU; ``static`` is not the default because on real extraction its
compilations cost more than they save (docs/performance.md).

Capture: one forward pass of the base model per length-sorted batch with right
padding, an explicit attention mask and position ids ``0..len-1``, so every real token
sees exactly the tokens it would see alone. Aux hidden states are taken with forward
pre-hooks: id ``k < L`` is the input of decoder layer ``k`` and id ``L`` the input of the
final norm, i.e. HF ``output_hidden_states[k]`` (the convention of
:mod:`eagle3.target.layers`), without keeping all ``L + 1`` states. Next-token log-probs use
the target's own logits (``lm_head`` in the model dtype, as the served model computes
them), ranked and normalised on chunks of real positions only, so no ``[B, T, V]`` tensor
is ever built; log-probs are float32. The top-k is ranked on the logits with ties by the
lower token id (:func:`eagle3.features.format.rank_top_k`), so the captured top-1 is the
``argmax`` a greedy verifier takes; :mod:`eagle3.engines.hf.capture` does it in two stages
and copies the results to the host while the next batch runs.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Optional

import torch
from tqdm import tqdm

from eagle3.target import end_of_turn_ids
from eagle3.engines.base import Engine
from eagle3.engines.hf.batch_decode import cut_after_stop
from eagle3.engines.hf.capture import HostCopies, aux_hooks, top_k_logprobs
from eagle3.engines.hf.oom import run_in_batches
from eagle3.errors import Eagle3Error
from eagle3.features import Capture
from eagle3.devices import resolve_device
from eagle3.target import TargetInfo, load_target

log = logging.getLogger("eagle3")

STATIC_WIDTH_MULTIPLE = 64  # static-cache generation pads prompts to a multiple of this (fewer compiled shapes)
GENERATE_TOKEN_FACTOR = 8  # a generate batch holds <= 8 x max_batch_tokens padded prompt + new tokens
# Batch sizes when the engine config leaves them unset (None), by device type.
# cpu: a decode step reads every weight once, so wider generate batches amortise it
# (SmolLM2 bf16 on 2 cores with the GQA decode attention, short chat prompts, 128 new
# tokens: 195 tok/s at 16 rows, 434 at 64); capture batches stay small (compute bound already). cuda: generation is bound
# by per-step overhead, so wide batches are nearly free.
DEFAULT_BATCH = {
    "cpu": {"generate_batch_size": 64, "capture_batch_size": 16, "max_batch_tokens": 8192},
    "cuda": {"generate_batch_size": 256, "capture_batch_size": 64, "max_batch_tokens": 65536},
}


def _batches(lengths: list[int], max_items: int, max_tokens: int, extra: int = 0) -> list[list[int]]:
    """Indices grouped longest first; each batch has <= max_items rows and
    rows x (longest + extra) <= max_tokens padded tokens (a single row may exceed it)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = (lengths[cur[0]] if cur else lengths[i]) + extra
        if cur and (len(cur) + 1 > max_items or (len(cur) + 1) * width > max_tokens):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def left_pad(seqs: list[list[int]], pad_id: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, T] int64, attention_mask [B, T] int64)``, pads on the left, mask 0 there;
    ``T`` is the longest row rounded up to ``multiple`` (so compiled shapes repeat)."""
    width = -(-max(len(s) for s in seqs) // multiple) * multiple
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[r, width - len(s):] = 1
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, position_ids)``, each ``[B, T]`` int64: pads on the
    right (mask 0 there) and positions ``0..len-1`` for the real tokens, so each real token
    is computed exactly as in its own unpadded sequence."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[r, : len(s)] = 1
    pos = torch.arange(width, dtype=torch.long).unsqueeze(0).expand(len(seqs), -1).contiguous()
    return ids, mask, pos


def generation_config(sampling, stop_ids: list[int], pad_id: int, static: bool):
    """The ``GenerationConfig`` of one :meth:`HFEngine.generate` call.

    Greedy unless ``sampling.temperature > 0`` (then temperature and top-p, no top-k);
    ``max_new_tokens`` from ``sampling``; stops at any of ``stop_ids``. ``static``: a
    preallocated ``StaticCache`` (``cache_implementation="static"``), with which
    transformers compiles the decode step on CUDA (``torch.compile``, mode
    ``reduce-overhead``: CUDA graphs; its ``_valid_auto_compile_criteria``) and runs it
    eagerly elsewhere.
    """
    from transformers import GenerationConfig

    do_sample = float(sampling.temperature) > 0
    return GenerationConfig(
        max_new_tokens=int(sampling.max_new_tokens),
        do_sample=do_sample,
        temperature=float(sampling.temperature) if do_sample else None,
        top_p=float(sampling.top_p) if do_sample else None,
        top_k=None,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
        cache_implementation="static" if static else None,
    )


def generation_path(cache: str | None, device_type: str) -> str:
    """The KV-cache path of batched generation for ``engine.generate_cache``.

    Args:
        cache: ``auto`` (or None), ``dynamic``, ``static`` or ``graphs``.
        device_type: ``torch.device.type`` of the target (``cuda``, ``cpu``, ...).

    Returns:
        ``graphs``, ``static`` or ``dynamic``. ``auto`` is ``graphs`` on CUDA (measured 1.87x
        the eager path at batch 256 on one H200, docs/performance.md) and ``dynamic``
        elsewhere, where there are no CUDA graphs.

    Raises:
        Eagle3Error: any other value, naming the allowed ones.
    """
    cache = cache or "auto"
    if cache not in ("auto", "dynamic", "static", "graphs"):
        raise Eagle3Error(f"engine.generate_cache={cache!r}: use auto, dynamic, static or graphs")
    if cache == "auto":
        return "graphs" if device_type == "cuda" else "dynamic"
    return cache


class HFEngine(Engine):
    """The target run in-process by transformers.

    Args:
        model: a causal LM (``AutoModelForCausalLM``) in eval mode on ``device``.
        tokenizer: its tokenizer (chat template, pad id).
        target: the resolved :class:`TargetInfo` (aux layer ids, sizes).
        engine_cfg: :class:`eagle3.config.HFEngineConfig` (batch sizes, token budget).
    """

    def __init__(self, model, tokenizer, target: TargetInfo, engine_cfg, device: torch.device):
        path = generation_path(getattr(engine_cfg, "generate_cache", "auto"), device.type)
        self.static_generate = path == "static"
        self.graph_generate = path == "graphs"
        self._batch_decoder = None
        self.model = model
        self.tokenizer = tokenizer
        self.target = target
        self.cfg = engine_cfg
        self.device = device
        defaults = DEFAULT_BATCH["cuda" if device.type == "cuda" else "cpu"]
        self.batch = {k: int(getattr(engine_cfg, k, None) or v) for k, v in defaults.items()}
        self.stop_ids = end_of_turn_ids(tokenizer)
        self.generate_attn = engine_cfg.attn_implementation
        if device.type == "cpu" and engine_cfg.attn_implementation == "sdpa":
            from eagle3.engines.hf.attention import register

            self.generate_attn = register()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        self._base = base
        self._layers = base.layers
        self._norm = base.norm
        self._lm_head = model.get_output_embeddings()
        n = len(self._layers)
        if n != target.num_layers:
            raise Eagle3Error(f"the loaded target has {n} layers but its config says {target.num_layers}")
        from eagle3.spec.compiled import compile_decoder_layers, wants_compile

        # auto = off here: with the attention compiled too, regeneration's batched decoder and
        # capture ran 4-6x slower; with SDPA kept eager the decoder ran 1.15x the uncompiled one
        # at batch 256 (docs/performance.md), not yet timed in a whole extraction
        self.compile_layers = wants_compile(getattr(engine_cfg, "compile_layers", None), device.type, default=False)
        if self.compile_layers:
            compile_decoder_layers(model, attention_in_graph=engine_cfg.attn_implementation != "sdpa")
        from eagle3.gqa import GQA_SDPA_OUTSIDE_COMPILE, register_gqa_sdpa, wants_fold

        self.gqa_fold = wants_fold(getattr(engine_cfg, "gqa_fold", None), device.type, engine_cfg.attn_implementation)
        if self.gqa_fold:  # generation's decode steps attend without repeat_kv copies (eagle3.gqa); capture keeps sdpa
            folded = register_gqa_sdpa()  # registers both keys
            self.generate_attn = GQA_SDPA_OUTSIDE_COMPILE if self.compile_layers else folded
        # what capture attends with, and what generation_attention restores: the model's own
        # (SDPA_OUTSIDE_COMPILE once compiled as above), not the configured name
        self.capture_attn = getattr(model.config, "_attn_implementation", None) or engine_cfg.attn_implementation
        # capture ranks bf16 logits in blocks and fuses the log-normaliser; False: the float32
        # reference path (same ids and log-probs; benchmarks/extract_throughput.py times both)
        self.capture_fast = True

    @classmethod
    def from_config(cls, model_cfg, engine_cfg, cache_dir, run_dir=None) -> "HFEngine":
        """Load ``model_cfg``'s target on ``engine_cfg.device`` (``auto``: cuda if available)."""
        device = resolve_device(engine_cfg.device)
        model, tok, info = load_target(
            model_cfg, cache_dir, device=device, attn_implementation=engine_cfg.attn_implementation
        )
        return cls(model, tok, info, engine_cfg, device)

    def info(self) -> dict[str, Any]:
        """See :meth:`Engine.info`: name ``hf``, device type, dtype of the weights, attention
        implementations (model and generation) and the torch / transformers versions."""
        import transformers

        return {
            "name": "hf",
            "device": self.device.type,
            "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
            "attn_implementation": self.cfg.attn_implementation,
            "generate_attn": self.generate_attn,
            "compile_layers": self.compile_layers,
            "generate_cache": "static" if self.static_generate else ("graphs" if self.graph_generate else "dynamic"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }

    # -------------------------------------------------------------- generation
    @contextlib.contextmanager
    def generation_attention(self):
        """Context manager: inside it the model attends with ``self.generate_attn`` (what
        :meth:`generate` uses; on a CPU the GQA decode attention), after it with
        ``self.capture_attn`` again (what :meth:`capture` uses: ``engine.attn_implementation``,
        or :data:`eagle3.spec.compiled.SDPA_OUTSIDE_COMPILE` when the layers were compiled with
        SDPA kept eager)."""
        if self.generate_attn == self.cfg.attn_implementation:
            yield
            return
        self.model.set_attn_implementation(self.generate_attn)
        try:
            yield
        finally:
            self.model.set_attn_implementation(self.capture_attn)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], sampling) -> list[list[int]]:
        """Batched generation (see :meth:`Engine.generate`): batches of at most
        ``engine.generate_batch_size`` prompts and 8 x ``engine.max_batch_tokens`` padded
        prompt + new tokens (the KV cache), longest first, seeded with ``sampling.seed``
        per call when sampling. On CUDA out-of-memory the limits are halved and the prompts
        not yet generated are planned again (:func:`eagle3.engines.hf.oom.run_in_batches`)."""
        if not prompts:
            return []
        do_sample = float(sampling.temperature) > 0
        gen_cfg = generation_config(sampling, self.stop_ids, self.pad_id, self.static_generate)
        if do_sample:
            torch.manual_seed(int(sampling.seed))
        lengths = [len(p) for p in prompts]
        out: list[Optional[list[int]]] = [None] * len(prompts)

        def plan(ls: list[int]) -> list[list[int]]:
            budget = GENERATE_TOKEN_FACTOR * self.batch["max_batch_tokens"]  # prompt + new tokens per batch
            return _batches(ls, self.batch["generate_batch_size"], budget, int(sampling.max_new_tokens))

        def run(idx: list[int]) -> None:
            budget = GENERATE_TOKEN_FACTOR * self.batch["max_batch_tokens"]
            if self.graph_generate:
                with self.generation_attention():
                    if self._graphed(idx, prompts, sampling, budget, out):
                        return
            ids, mask = left_pad([prompts[i] for i in idx], self.pad_id,
                                 STATIC_WIDTH_MULTIPLE if self.static_generate else 1)
            width = ids.shape[1]
            with self.generation_attention():
                gen = self.model.generate(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=gen_cfg
                )
            new = gen[:, width:].tolist()
            for r, i in enumerate(idx):
                out[i] = cut_after_stop(new[r], self.stop_ids)

        def drop_decoder() -> None:  # its KV cache was sized from the old budget
            self._batch_decoder = None

        # a CPU batch of long prompts takes minutes: show it (terminals only; leaves no line behind)
        run_in_batches(self.batch, ("generate_batch_size", "max_batch_tokens"), lengths, plan, run, "generate",
                       on_shrink=drop_decoder,
                       progress=lambda b: tqdm(b, desc="generate", unit="batch", leave=False,
                                               disable=None if len(b) > 1 else True, file=sys.stderr))
        return out  # type: ignore[return-value]

    def _graphed(self, idx: list[int], prompts: list[list[int]], sampling, budget: int,
                 out: list[Optional[list[int]]]) -> bool:
        """Generate batch ``idx`` with the :class:`BatchDecoder` (``generate_cache=graphs``)
        into ``out``; False (nothing done) for a batch beyond its cache (one prompt longer
        than the token budget), which then takes ``model.generate``."""
        from eagle3.engines.hf.batch_decode import SLOT_MULTIPLE, BatchDecoder

        if self._batch_decoder is None:  # one cache for every batch: the budget, plus rounding of each row's width
            capacity = budget + self.batch["generate_batch_size"] * SLOT_MULTIPLE
            self._batch_decoder = BatchDecoder(self.model, capacity, cuda_graphs=getattr(self.cfg, "cuda_graphs", True))
        width = max(len(prompts[i]) for i in idx) + int(sampling.max_new_tokens)
        if len(idx) * (-(-width // SLOT_MULTIPLE) * SLOT_MULTIPLE) > self._batch_decoder.cache.capacity:
            return False
        rows = self._batch_decoder.generate([prompts[i] for i in idx], int(sampling.max_new_tokens), self.stop_ids,
                                            self.pad_id, float(sampling.temperature), float(sampling.top_p))  # seeded above
        for i, row in zip(idx, rows):
            out[i] = row
        return True

    # ----------------------------------------------------------------- capture
    @torch.inference_mode()
    def capture(self, sequences: list[list[int]], top_k: int) -> list[Capture]:
        """Batched capture (see :meth:`Engine.capture`): batches of at most
        ``engine.capture_batch_size`` sequences and ``engine.max_batch_tokens`` padded
        tokens, longest first, right-padded; on CUDA out-of-memory the limits are halved and
        the sequences not yet captured are planned again (:mod:`eagle3.engines.hf.oom`).
        Ranking, log-probs and the copies to the host are :mod:`eagle3.engines.hf.capture`'s."""
        if any(len(s) == 0 for s in sequences):
            raise Eagle3Error("cannot capture an empty token sequence")
        V = self.target.vocab_size
        if not 0 < top_k <= V:
            raise Eagle3Error(f"capture.top_k={top_k} must be in 1..{V}")
        lengths = [len(s) for s in sequences]
        out: list[Optional[Capture]] = [None] * len(sequences)
        copies = HostCopies(self.device)

        def run(idx: list[int]) -> None:
            ids, mask, pos = right_pad([sequences[i] for i in idx], self.pad_id)
            rows = mask.view(-1).nonzero().squeeze(1).to(self.device)  # [N] real positions in batch order
            store: dict[int, torch.Tensor] = {}
            with aux_hooks(self._layers, self._norm, self.target.aux_layer_ids, store):
                # no padding mask: the pads are on the right, so in a causal decoder a real token
                # attends only to earlier, real ones; the pads' own outputs are computed and dropped
                # (``rows``). Plain causal attention takes the flash kernel, where a padding mask
                # took a masked one, 40% of the capture's device time on one H100 (docs/performance.md)
                hidden = self._base(
                    input_ids=ids.to(self.device),
                    attention_mask=None,
                    position_ids=pos.to(self.device),
                    use_cache=False,
                ).last_hidden_state  # [B, T, H], after the final norm
            B, T, H = hidden.shape
            aux = torch.stack([store[k].reshape(B * T, H).index_select(0, rows) for k in self.target.aux_layer_ids],
                              dim=1).to(torch.bfloat16)  # [N, 3, H]
            softcap = getattr(self.model.config, "final_logit_softcapping", None)  # Gemma 2 / 3
            top_ids, top_lp = top_k_logprobs(hidden.reshape(B * T, H).index_select(0, rows), self._lm_head, top_k,
                                             self.capture_fast, softcap)

            def done(aux, top_ids, top_lp, idx=idx):
                start = 0
                for i in idx:  # rows are in batch order
                    n = lengths[i]
                    out[i] = Capture(aux[start : start + n], top_ids[start : start + n], top_lp[start : start + n])
                    start += n

            copies.submit((aux, top_ids, top_lp), done)

        try:
            run_in_batches(self.batch, ("capture_batch_size", "max_batch_tokens"), lengths,
                           lambda ls: _batches(ls, self.batch["capture_batch_size"], self.batch["max_batch_tokens"]),
                           run, "capture")
            copies.finish()
        finally:
            copies.drop()
        return out  # type: ignore[return-value]

    def close(self) -> None:
        """Drop the model (and the CUDA cache); idempotent."""
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
