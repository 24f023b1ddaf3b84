"""The served INT4 kernel's own next-token choices, read back from a vLLM server.

vLLM's ``/v1/completions`` with ``prompt_logprobs`` returns, for every prompt position
``t >= 1``, the distribution of token ``t`` given tokens ``< t`` computed by the server's
kernels (for a W4A16 checkpoint: its INT4 GEMM, not a dequantised dense weight); entry
0 is ``null``. The token of rank 1 at entry ``t`` is therefore the server's argmax of
the logits at position ``t - 1``, which :func:`top1_from_prompt_logprobs` returns in the
project's convention (position ``t`` holds the prediction for ``t + 1``,
docs/design.md). :func:`compare_top1` scores it against an in-process deployment.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Optional

from eagle3.errors import Eagle3Error


def top1_from_prompt_logprobs(prompt_logprobs: list) -> list[Optional[int]]:
    """``[T]`` entries (vLLM's ``prompt_logprobs``, entry 0 null) -> ``T - 1`` top-1 ids.

    Element ``t`` is the rank-1 token of entry ``t + 1`` (the server's argmax at position
    ``t``), or None where that entry lists no rank-1 token.
    """
    out: list[Optional[int]] = []
    for entry in prompt_logprobs[1:]:
        best = None
        for tid, v in (entry or {}).items():
            if int(v.get("rank", 0)) == 1:
                best = int(tid)
                break
        out.append(best)
    return out


def served_prompt_logprobs(url: str, input_ids: list[int], model: str = "target", timeout_s: float = 600.0) -> list:
    """POST ``input_ids`` to ``<url>/v1/completions`` (``max_tokens`` 1, greedy,
    ``prompt_logprobs`` 1) and return the answer's ``prompt_logprobs`` list.

    Raises:
        Eagle3Error: the server did not answer, or answered without ``prompt_logprobs``
            (a server that does not support it: use vLLM's OpenAI server).
    """
    body = json.dumps({"model": model, "prompt": list(map(int, input_ids)), "max_tokens": 1, "temperature": 0.0,
                       "prompt_logprobs": 1}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            ans = json.loads(r.read())
    except OSError as e:
        raise Eagle3Error(f"the vLLM server at {url} did not answer /v1/completions ({e}); start it or fix the URL") from None
    choice = (ans.get("choices") or [{}])[0]
    pl = choice.get("prompt_logprobs")
    if not pl:
        raise Eagle3Error(f"the server at {url} returned no prompt_logprobs; serve the target with vLLM's OpenAI server")
    return pl


def compare_top1(served: list[list[Optional[int]]], local: list[list[int]], prompt_lens: list[int]) -> dict:
    """Top-1 agreement of a served kernel with an in-process deployment on the same sequences.

    ``served[i]`` has ``T_i - 1`` ids (positions ``0..T_i-2``), ``local[i]`` ``T_i``. Scored
    over positions ``1..T-2`` (``all``) and ``prompt_len-1..T-2`` (``reply``), as
    :func:`eagle3.study.drift.scope_masks`; a position the server gave no rank-1 token for
    counts as a disagreement.

    Returns:
        ``{scope: {"tokens": n, "top1_agreement": fraction}}``.
    """
    tot = {"all": [0, 0], "reply": [0, 0]}
    for s, loc, p in zip(served, local, prompt_lens):
        for t in range(1, len(s)):
            same = int(s[t] is not None and s[t] == loc[t])
            tot["all"][0] += same
            tot["all"][1] += 1
            if t >= p - 1:
                tot["reply"][0] += same
                tot["reply"][1] += 1
    return {k: {"tokens": n, "top1_agreement": a / max(n, 1)} for k, (a, n) in tot.items()}
