"""How many sequential turn batches multi-turn regeneration runs, in source order and by turn count.

    python benchmarks/turn_windows.py --limit 4096 --window 280 --max-turns null

Regeneration is lockstep by turn inside a generation window: turn ``r`` is one batched
``generate`` over the window's conversations that have an ``r``-th user turn, and each
costs ``max_new_tokens`` decode steps however few conversations it holds. So the number of
sequential turn batches, the sum over windows of the window's largest turn count, sets
the decode steps a worker runs. This counts them for the ShareGPT conversations that
extraction selects, with the plan in source order and ordered by turn count
(:func:`eagle3.extract.order.turn_order`, what extraction does when it regenerates more
than one turn), and prints the ratio. It counts batches, not seconds: on one H200 the
every-turn extraction in source order ran about 4 times slower per captured token than
a two-turn one (``docs/performance.md``). Turns cut by ``capture.max_length`` are not
modelled (both orders would lose the same ones).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def turn_batches(turns: list[int], window: int) -> int:
    """Sequential turn batches of a plan cut into windows of ``window`` conversations."""
    return sum(max(turns[i : i + window]) for i in range(0, len(turns), window))


def main(argv=None) -> dict:
    from eagle3.config import DataConfig
    from eagle3.extract.order import turn_order
    from eagle3.prompts import load_conversations, select_for_extraction

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=4096, help="conversations selected (data.limit)")
    ap.add_argument("--offset", type=int, default=0, help="data.offset")
    ap.add_argument("--window", type=int, default=280, help="conversations per generation window")
    ap.add_argument("--max-turns", default="null", help="capture.max_turns (null = every turn)")
    a = ap.parse_args(argv)
    cap = None if a.max_turns in ("null", "None", "") else int(a.max_turns)
    ds = load_conversations(DataConfig(name="sharegpt", source="sharegpt"))
    msgs = list(select_for_extraction(ds, ["train", "validation"], a.limit, a.offset)["messages"])
    turns = [min(sum(1 for m in c if m["role"] == "user"), cap or 10**9) for c in msgs]
    source = turn_batches(turns, a.window)
    by_turns = turn_batches([turns[i] for i in turn_order(msgs, cap)], a.window)
    out = {"conversations": len(turns), "window": a.window, "max_turns": cap, "answered_turns": sum(turns),
           "turn_batches_source_order": source, "turn_batches_by_turn_count": by_turns, "ratio": source / by_turns}
    print(f"{len(turns)} conversations, {sum(turns)} turns to answer, windows of {a.window}, max_turns {cap}: "
          f"{source} sequential turn batches in source order, {by_turns} ordered by turn count "
          f"({source / by_turns:.2f}x fewer)")
    return out


if __name__ == "__main__":
    main()
