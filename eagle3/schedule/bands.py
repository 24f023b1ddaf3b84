"""A schedule of speculative tokens by batch size, and the engines' own settings for it.

The best ``k`` at each measured concurrency (:func:`eagle3.schedule.derive.derive`) covers the
batch sizes nearest to it: band edges sit at the geometric midpoints of neighbouring measured
concurrencies (sweeps are spaced by factors of two, and a verify pass's cost grows with the
batch about as smoothly on a log scale), the first band starts at batch 1 and the last runs to
the server's running-request cap; neighbouring bands of the same ``k`` merge.

Written as:

* vLLM's ``num_speculative_tokens_per_batch_size`` in ``--speculative-config``: a list of
  inclusive ``[start, end, k]`` ranges, non-overlapping, the first starting at 1, ``k = 0`` no
  drafting, each ``k`` capped by ``num_speculative_tokens`` (``vllm/v1/spec_decode/dynamic/
  utils.py``; the scheduler looks ``k`` up by the number of requests it schedules; vLLM turns
  the schedule off under data parallelism);
* SGLang's ``--speculative-adaptive --speculative-adaptive-config FILE``: JSON keyed by each
  band's lowest batch size, ``{"1": {"candidate_steps": [3]}, ...}``; SGLang picks the slot of
  the largest key not above the batch size, a single candidate pins the steps, 0 drafts
  nothing; topk 1 only (``sglang/srt/speculative/adaptive_spec_params.py``).
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from typing import Optional, Sequence

from eagle3.schedule.derive import Choice


@dataclass(frozen=True)
class Band:
    """Batch sizes ``start`` to ``end`` (inclusive) run ``num_steps`` speculative tokens."""

    start: int
    end: int
    num_steps: int


def bands(choices: Sequence[Choice], max_batch: int) -> list[Band]:
    """The schedule's bands from the per-concurrency choices (see the module docstring).

    Args:
        choices: one per measured concurrency (any order).
        max_batch: the server's running-request cap (vLLM ``max_num_seqs``, SGLang
            ``max_running_requests``): the last band's end.

    Raises:
        ValueError: no choices, or ``max_batch`` below 1.
    """
    if not choices:
        raise ValueError("no measured concurrency to build a schedule from")
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch} must be >= 1")
    cs = sorted(choices, key=lambda c: c.concurrency)
    out: list[Band] = []
    start = 1
    for i, ch in enumerate(cs):
        end = (max_batch if i == len(cs) - 1
               else math.floor(math.sqrt(ch.concurrency * cs[i + 1].concurrency)))
        end = min(end, max_batch)
        if end < start:
            continue
        if out and out[-1].num_steps == ch.num_steps:
            out[-1] = Band(out[-1].start, end, ch.num_steps)
        else:
            out.append(Band(start, end, ch.num_steps))
        start = end + 1
        if start > max_batch:
            break
    return out


def steps_at(schedule: Sequence[Band], batch: int) -> int:
    """The ``k`` the schedule runs at ``batch`` (0 outside every band)."""
    return next((b.num_steps for b in schedule if b.start <= batch <= b.end), 0)


def off_above(schedule: Sequence[Band]) -> Optional[int]:
    """The batch size above which the schedule never speculates (None: it speculates up to its end;
    0: never). For an engine without a per-batch setting: serve without speculation above it."""
    on = [b.end for b in schedule if b.num_steps > 0]
    if not on:
        return 0
    return None if on[-1] == schedule[-1].end else on[-1]


def vllm_speculative_config(draft_dir: str, schedule: Sequence[Band]) -> Optional[dict]:
    """vLLM's ``--speculative-config`` for the schedule: ``num_speculative_tokens`` the largest
    ``k`` (vLLM caps every band by it), ``num_speculative_tokens_per_batch_size`` the bands;
    None when no band speculates (serve without ``--speculative-config``)."""
    top = max((b.num_steps for b in schedule), default=0)
    if top == 0:
        return None
    return {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": int(top),
            "num_speculative_tokens_per_batch_size": [[b.start, b.end, b.num_steps] for b in schedule]}


def sglang_adaptive_config(schedule: Sequence[Band]) -> dict:
    """SGLang's ``--speculative-adaptive-config`` JSON: ``{str(start): {"candidate_steps": [k]}}``."""
    return {str(b.start): {"candidate_steps": [int(b.num_steps)]} for b in schedule}


def vllm_serve_command(model: str, draft_dir: str, schedule: Sequence[Band], max_num_seqs: int) -> str:
    """``vllm serve`` with the schedule and the running-request cap it was derived for."""
    spec = vllm_speculative_config(draft_dir, schedule)
    cmd = ["vllm", "serve", model, "--max-num-seqs", str(int(max_num_seqs))]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    return shlex.join(cmd)


def sglang_serve_command(model: str, draft_dir: str, schedule: Sequence[Band], config_path: str,
                         max_running_requests: int) -> str:
    """``python -m sglang.launch_server`` with EAGLE-3, the adaptive config file at ``config_path``
    and ``--max-running-requests`` explicit (SGLang's speculative mode caps an unset one at 48)."""
    top = max((b.num_steps for b in schedule), default=0)
    cmd = ["python", "-m", "sglang.launch_server", "--model-path", model,
           "--max-running-requests", str(int(max_running_requests))]
    if top > 0:
        cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft_dir),
                "--speculative-num-steps", str(top), "--speculative-eagle-topk", "1",
                "--speculative-num-draft-tokens", str(top + 1),
                "--speculative-adaptive", "--speculative-adaptive-config", config_path]
    return shlex.join(cmd)
