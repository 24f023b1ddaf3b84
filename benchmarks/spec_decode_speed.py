"""Batch-1 decoding speed: transformers' generate (eager and static-cache compiled) against this
project's plain and speculative decoding, dynamic and static caches, in one process, interleaved.

    python benchmarks/spec_decode_speed.py --device cuda --prompt-len 256 --new-tokens 128 --repeats 5
    python benchmarks/spec_decode_speed.py --device cpu --layers 4 --prompt-len 64 --new-tokens 32   # CI size

The target is a Llama of SmolLM2-135M's shape (30 layers, 576 wide, GQA 9/3, vocabulary
49,152) with random weights unless ``--model-dir`` names a local transformers folder:
speed does not depend on the weights. The drafter is an EAGLE-3 drafter of the target's
width with a ``--draft-vocab`` draft vocabulary, random weights (it accepts ~nothing), and
the same drafter *forced* (:class:`eagle3.spec.ForcedProposer`): every draft accepted at
the drafter's real cost, so those rows time rounds at tau = num_steps + 1.

Every method decodes the same random prompts for exactly ``--new-tokens`` tokens (no stop
token). Within a repeat, the methods run prompt by prompt in an order rotated every
prompt, so machine load falls on all alike; the first repeat is a warm-up (compilation,
graph capture) and is not reported. Printed per method: median generated tokens/s over
(repeat, prompt) runs with the 95% bootstrap interval of the median; for plain decoding
the decode step in ms (after the prefill); for speculative decoding tau and the round
(draft + verify + accept + roll back) in ms and in baseline decode steps of the static
runner; and speed-ups over ``hf_static`` (transformers' ``generate`` with
``cache_implementation="static"``, which transformers compiles on CUDA), as the median of
per-run ratios with its 95% bootstrap interval. ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                    rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)


def target_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The target options shared by the benchmarks that build :func:`_target`."""
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model-dir", default=None, help="a local transformers folder (default: random SmolLM2-135M shape)")
    ap.add_argument("--layers", type=int, default=None, help="target layers (random target only; default 30)")
    return ap


def _target(args, device, dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model_dir:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype, attn_implementation="sdpa")
    else:
        torch.manual_seed(0)
        cfg = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": args.layers or SMOLLM2_135M["num_hidden_layers"]})
        cfg._attn_implementation = "sdpa"
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.to(device).eval()


def _drafter(target, draft_vocab: int, device, dtype, layers: int = 1):
    from eagle3.model.drafter import DrafterArch, Eagle3Drafter

    c = target.config
    heads = c.num_attention_heads
    arch = DrafterArch(hidden_size=c.hidden_size, num_attention_heads=heads,
                       num_key_value_heads=c.num_key_value_heads,
                       head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                       intermediate_size=c.intermediate_size, num_layers=layers, target_hidden_size=c.hidden_size,
                       vocab_size=c.vocab_size, draft_vocab_size=min(draft_vocab, c.vocab_size))
    torch.manual_seed(1)
    d = Eagle3Drafter(arch)
    d.init_from_target(target.get_input_embeddings().weight.detach().float().cpu())
    return d.to(device=device, dtype=dtype).eval()


def _draft_vocab_with(drafter, tokens: set[int]) -> None:
    """Make the draft vocabulary hold ``tokens`` (then the lowest other ids), sorted, as
    ``d2t`` offsets; the forced drafter can then draft every reference token."""
    V, Vd = drafter.arch.vocab_size, drafter.arch.draft_vocab_size
    keep = sorted(tokens)[:Vd]
    rest = [i for i in range(V) if i not in set(keep)][: Vd - len(keep)]
    ids = torch.tensor(sorted(keep + rest), dtype=torch.long)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    drafter.set_draft_vocab((ids - torch.arange(Vd)).to(drafter.d2t.device), t2d.to(drafter.t2d.device))


