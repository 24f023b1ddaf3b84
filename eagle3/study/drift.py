"""Measured feature drift between deployments of one target on the same token sequences.

A *deployment* is a target build (a :class:`eagle3.config.ModelConfig`: the BF16 parent,
its W4A16 build, the dense dequantisation of that build) run in-process with a compute
dtype (:class:`Deployment`). The study (:func:`measure_drift`):

1. builds the token sequences once (:func:`build_sequences`): the first user turn of
   ``n`` prompts rendered with the chat template, then a greedy reply written by one
   deployment (the same tokens for every deployment afterwards);
2. runs every deployment's forward pass on each sequence with ``output_hidden_states``
   (:func:`forward_states`), and for each pair of deployments accumulates, per hidden
   state id, the mean cosine similarity and relative L2 error of the hidden states, and
   the target's own top-1 next-token agreement and mean KL (:mod:`eagle3.study.metrics`).

Hidden-state ids follow the project's convention (HF ``output_hidden_states`` indices,
docs/design.md); every id ``0..L`` is measured and the aux ids are reported apart.
Positions are scored in two scopes: ``all`` (every position but the first) and
``reply`` (positions whose *next* token is a reply token: what a drafter's loss sees).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from eagle3.errors import Eagle3Error
from eagle3.study.metrics import PairAccumulator
from eagle3.target import DTYPES, end_of_turn_ids, load_target, render_prompt

log = logging.getLogger("eagle3")

SCOPES = ("all", "reply")


@dataclass
class Deployment:
    """One deployment in the study: ``label`` (table name), ``model`` (a ModelConfig) and
    ``compute_dtype`` (``float32`` | ``bfloat16``; None = ``model.dtype``).

    The weights are loaded in ``model.dtype`` (so a W4A16 folder is decompressed exactly
    as the hf engine does it) and the model is then cast to ``compute_dtype``: a bf16
    weight cast to float32 is exact, so a float32 study isolates the weights' drift from
    the compute's rounding.
    """

    label: str
    model: object
    compute_dtype: Optional[str] = None


def load_deployment(dep: Deployment, cache_dir):
    """``(model, tokenizer, TargetInfo)`` of ``dep`` on CPU, in eval mode, in its compute dtype.

    Raises:
        Eagle3Error: as :func:`eagle3.target.load_target`, or an unknown compute dtype.
    """
    model, tok, info = load_target(dep.model, cache_dir, device="cpu")
    if dep.compute_dtype is not None:
        if dep.compute_dtype not in DTYPES:
            raise Eagle3Error(f"compute dtype '{dep.compute_dtype}' of {dep.label} is unknown; use one of {sorted(DTYPES)}")
        model = model.to(DTYPES[dep.compute_dtype])
    return model, tok, info


def first_user_turns(conversations, n: int) -> list[list[dict]]:
    """The messages up to and including the first user message of each of the first ``n``
    conversations that have one (system messages before it kept)."""
    out = []
    for msgs in conversations:
        for i, m in enumerate(msgs):
            if m["role"] == "user":
                out.append([dict(role=x["role"], content=x["content"]) for x in msgs[: i + 1]])
                break
        if len(out) == n:
            break
    return out


@torch.no_grad()
def build_sequences(model, tok, prompts: list[list[dict]], max_new_tokens: int, max_prompt_tokens: int,
                    batch_size: int = 8) -> list[dict]:
    """Render ``prompts`` and let ``model`` answer each greedily: ``[{input_ids, prompt_len}]``.

    ``input_ids`` is the rendered prompt (truncated to its last ``max_prompt_tokens``
    tokens) followed by up to ``max_new_tokens`` reply tokens (stopping after an
    end-of-turn token, which is kept). Batches are left-padded; greedy decoding makes
    the reply independent of the batch up to the deployment's own rounding.
    """
    stop = end_of_turn_ids(tok)
    rendered = [render_prompt(tok, p)[-max_prompt_tokens:] for p in prompts]
    out = []
    for s in range(0, len(rendered), batch_size):
        chunk = rendered[s: s + batch_size]
        width = max(len(r) for r in chunk)
        ids = torch.full((len(chunk), width), tok.pad_token_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, r in enumerate(chunk):
            ids[i, width - len(r):] = torch.tensor(r)
            att[i, width - len(r):] = 1
        gen = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=stop, pad_token_id=tok.pad_token_id)
        for i, r in enumerate(chunk):
            reply = gen[i, width:].tolist()
            cut = next((j + 1 for j, t in enumerate(reply) if t in stop), len(reply))
            out.append({"input_ids": list(r) + reply[:cut], "prompt_len": len(r)})
    return out


@torch.no_grad()
def forward_states(model, input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through ``model``: ``(states [L+1, T, H], logits [T, V])``, float32, CPU.

    ``states[k]`` is HF ``output_hidden_states[k]`` (the residual stream entering decoder
    layer ``k``; ``states[L]`` is after the final norm, as transformers returns it);
    ``logits[t]`` predict token ``t+1``.
    """
    ids = torch.tensor([input_ids], dtype=torch.long)
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    states = torch.stack([h[0] for h in out.hidden_states]).float()
    return states, out.logits[0].float()


