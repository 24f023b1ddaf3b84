"""Where a drafter misses: its top-1 agreement with the target, binned by the target's confidence.

Runs a trained drafter's training-time-test unroll (:func:`eagle3.train.ttt.ttt_forward`) over
a features folder and, for every loss row of every TTT step, pairs whether the drafter's
argmax equals the target's with the target's probability of its own top token (``target_q``
of :class:`eagle3.train.ttt.TTTCollator`: the captured top-k restricted to the draft vocabulary
and renormalised, so a little above the full-vocabulary probability). Prints, per TTT step and
confidence bin, the share of rows, the drafter's agreement and the share of all its misses.

If the misses sit where the target itself hesitates between tokens, more data of the same kind
and a wider drafter can only chip at them (docs/notebook/results.md, the learning curve of 2026-12-04);
if they sit where the target is sure, the drafter is missing information it could have.

    python benchmarks/agreement_by_confidence.py --features <features folder> \\
        --drafter <run>/export/sglang --target data/models/<target folder>

CPU is enough (float32). ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.errors import Eagle3Error  # noqa: E402

EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0 + 1e-6)


def binned(correct: torch.Tensor, p: torch.Tensor, edges=EDGES) -> list[dict]:
    """Per bin ``[edges[i], edges[i+1])`` of ``p``: ``rows``, ``share`` of all rows, drafter
    ``agreement`` (None for an empty bin) and ``miss_share`` (of all misses).

    Args:
        correct: ``[N]`` bool, drafter argmax == target argmax.
        p: ``[N]`` float, the target's probability of its top token.
    """
    n, misses = correct.numel(), int((~correct).sum())
    out = []
    for lo, hi in zip(edges, edges[1:]):
        m = (p >= lo) & (p < hi)
        k = int(m.sum())
        out.append({"bin": [lo, min(hi, 1.0)], "rows": k, "share": k / n if n else 0.0,
                    "agreement": float(correct[m].float().mean()) if k else None,
                    "miss_share": int((~correct[m]).sum()) / misses if misses else 0.0})
    return out


def collect(ds, export: str, target: str, ttt_steps: int, max_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per TTT step: ``(correct [N_j] bool, p [N_j] float32)`` over every sample of ``ds``."""
    from eagle3.study.drafter_inputs import load_drafter
    from eagle3.train.data import length_bucketed_batches, make_loader
    from eagle3.train.ttt import TTTCollator, target_to_draft_index, ttt_forward

    drafter, _ = load_drafter(export, target)
    drafter.eval()
    collator = TTTCollator(target_to_draft_index(drafter.d2t, drafter.arch.vocab_size), ttt_steps, max_tokens,
                           pad_multiple=16)
    batches = length_bucketed_batches(ds.lengths, max_tokens, seed=0, epoch=0)
    per_step: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(ttt_steps)]
    with torch.no_grad():
        for batch in make_loader(ds, batches, collator, 0, False):
            if not batch["sample_ids"]:
                continue
            batch = {**batch, "aux_hidden_states": batch["aux_hidden_states"].float()}
            out = ttt_forward(drafter, batch, ttt_steps, return_logits=True)
            for j, logits in enumerate(out.logits):
                per_step[j].append((logits.argmax(-1) == batch["target_ids"][j][:, 0], batch["target_q"][j][:, 0]))
    out = [(torch.cat([c for c, _ in s]), torch.cat([p for _, p in s])) for s in per_step if s]
    if not out or out[0][0].numel() == 0:
        raise Eagle3Error("no row of these features carries a generated token to score; pass features of "
                          "regenerated replies")
    return out


def main(argv=None) -> list:
    from eagle3.study.drafter_inputs import open_features, positive_int, writable_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--features", required=True)
    ap.add_argument("--drafter", required=True, help="an SGLang-format export folder")
    ap.add_argument("--target", required=True, help="the target's folder (its embedding table)")
    ap.add_argument("--ttt-steps", type=positive_int, default=3)
    ap.add_argument("--max-tokens", type=positive_int, default=8192,
                    help="tokens per batch (at least the longest sample)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    out_path = writable_json(a.json)
    ds = open_features(a.features, a.drafter, a.max_tokens)
    steps = [binned(c, p) for c, p in collect(ds, a.drafter, a.target, a.ttt_steps, a.max_tokens)]
    print(f"{len(ds)} samples of {a.features}; drafter {a.drafter}")
    print("TTT step | target top-1 prob | rows share | drafter agreement | share of misses")
    for j, bins in enumerate(steps):
        for b in bins:
            agree = "-" if b["agreement"] is None else f"{b['agreement']:.3f}"
            print(f"{j} | [{b['bin'][0]:.1f}, {b['bin'][1]:.1f}) | {b['share']:.3f} | {agree} | {b['miss_share']:.3f}")
    if out_path:
        out_path.write_text(json.dumps({"features": str(a.features), "drafter": str(a.drafter), "target": str(a.target),
                                        "ttt_steps": a.ttt_steps, "steps": steps}, indent=2))
    return steps


if __name__ == "__main__":
    from eagle3.cli import run_tool

    run_tool(main)