def _aux_ids(layers: int) -> list[int]:
    return [2, layers // 2, layers - 3] if layers >= 6 else [1, max(1, layers // 2), layers]


def _bootstrap_median(values: list[float]):
    """95% percentile-bootstrap interval of the median (the served evaluation's estimator)."""
    from eagle3.evaluate.vllm.results import bootstrap_median_ci

    ci = bootstrap_median_ci(values, seed=0)
    return list(ci) if ci else None


def main(argv=None) -> dict:
    import eagle3  # noqa: F401
    from eagle3.spec import (
        Eagle3Proposer, ForcedProposer, SpecSettings, SpeculativeDecoder, StaticEagle3Proposer,
        StaticTargetRunner, TargetRunner, synchronize, target_generate,
    )

    ap = target_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--drafter-layers", type=int, default=1, help="the drafter's decoder layers (drafter.num_layers)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=4, help="including the first (warm-up) repeat")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--methods", default="hf_eager,hf_static,base_dynamic,base_static,spec_dynamic,spec_static,"
                                          "forced_dynamic,forced_static",
                    help="also base_static_fullspan, spec_static_fullspan, forced_static_fullspan and, with "
                         "--compile-layers, base_static_compiled, spec_static_compiled, forced_static_compiled "
                         "(--gqa-fold: *_gqa, *_compiled_gqa)")
    ap.add_argument("--compile-layers", action="store_true",
                    help="build the *_compiled methods: static caches (and graphs) on copies of the target and the "
                         "drafter whose decoder layers are inductor-compiled (engine.compile_layers=true)")
    ap.add_argument("--gqa-fold", action="store_true",
                    help="build the *_gqa methods (and *_compiled_gqa with --compile-layers): target and drafter "
                         "attending with the query heads folded into the query axis (eagle3.gqa)")
    ap.add_argument("--no-graphs", action="store_true", help="static caches without CUDA graphs")
    ap.add_argument("--cache-slots", type=int, default=None,
                    help="KV slots of the static caches (default: what the prompt, new tokens and one round "
                         "need; evaluation sizes them for max_prompt_tokens=2048: 2183)")
    ap.add_argument("--min-span", type=int, default=256,
                    help="smallest attention span of the static caches (SlotCache.span_for); the *_fullspan "
                         "methods attend over all --cache-slots in every call")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = getattr(torch, args.dtype)
    target = _target(args, device, dtype)
    L = target.config.num_hidden_layers
    aux = _aux_ids(L)
    drafter = _drafter(target, args.draft_vocab, device, dtype, args.drafter_layers)
    s, _ = SpecSettings.make(args.steps, args.topk, args.draft_tokens, max_new_tokens=args.new_tokens)
    max_len = args.cache_slots or args.prompt_len + args.new_tokens + s.num_draft_tokens + s.num_steps * s.topk
    graphs = None if not args.no_graphs else False
    g = torch.Generator().manual_seed(0)
    V = target.config.vocab_size
    prompts = [torch.randint(0, V, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]

    dyn_runner = TargetRunner(target, aux)
    sta_runner = StaticTargetRunner(target, aux, max_len=max_len, cuda_graphs=graphs, min_span=args.min_span)
    full_runner = StaticTargetRunner(target, aux, max_len=max_len, cuda_graphs=graphs, min_span=None)
    refs = [list(p) + target_generate(dyn_runner, p, s).tokens for p in prompts]  # greedy continuations
    _draft_vocab_with(drafter, {t for r in refs for t in r[args.prompt_len:]})  # so the forced drafts can be drafted
    dyn_prop = Eagle3Proposer(drafter, aux)
    sta_prop = StaticEagle3Proposer(drafter, aux, max_len=max_len, cuda_graphs=graphs, min_span=args.min_span)
    full_prop = StaticEagle3Proposer(drafter, aux, max_len=max_len, cuda_graphs=graphs, min_span=None)
    def twins(compiled: bool, fold: bool):
        """Static runner and proposer on copies of the target and the drafter, their layers compiled
        (``compiled``) and attending with the folded GQA attention (``fold``, eagle3.gqa)."""
        import copy

        from eagle3.gqa import use_gqa_sdpa
        from eagle3.gqa import fold_drafter_attention
        from eagle3.spec.compiled import compile_decoder_layers

        twin, twin_drafter = copy.deepcopy(target), copy.deepcopy(drafter)
        if fold:
            use_gqa_sdpa(twin)
            fold_drafter_attention(twin_drafter)
        if compiled:
            compile_decoder_layers(twin)
            compile_decoder_layers(twin_drafter)
        return (StaticTargetRunner(twin, aux, max_len=max_len, cuda_graphs=graphs, min_span=args.min_span),
                StaticEagle3Proposer(twin_drafter, aux, max_len=max_len, cuda_graphs=graphs, min_span=args.min_span))

    variants = {}  # method suffix -> (runner, proposer)
    if args.gqa_fold:
        variants["_gqa"] = twins(False, True)
    if args.compile_layers:
        variants["_compiled"] = twins(True, False)
        if args.gqa_fold:
            variants["_compiled_gqa"] = twins(True, True)

    def hf(p, static):
        from transformers import GenerationConfig

        ids = torch.tensor([p], device=device)
        cfg = GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0,
                               cache_implementation="static" if static else None)
        synchronize(device)
        t0 = time.perf_counter()
        out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        synchronize(device)
        return {"seconds": time.perf_counter() - t0, "tokens": out[0, len(p):].tolist()}

    def plain(runner, p):
        r = target_generate(runner, p, s)
        return {"seconds": r.seconds, "prefill": r.prefill_seconds, "tokens": r.tokens}

    def spec(runner, prop, i, forced):
        proposer = ForcedProposer(prop, refs[i]) if forced else prop
        r = SpeculativeDecoder(runner, proposer, s).generate(prompts[i])
        return {"seconds": r.seconds, "prefill": r.prefill_seconds, "tokens": r.tokens,
                "passes": r.verify_passes, "emitted": r.emitted}

    table = {
        "hf_eager": lambda i: hf(prompts[i], False),
        "hf_static": lambda i: hf(prompts[i], True),
        "base_dynamic": lambda i: plain(dyn_runner, prompts[i]),
        "base_static": lambda i: plain(sta_runner, prompts[i]),
        "spec_dynamic": lambda i: spec(dyn_runner, dyn_prop, i, False),
        "spec_static": lambda i: spec(sta_runner, sta_prop, i, False),
        "forced_dynamic": lambda i: spec(dyn_runner, dyn_prop, i, True),
        "forced_static": lambda i: spec(sta_runner, sta_prop, i, True),
        "base_static_fullspan": lambda i: plain(full_runner, prompts[i]),
        "spec_static_fullspan": lambda i: spec(full_runner, full_prop, i, False),
        "forced_static_fullspan": lambda i: spec(full_runner, full_prop, i, True),
    }
    for suffix, (run_, prop_) in variants.items():
        table.update({
            f"base_static{suffix}": lambda i, run_=run_: plain(run_, prompts[i]),
            f"spec_static{suffix}": lambda i, run_=run_, prop_=prop_: spec(run_, prop_, i, False),
            f"forced_static{suffix}": lambda i, run_=run_, prop_=prop_: spec(run_, prop_, i, True),
        })
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in table]
    if unknown:
        raise SystemExit(f"unknown --methods {unknown}; choose from {sorted(table)}")
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    t_start = time.perf_counter()
    for r in range(args.repeats):
        for i in range(len(prompts)):
            k = (r * len(prompts) + i) % len(methods)
            for m in methods[k:] + methods[:k]:
                out = table[m](i)
                out.update(repeat=r, prompt=i)
                if r:  # the first repeat warms up (compiles, captures graphs)
                    runs[m].append(out)
        print(f"repeat {r + 1}/{args.repeats} done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr)

    new = args.new_tokens
    res: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "dtype": args.dtype, "layers": L, "aux_layer_ids": aux,
                 "prompt_len": args.prompt_len, "new_tokens": new, "prompts": len(prompts),
                 "timed_repeats": args.repeats - 1, "draft_vocab": drafter.arch.draft_vocab_size,
                 "settings": [s.num_steps, s.topk, s.num_draft_tokens], "cuda_graphs": sta_runner.cuda_graphs,
                 "cache_slots": max_len, "min_span": args.min_span,
                 "methods": {}}
    def base_step_ms(name):
        xs = runs.get(name) or []
        return statistics.median((x["seconds"] - x["prefill"]) / (new - 1) * 1e3 for x in xs) if xs else None

    suffixes = ("_fullspan", "_compiled_gqa", "_compiled", "_gqa")  # longest match first
    steps_ms = {"": base_step_ms("base_static"), **{k: base_step_ms(f"base_static{k}") for k in suffixes}}
    ref_runs = {(x["repeat"], x["prompt"]): x for x in runs.get("hf_static", [])}
    for m, xs in runs.items():
        if not xs:
            continue
        tps = [new / x["seconds"] for x in xs]
        row = {"tokens_per_s": statistics.median(tps), "tokens_per_s_ci95": _bootstrap_median(tps),
               "same_tokens_as_reference": sum(x["tokens"] == refs[x["prompt"]][args.prompt_len:] for x in xs),
               "runs": len(xs)}
        if "passes" in xs[0]:
            row["tau"] = sum(x["emitted"] for x in xs) / sum(x["passes"] for x in xs)
            row["round_ms"] = statistics.median((x["seconds"] - x["prefill"]) / x["passes"] * 1e3 for x in xs)
            step_ms = steps_ms[next((k for k in suffixes if m.endswith(k)), "")]  # same path's step
            if step_ms:
                row["round_in_base_steps"] = row["round_ms"] / step_ms
        elif "prefill" in xs[0]:
            row["decode_step_ms"] = statistics.median((x["seconds"] - x["prefill"]) / (new - 1) * 1e3 for x in xs)
        if ref_runs and m != "hf_static":
            ratios = [ref_runs[(x["repeat"], x["prompt"])]["seconds"] / x["seconds"] for x in xs]
            row["speedup_vs_hf_static"] = statistics.median(ratios)
            row["speedup_vs_hf_static_ci95"] = _bootstrap_median(ratios)
        res["methods"][m] = row

    print(f"\n{res['device']}, {args.dtype}, {L} layers, prompt {args.prompt_len}, {new} new tokens, "
          f"{len(prompts)} prompts x {args.repeats - 1} timed repeats, {s.num_steps}/{s.topk}/{s.num_draft_tokens}, "
          f"draft vocab {drafter.arch.draft_vocab_size}, CUDA graphs {sta_runner.cuda_graphs}, "
          f"{max_len} cache slots (min span {args.min_span})")
    print(f"{'method':22s} {'tok/s':>9s} {'95% CI':>17s} {'step/round ms':>14s} {'in steps':>9s} {'tau':>5s} "
          f"{'vs hf_static':>13s} {'95% CI':>13s}")
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    for m, row in res["methods"].items():
        ci, sci = row["tokens_per_s_ci95"], row.get("speedup_vs_hf_static_ci95")
        print(f"{m:22s} {row['tokens_per_s']:9.1f} {(f'{ci[0]:.1f}-{ci[1]:.1f}' if ci else '-'):>17s} "
              f"{fmt(row.get('decode_step_ms', row.get('round_ms')), '.2f'):>14s} "
              f"{fmt(row.get('round_in_base_steps'), '.2f'):>9s} {fmt(row.get('tau'), '.2f'):>5s} "
              f"{fmt(row.get('speedup_vs_hf_static'), '.2f'):>13s} "
              f"{(f'{sci[0]:.2f}-{sci[1]:.2f}' if sci else '-'):>13s}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
