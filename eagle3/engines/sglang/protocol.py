"""What is sent to SGLang's ``/generate`` and how its answers are read.

Response shapes, read from the SGLang sources (``python/sglang/`` of the 0.5.14 and
0.5.23 wheels; paths relative to it), ``srt/managers/tokenizer_manager.py``:
``{"text", "output_ids", "meta_info"}``. ``meta_info["input_top_logprobs"][i]`` is the
top-k of the distribution of input token ``i`` given tokens ``< i`` (``None`` for
``i = 0``), each entry a ``[logprob, token_id, text-or-null]`` triple;
``output_top_logprobs[j]`` is the same for generated token ``j``.
``meta_info["hidden_states"]`` holds one block of ``[prompt_len][D]`` rows for the
prefill, then one ``[D]`` row per decoded token; in EAGLE3 mode ``D = 3H``, the aux
states concatenated in layer order (``srt/layers/logits_processor.py``,
``srt/layers/aux_hidden_states.py``). With greedy sampling the returned log-probs are
the raw ``log_softmax`` of the logits (``srt/layers/sampler.py``).

Position convention (see docs/design.md): capture position ``t`` holds the aux states
at token ``t`` and the distribution of token ``t + 1``. So row ``t`` of the top-k comes
from ``input_top_logprobs[t + 1]`` for ``t < T - 1`` and, for the last position, from
``output_top_logprobs[0]`` of the single generated token.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from eagle3.errors import Eagle3Error
from eagle3.features import Capture


def capture_request(input_ids: Sequence[int], top_k: int) -> dict:
    """The ``/generate`` body of one capture (field names of ``GenerateReqInput``).

    One greedy token (``max_new_tokens=1``) after the ``T`` tokens of ``input_ids``,
    with the hidden states and the ``top_k`` input log-probs of every position
    (``logprob_start_len=0``): what :func:`parse_capture` reads.
    """
    return {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_hidden_states": True,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": int(top_k),
    }


def generate_request(prompt_ids: Sequence[int], sampling: Any) -> dict:
    """The ``/generate`` body of one regeneration (``SamplingConfig`` -> sampling params).

    ``max_new_tokens``, ``temperature`` and ``top_p`` always; ``sampling_seed`` only
    when sampling (``temperature > 0``) with a seed set.
    """
    params: dict[str, Any] = {
        "max_new_tokens": int(sampling.max_new_tokens),
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
    }
    if float(sampling.temperature) > 0 and getattr(sampling, "seed", None) is not None:
        params["sampling_seed"] = int(sampling.seed)
    return {"input_ids": [int(t) for t in prompt_ids], "sampling_params": params}


def _raise_if_aborted(out: dict, url: str) -> None:
    """Raise :class:`~eagle3.errors.Eagle3Error` when the server aborted the request
    (``meta_info.finish_reason.type == "abort"``) instead of answering it."""
    reason = (out.get("meta_info") or {}).get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        raise Eagle3Error(f"the SGLang server at {url} aborted a request: {reason.get('message', reason)}")


def _with_stop_token(output_ids: list[int], meta_info: dict) -> list[int]:
    """Generated ids ending with the matched stop token (the engine contract keeps the
    EOS / end-of-turn token). SGLang reports it as ``finish_reason.matched``."""
    ids = [int(i) for i in output_ids]
    reason = meta_info.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "stop":
        matched = reason.get("matched")
        if isinstance(matched, int) and not isinstance(matched, bool) and (not ids or ids[-1] != matched):
            ids.append(matched)
    return ids


def output_ids_from_response(out: dict) -> list[int]:
    """Generated token ids of a non-streamed ``/generate`` answer, stop token included."""
    return _with_stop_token(list(out.get("output_ids") or []), out.get("meta_info") or {})


def _block_of_prompt_rows(hidden_states: Any) -> list:
    """The prefill rows of ``meta_info["hidden_states"]`` (``[[rows...], row, row...]``
    in SGLang; a flat list of rows is accepted too)."""
    if not isinstance(hidden_states, list) or not hidden_states:
        return []
    first = hidden_states[0]
    if isinstance(first, list) and first and isinstance(first[0], list):
        return first
    return hidden_states


def _topk_row(entry: Any, top_k: int, where: str) -> tuple[list[int], list[float]]:
    if not isinstance(entry, list) or len(entry) < top_k:
        got = "nothing" if not isinstance(entry, list) else f"{len(entry)} entries"
        raise Eagle3Error(
            f"{where} has {got} where {top_k} top log-probs were requested; "
            "send top_logprobs_num equal to capture.top_k (and the target vocabulary must have that many tokens)"
        )
    # equal log-probs: lower id first, as the hf engine and the verifier's argmax order them
    pairs = sorted(((float(e[0]), int(e[1])) for e in entry[:top_k]), key=lambda p: (-p[0], p[1]))
    return [p[1] for p in pairs], [p[0] for p in pairs]


def parse_capture(out: dict, input_ids: Sequence[int], hidden_size: int, top_k: int, url: str = "the server") -> Capture:
    """Turn one capture answer of SGLang into a :class:`~eagle3.features.Capture`.

    Args:
        out: the ``/generate`` answer for ``input_ids`` sent with ``max_new_tokens=1``,
            ``return_hidden_states``, ``return_logprob``, ``logprob_start_len=0`` and
            ``top_logprobs_num=top_k``.
        input_ids: the ``T`` tokens sent.
        hidden_size: the target's ``H``.

    Returns:
        Capture with ``aux_hidden_states [T, 3, H]`` bf16, ``topk_ids [T, k]`` int32 and
        ``topk_logprobs [T, k]`` float32; row ``t`` is the distribution of token ``t+1``
        (``input_top_logprobs[t+1]``; the last row from ``output_top_logprobs[0]``).

    Raises:
        Eagle3Error: the width is not ``3H`` or the row count is not ``T`` (each message
            names the server setting to fix), or log-probs are missing.
    """
    meta = out.get("meta_info") or {}
    T = len(input_ids)
    if "hidden_states" not in meta:
        raise Eagle3Error(
            f"{url} returned no hidden_states; start the server with --enable-return-hidden-states "
            "(and --speculative-algorithm EAGLE3 with a drafter for this target)"
        )
    rows = _block_of_prompt_rows(meta["hidden_states"])
    cached = int(meta.get("cached_tokens") or 0)
    if not rows:
        raise Eagle3Error(
            f"{url} returned no hidden-state rows for a {T}-token sequence ({cached} tokens served from cache); "
            "start the server with --disable-radix-cache and --chunked-prefill-size -1"
        )
    width = len(rows[0]) if isinstance(rows[0], list) else 0
    if width != 3 * hidden_size:
        if width == hidden_size:
            hint = ("these are the final hidden states, not the aux states: start the server with "
                    "--speculative-algorithm EAGLE3 and a drafter whose config lists three aux layers")
        else:
            hint = ("the server's target is not this model (check model.hidden_size and --model-path) "
                    "or its drafter config does not list exactly three aux layers")
        raise Eagle3Error(f"{url} returned hidden states of width {width}, expected 3 x {hidden_size} = {3 * hidden_size}; {hint}")
    if len(rows) != T:
        raise Eagle3Error(
            f"{url} returned {len(rows)} hidden-state rows for a {T}-token sequence "
            f"({cached} tokens served from cache); start the server with --disable-radix-cache and "
            "--chunked-prefill-size -1 (or a chunk size above capture.max_length) so one prefill covers every token"
        )
    if cached:
        raise Eagle3Error(
            f"{url} served {cached} of {T} tokens from its radix cache, whose hidden states are not recomputed; "
            "start the server with --disable-radix-cache"
        )
    inp = meta.get("input_top_logprobs")
    outp = meta.get("output_top_logprobs")
    if not isinstance(inp, list) or len(inp) != T or not isinstance(outp, list) or not outp:
        n_in = len(inp) if isinstance(inp, list) else "no"
        raise Eagle3Error(
            f"{url} returned {n_in} input top log-prob rows for {T} tokens; send return_logprob, "
            "logprob_start_len=0 and top_logprobs_num (sglang versions without input top log-probs cannot capture)"
        )
    ids = torch.empty(T, top_k, dtype=torch.int32)
    lps = torch.empty(T, top_k, dtype=torch.float32)
    for t in range(T - 1):
        i, lp = _topk_row(inp[t + 1], top_k, f"{url} input_top_logprobs[{t + 1}]")
        ids[t] = torch.tensor(i, dtype=torch.int32)
        lps[t] = torch.tensor(lp, dtype=torch.float32)
    i, lp = _topk_row(outp[0], top_k, f"{url} output_top_logprobs[0]")
    ids[T - 1] = torch.tensor(i, dtype=torch.int32)
    lps[T - 1] = torch.tensor(lp, dtype=torch.float32)
    aux = torch.tensor(rows, dtype=torch.float32).to(torch.bfloat16).view(T, 3, hidden_size)  # [T, 3H] -> [T, 3, H]
    return Capture(aux_hidden_states=aux, topk_ids=ids, topk_logprobs=lps)
