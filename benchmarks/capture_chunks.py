"""Extraction's features against serving's: one full-sequence forward vs verify-pass-shaped chunks.

    python benchmarks/capture_chunks.py --prompts 16 --max-new-tokens 64 --dtype bfloat16

Extraction captures the aux hidden states with one forward over the whole sequence;
a server computes them in a prefill and then verify passes of ``num_draft_tokens``
tokens over a KV cache (:func:`eagle3.study.drift.chunked_states`). On the target's own
greedy replies to held-out ShareGPT prompts, per aux layer: cosine and relative L2 of
the chunked states against the full forward's, and the target's top-1 next-token
agreement, on reply positions (what a drafter is trained and scored on). Rows: chunks of
4 (a 3/1/4 verify pass) and of 1 (decode steps); a float32 row shows the arithmetic
floor. Prints a table; writes ``--out`` JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> dict:
    from hydra import compose, initialize_config_dir

    from eagle3.cli import to_typed
    from eagle3.config import DataConfig
    from eagle3.io import write_json_atomic
    from eagle3.prompts import load_conversations
    from eagle3.study.drift import (Deployment, build_sequences, chunked_states, first_user_turns, forward_states,
                                    load_deployment, scope_masks)
    from eagle3.study.metrics import PairAccumulator
    from eagle3.study.report import format_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-int4")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--chunks", nargs="+", type=int, default=[4, 1])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--out", default="data/study/capture-chunks.json")
    args = ap.parse_args(argv)
    t0 = time.time()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        model_cfg = to_typed(compose("extract", [f"model={args.model}", "engine=hf"])).model
    ds = load_conversations(DataConfig(name="sharegpt", source="sharegpt")).filter(lambda r: r["split"] == "test")
    prompts = first_user_turns(ds["messages"], args.prompts)
    result = {"model": args.model, "pairs": {}, "prompts": len(prompts)}
    seqs = None
    for dtype in args.dtypes:
        model, tok, info = load_deployment(Deployment(dtype, model_cfg, dtype), ROOT / "data" / "models")
        result["aux_layer_ids"] = info.aux_layer_ids
        if seqs is None:  # the replies of the first dtype, scored by every row
            seqs = build_sequences(model, tok, prompts, args.max_new_tokens, args.max_prompt_tokens)
        acc = {c: PairAccumulator(list(range(info.num_layers + 1))) for c in args.chunks}
        for s in seqs:
            full = forward_states(model, s["input_ids"])
            mask = scope_masks(len(s["input_ids"]), s["prompt_len"])["reply"]
            for c, pa in acc.items():
                part = chunked_states(model, s["input_ids"], s["prompt_len"], c)
                pa.add(full[0], part[0], full[1], part[1], mask)
        for c, pa in acc.items():
            result["pairs"][f"full:chunks of {c} ({dtype})"] = {"reply": pa.summary()}
    result["seconds"] = round(time.time() - t0, 1)
    print(f"\n[reply positions; {len(seqs)} sequences of {args.model}; full forward vs prefill + chunks]")
    print(format_table(result, "reply"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(args.out), result)
    print(f"\nwrote {args.out} ({result['seconds']} s)")
    return result


if __name__ == "__main__":
    main()