def scope_masks(T: int, prompt_len: int) -> dict[str, torch.Tensor]:
    """``{"all": positions 1..T-1, "reply": positions prompt_len-1..T-2}`` as ``[T]`` bool.

    ``reply`` holds the positions whose next token is a reply token (the logits at t
    predict t+1), the positions a drafter is trained and scored on.
    """
    all_ = torch.ones(T, dtype=torch.bool)
    all_[0] = False  # the first position is the same embedding everywhere (and an attention sink)
    reply = torch.zeros(T, dtype=torch.bool)
    reply[max(prompt_len - 1, 0): T - 1] = True
    return {"all": all_, "reply": reply}


def measure_drift(models: dict, sequences: list[dict], pairs: list[tuple[str, str]], num_states: int,
                  top1: Optional[dict] = None) -> dict:
    """Accumulate every pair's metrics over ``sequences``.

    Args:
        models: ``{label: loaded model}`` (every label used in ``pairs``).
        sequences: from :func:`build_sequences`.
        pairs: ``(reference label, other label)``; the reference is ``a`` of the metrics.
        num_states: ``L + 1`` (hidden-state ids measured: ``0..L``).
        top1: if given, filled with ``{label: [[argmax at each position] per sequence]}``
            (what :func:`argmax_per_position` returns, without a second forward pass).

    Returns:
        ``{"a:b": {scope: PairAccumulator.summary()}}``.

    Raises:
        Eagle3Error: a pair names a label that is not loaded.
    """
    missing = {x for p in pairs for x in p} - set(models)
    if missing:
        raise Eagle3Error(f"pairs name deployments {sorted(missing)} that are not in the study; list them as deployments")
    layers = list(range(num_states))
    acc = {p: {s: PairAccumulator(layers) for s in SCOPES} for p in pairs}
    for i, seq in enumerate(sequences):
        outs = {label: forward_states(m, seq["input_ids"]) for label, m in models.items()}
        masks = scope_masks(len(seq["input_ids"]), seq["prompt_len"])
        if top1 is not None:
            for label, (_, logits) in outs.items():
                top1.setdefault(label, []).append(logits.argmax(-1).tolist())
        for (a, b), per_scope in acc.items():
            for s, pa in per_scope.items():
                pa.add(outs[a][0], outs[b][0], outs[a][1], outs[b][1], masks[s])
        log.info("drift: sequence %d/%d (%d tokens)", i + 1, len(sequences), len(seq["input_ids"]))
    return {f"{a}:{b}": {s: pa.summary() for s, pa in per_scope.items()} for (a, b), per_scope in acc.items()}


def argmax_per_position(model, sequences: list[dict]) -> list[list[int]]:
    """The target's top-1 next token at every position of each sequence (``[T]`` ids per sequence)."""
    return [forward_states(model, s["input_ids"])[1].argmax(-1).tolist() for s in sequences]


def own_reply_diversity(model, tok, prompts: list[list[dict]], max_new_tokens: int, max_prompt_tokens: int) -> dict:
    """How a deployment's own greedy replies to ``prompts`` repeat themselves.

    Each deployment answers the same prompts itself (:func:`build_sequences`), and the
    replies are scored with evaluation's rules (:func:`eagle3.evaluate.metrics.diversity`:
    a reply loops when one pattern repeats over at least 32 tokens and a quarter of it).
    A target that loops inflates a drafter's tau and gives it little to learn.

    Returns:
        ``{replies, reply_tokens, looping_outputs, loop_fraction, distinct_2, ended}``;
        ``ended`` is the fraction of replies that closed with an end-of-turn token.
    """
    from eagle3.evaluate.metrics import diversity

    seqs = build_sequences(model, tok, prompts, max_new_tokens, max_prompt_tokens)
    stop = set(end_of_turn_ids(tok))
    replies = [s["input_ids"][s["prompt_len"]:] for s in seqs]
    d = diversity(replies)
    return {"replies": len(replies), "reply_tokens": sum(map(len, replies)),
            "looping_outputs": d["looping_outputs"], "loop_fraction": d["loop_fraction"],
            "distinct_2": d["distinct_2"], "ended": sum(bool(r) and r[-1] in stop for r in replies) / max(len(replies), 1)}


@torch.no_grad()
def chunked_states(model, input_ids: list[int], prompt_len: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`forward_states`, computed the way a server computes them: one prefill of
    the prompt, then the rest in forwards of ``chunk`` tokens over a KV cache (``chunk`` =
    num draft tokens: verify-pass shaped; 1: plain decode steps).

    Extraction runs one full-sequence forward; serving feeds the drafter features from
    verify passes. Same weights and tokens, other kernels and accumulation orders: the
    difference is a train/serve gap in the drafter's input (docs/precision-study.md).

    Returns:
        ``(states [L+1, T, H], logits [T, V])``, float32, CPU, as :func:`forward_states`.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    T = len(input_ids)
    bounds = sorted({0, min(prompt_len, T), *range(prompt_len, T, chunk), T})
    states, logits = [], []
    for s, e in zip(bounds, bounds[1:]):
        out = model(input_ids=torch.tensor([input_ids[s:e]]), position_ids=torch.arange(s, e)[None],
                    past_key_values=cache, use_cache=True, output_hidden_states=True)
        states.append(torch.stack([h[0] for h in out.hidden_states]).float())  # [L+1, e-s, H]
        logits.append(out.logits[0].float())
    return torch.cat(states, 1), torch.cat(logits, 0)
