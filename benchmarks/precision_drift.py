"""Feature drift between deployments of the target at different precisions (docs/precision-study.md).

    python benchmarks/precision_drift.py --prompts 16 --max-new-tokens 64 --compute-dtype float32
    python benchmarks/precision_drift.py --vllm-url http://127.0.0.1:8200 --vllm-compare int4
    python benchmarks/precision_drift.py --deployments bf16=smollm2-135m-bf16 rtn=smollm2-135m-int4-rtn \
        gptq=smollm2-135m-int4 --pairs bf16:rtn bf16:gptq --loops 128   # which INT4 build to serve

Deployments are ``label=<conf/model name>[@<compute dtype>]`` (default: ``bf16`` the BF16
parent, ``int4`` the W4A16 build as the hf engine loads it, i.e. decompressed to
``scale * int4`` dense weights, and ``dequant`` the ``-int4-dequant`` folder); pairs are
``a:b`` with ``a`` the reference. The token sequences (first user turn of ShareGPT
prompts, then a greedy reply by ``--reply-from``) are built once and saved beside the
JSON, so every run scores the same tokens. With ``--vllm-url`` (a vLLM server already
serving the W4A16 folder) or ``--vllm-launch <vLLM python>`` (starts one on
``--vllm-port``), the served INT4 kernel's top-1 choices (``prompt_logprobs``) are
compared with the ``--vllm-compare`` deployment. Prints a table, writes ``--out`` JSON
and the cosine-per-layer PNG ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_DEPLOYMENTS = ["bf16=smollm2-135m-bf16", "int4=smollm2-135m-int4", "dequant=smollm2-135m-int4-dequant"]
DEFAULT_PAIRS = ["bf16:int4", "bf16:dequant", "int4:dequant"]


def _model_cfg(name: str):
    from hydra import compose, initialize_config_dir

    from eagle3.cli import to_typed

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return to_typed(compose("extract", [f"model={name}", "engine=hf"])).model


def _deployments(specs: list[str], compute_dtype: str):
    from eagle3.study.drift import Deployment

    out = []
    for spec in specs:
        label, _, rest = spec.partition("=")
        name, _, dtype = rest.partition("@")
        out.append(Deployment(label=label, model=_model_cfg(name), compute_dtype=dtype or compute_dtype))
    return out


def _sequences(args, deps, models, toks, path: Path) -> list[dict]:
    from eagle3.config import DataConfig
    from eagle3.prompts import load_conversations
    from eagle3.study.drift import build_sequences, first_user_turns

    key = {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
           "reply_from": next(d.model.name for d in deps if d.label == args.reply_from), "data": args.data}
    if path.is_file():
        saved = json.loads(path.read_text())
        if {k: v for k, v in saved.get("key", {}).items() if k != "prompts"} == {k: v for k, v in key.items() if k != "prompts"} \
                and saved["key"]["prompts"] >= args.prompts:
            return saved["sequences"][: args.prompts]  # greedy batches of 8: a prefix of a larger run is the same
    ds = load_conversations(DataConfig(name=args.data, source=args.data))
    ds = ds.filter(lambda r: r["split"] == "test")  # never a training prompt
    prompts = first_user_turns(ds["messages"], args.prompts)
    seqs = build_sequences(models[args.reply_from], toks[args.reply_from], prompts, args.max_new_tokens,
                           args.max_prompt_tokens)
    from eagle3.io import write_json_atomic

    write_json_atomic(path, {"key": key, "sequences": seqs})
    return seqs


def _served(args, seqs, top1) -> dict:
    from eagle3.study.served import compare_top1, served_prompt_logprobs, top1_from_prompt_logprobs

    server = None
    url = args.vllm_url
    if args.vllm_launch:
        from eagle3.config import VLLMEngineConfig
        from eagle3.engines.vllm.launch import launch_vllm
        from eagle3.target import resolve_target

        info = resolve_target(_model_cfg(args.vllm_model), "data/models")
        ecfg = VLLMEngineConfig(python=args.vllm_launch, port=args.vllm_port, max_num_seqs=16, enforce_eager=True)
        server, _, _ = launch_vllm(ecfg, model_path=info.path, dtype="bfloat16", seed=0, port=args.vllm_port,
                                   run_dir=Path(args.out).parent, name="precision-drift")
        url = server.url
    try:
        served = [top1_from_prompt_logprobs(served_prompt_logprobs(url, s["input_ids"])) for s in seqs]
    finally:
        if server is not None:
            server.stop()
    lens = [s["prompt_len"] for s in seqs]
    return {f"vllm-{args.vllm_model}:{label}": compare_top1(served, top1[label], lens)
            for label in args.vllm_compare}


def _own_replies(args, models, toks) -> dict:
    from eagle3.config import DataConfig
    from eagle3.prompts import load_conversations
    from eagle3.study.drift import first_user_turns, own_reply_diversity

    ds = load_conversations(DataConfig(name=args.data, source=args.data)).filter(lambda r: r["split"] == "test")
    prompts = first_user_turns(ds["messages"], args.prompts)
    return {label: own_reply_diversity(models[label], toks[label], prompts, args.loops, args.max_prompt_tokens)
            for label in models}


def main(argv=None) -> dict:
    import eagle3  # noqa: F401
    from eagle3.io import write_json_atomic
    from eagle3.study.drift import load_deployment, measure_drift
    from eagle3.study.report import format_table, plot_cosine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deployments", nargs="+", default=DEFAULT_DEPLOYMENTS)
    ap.add_argument("--pairs", nargs="+", default=DEFAULT_PAIRS)
    ap.add_argument("--compute-dtype", default="float32", help="float32 | bfloat16 (a deployment's @dtype wins)")
    ap.add_argument("--data", default="sharegpt")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--reply-from", default="bf16", help="the deployment label that writes the replies")
    ap.add_argument("--vllm-url", default=None)
    ap.add_argument("--vllm-launch", default=None, help="the vLLM environment's python: start a server here")
    ap.add_argument("--vllm-port", type=int, default=8200)
    ap.add_argument("--vllm-model", default="smollm2-135m-int4")
    ap.add_argument("--vllm-compare", nargs="+", default=["int4"], help="deployment labels to score the server against")
    ap.add_argument("--loops", type=int, default=0, metavar="N",
                    help="also let every deployment answer the prompts itself (N new tokens) and report its loop rate")
    ap.add_argument("--out", default="data/study/precision-drift.json")
    ap.add_argument("--plot", default="docs/img/precision-cosine.png")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    t0 = time.time()
    deps = _deployments(args.deployments, args.compute_dtype)
    loaded = {d.label: load_deployment(d, "data/models") for d in deps}
    models = {k: v[0] for k, v in loaded.items()}
    toks = {k: v[1] for k, v in loaded.items()}
    info = loaded[deps[0].label][2]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    seqs = _sequences(args, deps, models, toks, out.with_name(out.stem + "-sequences.json"))
    result = {
        "target": info.name, "aux_layer_ids": info.aux_layer_ids, "compute_dtype": args.compute_dtype,
        "deployments": {d.label: {"model": d.model.name, "compute_dtype": d.compute_dtype,
                                  "content_hash": loaded[d.label][2].content_hash} for d in deps},
        "sequences": len(seqs), "tokens": sum(len(s["input_ids"]) for s in seqs),
        "reply_tokens": sum(len(s["input_ids"]) - s["prompt_len"] for s in seqs),
    }
    top1: dict = {}
    result["pairs"] = measure_drift(models, seqs, [tuple(p.split(":")) for p in args.pairs], info.num_layers + 1, top1)
    if args.vllm_url or args.vllm_launch:
        result["served"] = _served(args, seqs, top1)
    if args.loops:
        result["own_replies"] = _own_replies(args, models, toks)
    result["seconds"] = round(time.time() - t0, 1)
    write_json_atomic(out, result)
    plot_cosine(result, args.plot)
    for scope in ("reply", "all"):
        print(f"\n[{scope} positions; {args.compute_dtype} compute; {len(seqs)} sequences]")
        print(format_table(result, scope))
    for label, d in (result.get("own_replies") or {}).items():
        print(f"own replies of {label}: {d['looping_outputs']}/{d['replies']} loop ({d['loop_fraction']:.0%}), "
              f"distinct-2 {d['distinct_2']:.3f}, {d['ended']:.0%} ended, {d['reply_tokens']} tokens")
    print(f"\nwrote {out} and {args.plot} ({result['seconds']} s)")
    return result


if __name__ == "__main__":
    main()
