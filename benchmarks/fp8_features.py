"""What storing aux hidden states as FP8 (``capture.aux_dtype=float8_e4m3fn``) costs a drafter.

Reads a features folder written in bfloat16 and, for every token of it, compares the stored
aux states with their FP8 round trip (:func:`eagle3.features.quantize_aux`, one scale per
token and aux layer): cosine and relative L2 error per aux layer. With ``--drafter`` (an
SGLang-format export) and ``--target`` (the folder of the target it drafts for, for the
embedding table), it then runs the drafter's training-time-test unroll over the same
samples twice, fed the bfloat16 states and their FP8 round trip, and prints the validation
figures training reports (top-1 agreement per TTT step, simulated and serving-replay tau)
for both. Training on FP8-stored features
feeds the drafter exactly the second kind of input; serving feeds it the first.

    python benchmarks/fp8_features.py --features data/features/smollm2-135m-int4/sharegpt \\
        --drafter <drafter>/export/sglang --target data/models/<target folder>

CPU is enough (float32 compute). Prints a table; ``--json`` writes the figures.
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


def fidelity(ds) -> list[dict]:
    """Per aux layer: mean and minimum cosine, and the relative L2 error of the FP8 round trip
    over every token of ``ds`` (a :class:`eagle3.features.FeatureDataset`)."""
    from eagle3.features import dequantize_aux, quantize_aux

    cos, err, ref = [], [], []
    for i in range(len(ds)):
        x = ds[i]["aux_hidden_states"].float()  # [T, 3, H]
        y = dequantize_aux(*quantize_aux(x)).float()
        cos.append(torch.nn.functional.cosine_similarity(x, y, dim=-1))  # [T, 3]
        err.append((x - y).pow(2).sum(-1))
        ref.append(x.pow(2).sum(-1))
    c, e, r = torch.cat(cos), torch.cat(err).sum(0), torch.cat(ref).sum(0)
    return [{"cos_mean": float(c[:, j].mean()), "cos_min": float(c[:, j].min()),
             "rel_l2": float((e[j] / r[j]).sqrt())} for j in range(c.shape[1])]


def drafter_figures(ds, export: str, target: str, ttt_steps: int, fp8: bool, max_tokens: int) -> dict:
    """The validation figures of the export over ``ds`` (:func:`eagle3.train.validation.evaluate`)
    with the aux states as stored or through the FP8 round trip."""
    from accelerate import Accelerator

    from eagle3.features import dequantize_aux, quantize_aux
    from eagle3.study.drafter_inputs import load_drafter
    from eagle3.train.data import length_bucketed_batches, make_loader
    from eagle3.train.ttt import TTTCollator, TTTModel, target_to_draft_index
    from eagle3.train.validation import evaluate

    drafter, _ = load_drafter(export, target)
    collator = TTTCollator(target_to_draft_index(drafter.d2t, drafter.arch.vocab_size), ttt_steps, max_tokens,
                           pad_multiple=16)

    class Source(torch.utils.data.Dataset):
        def __len__(self):
            return len(ds)

        def __getitem__(self, i):
            s = dict(ds[i])
            if fp8:
                s["aux_hidden_states"] = dequantize_aux(*quantize_aux(s["aux_hidden_states"]))
            return s

    batches = length_bucketed_batches(ds.lengths, max_tokens, seed=0, epoch=0)
    return evaluate(Accelerator(cpu=True), TTTModel(drafter, ttt_steps, 1.0),
                    make_loader(Source(), batches, collator, 0, False), 1.0)


def main(argv=None) -> dict:
    from eagle3.study.drafter_inputs import open_features, positive_int, writable_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--features", required=True)
    ap.add_argument("--drafter", default=None, help="an SGLang-format export (config.json, model.safetensors)")
    ap.add_argument("--target", default=None, help="the target's folder (model.safetensors with the embedding table)")
    ap.add_argument("--ttt-steps", type=positive_int, default=3)
    ap.add_argument("--max-tokens", type=positive_int, default=2048, help="tokens per batch (at least the longest sample)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if bool(a.drafter) != bool(a.target):
        raise Eagle3Error("--drafter and --target go together: pass both (the drafter's figures) or neither")
    out_path = writable_json(a.json)
    ds = open_features(a.features, a.drafter, a.max_tokens)
    out: dict = {"features": a.features, "samples": len(ds), "tokens": ds.num_tokens, "fidelity": fidelity(ds)}
    print(f"{a.features}: {len(ds)} samples, {ds.num_tokens} tokens; FP8 round trip of the aux states")
    for j, f in enumerate(out["fidelity"]):
        print(f"  aux layer {j}: cosine mean {f['cos_mean']:.6f} min {f['cos_min']:.6f}, relative L2 error {f['rel_l2']:.4f}")
    if a.drafter and a.target:
        for kind in ("bfloat16", "fp8"):
            m = drafter_figures(ds, a.drafter, a.target, a.ttt_steps, kind == "fp8", a.max_tokens)
            out[kind] = m
            print(f"  drafter on {kind:8s} states: top-1 per TTT step {' / '.join(f'{x:.4f}' for x in m['step_acc'])}, "
                  f"simulated tau {m['tau']:.4f}, replay tau {m['replay_tau']:.4f}")
    if out_path:
        out_path.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    from eagle3.cli import run_tool

    run_tool(main)
