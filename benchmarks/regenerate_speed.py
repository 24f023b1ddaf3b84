"""Batched greedy regeneration: the hf engine's generation path against transformers' generate,
eager (dynamic cache) and compiled (static cache), in one process, interleaved.

    python benchmarks/regenerate_speed.py --device cuda --batch-size 256 --prompt-len 256 --new-tokens 128
    python benchmarks/regenerate_speed.py --device cpu --layers 4 --batch-size 8 --prompt-len 64 --new-tokens 16

Target: a Llama of SmolLM2-135M's shape with random weights (speed does not depend on
them) or ``--model-dir``. The batch is left-padded random prompts, a quarter of the rows
at half length; every method generates exactly ``--new-tokens`` tokens per row.
Methods: ``hf_eager`` (``model.generate``, DynamicCache: what the engine did before),
``hf_static`` (``model.generate(cache_implementation="static")``, which transformers
compiles with CUDA graphs on CUDA: the fastest plain library path), ``engine`` (the
engine's own call: :func:`eagle3.engines.hf.engine.generation_config` and
:func:`~eagle3.engines.hf.engine.left_pad` with the device's default cache), ``graphs``
(:class:`eagle3.engines.hf.batch_decode.BatchDecoder`, ``engine.generate_cache=graphs``:
the decode step replayed from a CUDA graph, nothing compiled) and, with ``--compile-layers``,
``graphs_compiled`` (the same on a copy of the target whose decoder layers are compiled:
``engine.compile_layers=true``, :mod:`eagle3.spec.compiled`); ``*_nocudnn`` run the same
under an SDPA backend list without cuDNN attention (flash, memory-efficient, math), to
measure what the explicit mask costs cuDNN (``docs/performance.md``, compiled layers);
``graphs_compiled_sdpa_eager`` compiles the layers but keeps the SDPA call eager between the
compiled pieces (``compile_decoder_layers(..., attention_in_graph=False)``); ``graphs_gqa`` and
``graphs_compiled_gqa`` are ``graphs`` and ``graphs_compiled_sdpa_eager`` with the folded GQA
attention (:mod:`eagle3.gqa`: no ``repeat_kv`` copies of the cache). The first
repeat compiles and is not reported. Prints generated tokens/s (median over repeats,
min-max), the ratio to ``hf_static`` and how many rows equal ``hf_eager``'s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.spec_decode_speed import _target, target_args  # noqa: E402  (the same random SmolLM2-shaped target)


def main(argv=None) -> dict:
    from eagle3.engines.hf.engine import STATIC_WIDTH_MULTIPLE, generation_config, left_pad
    from eagle3.spec import synchronize

    ap = target_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=4, help="including the first (warm-up) repeat")
    ap.add_argument("--json", default=None, help="write the printed figures to this file")
    ap.add_argument("--methods", default=None,
                    help="comma-separated subset (default: all; hf_static and hf_eager are always timed, "
                         "the ratio's reference and the rows' reference)")
    ap.add_argument("--compile-layers", action="store_true",
                    help="also graphs_compiled: the graphs decoder on a copy with inductor-compiled layers")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if a.device == "auto" else a.device))
    model = _target(a, device, getattr(torch, a.dtype))
    B, T, N = a.batch_size, a.prompt_len, a.new_tokens
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    seqs = [torch.randint(3, V, (T // 2 if r < B // 4 else T,), generator=g).tolist() for r in range(B)]
    sampling = SimpleNamespace(temperature=0.0, top_p=1.0, max_new_tokens=N)
    engine_static = device.type == "cuda"

    def call(static: bool, multiple: int):
        ids, mask = left_pad(seqs, pad_id=0, multiple=multiple)
        cfg = generation_config(sampling, stop_ids=[], pad_id=0, static=static)
        cfg.min_new_tokens = N
        synchronize(device)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=cfg)
        synchronize(device)
        return out[:, ids.shape[1]:].cpu(), B * N / (time.perf_counter() - t)

    from eagle3.engines.hf.batch_decode import SLOT_MULTIPLE, BatchDecoder

    capacity = B * (-(-(T + N) // SLOT_MULTIPLE) * SLOT_MULTIPLE)

    def graphs_method(compiled: bool, no_cudnn: bool, attention_in_graph: bool = True, fold: bool = False):
        """The batched graph decoder, on the target or on a copy whose layers are compiled;
        ``no_cudnn``: every call (graph capture and compilation included) under an SDPA
        backend list without cuDNN attention, which takes the explicit mask as a dense bias;
        ``fold``: on a copy attending with the folded GQA attention (eagle3.gqa)."""
        import contextlib
        import copy

        from torch.nn.attention import SDPBackend, sdpa_kernel

        target = model
        if fold:
            from eagle3.gqa import use_gqa_sdpa

            target = copy.deepcopy(model)
            use_gqa_sdpa(target)
        if compiled:
            from eagle3.spec.compiled import compile_decoder_layers

            target = copy.deepcopy(target)
            compile_decoder_layers(target, attention_in_graph=attention_in_graph)
        dec = BatchDecoder(target, capacity=capacity)
        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

        def run():
            ctx = sdpa_kernel(backends) if no_cudnn else contextlib.nullcontext()
            synchronize(device)
            t = time.perf_counter()
            with ctx:
                rows = dec.generate(seqs, N, stop_ids=[], pad_id=0)
            synchronize(device)
            return torch.tensor(rows), B * N / (time.perf_counter() - t)

        return run

    methods = {"hf_eager": lambda: call(False, 1), "hf_static": lambda: call(True, 1),
               "engine": lambda: call(engine_static, STATIC_WIDTH_MULTIPLE if engine_static else 1),
               "graphs": graphs_method(False, False), "graphs_nocudnn": graphs_method(False, True),
               "graphs_gqa": graphs_method(False, False, fold=True)}
    if a.compile_layers:  # the same decoder on copies of the target whose layers are compiled
        methods["graphs_compiled"] = graphs_method(True, False)
        methods["graphs_compiled_nocudnn"] = graphs_method(True, True)
        methods["graphs_compiled_sdpa_eager"] = graphs_method(True, False, attention_in_graph=False)
        methods["graphs_compiled_gqa"] = graphs_method(True, False, attention_in_graph=False, fold=True)
    names = list(methods)
    if a.methods:
        keep = {"hf_eager", "hf_static", *a.methods.split(",")}
        unknown = keep - set(methods)
        if unknown:
            raise SystemExit(f"unknown --methods {sorted(unknown)}; choose from {sorted(methods)}")
        names = [m for m in names if m in keep]
    rates: dict[str, list[float]] = {m: [] for m in names}
    tokens: dict[str, torch.Tensor] = {}
    for r in range(a.repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for m in order:
            tokens[m], rate = methods[m]()
            if r:
                rates[m].append(rate)
        print(f"repeat {r + 1}/{a.repeats} done", file=sys.stderr)
    ref = statistics.median(rates["hf_static"])
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "batch": B, "prompt_len": T, "new_tokens": N, "engine_cache": "static" if engine_static else "dynamic",
           "methods": {}}
    print(f"\n{out['device']}, {a.dtype}, {model.config.num_hidden_layers} layers, batch {B} x {T} prompt tokens "
          f"(a quarter at {T // 2}), {N} new tokens, {a.repeats - 1} timed repeats; engine cache {out['engine_cache']}")
    for m in names:
        med = statistics.median(rates[m])
        same = int((tokens[m] == tokens["hf_eager"]).all(dim=1).sum())
        out["methods"][m] = {"tokens_per_s": med, "min": min(rates[m]), "max": max(rates[m]),
                             "ratio_to_hf_static": med / ref, "rows_equal_to_hf_eager": same}
        print(f"  {m:10s} {med:10.1f} tok/s  (min {min(rates[m]):.1f}, max {max(rates[m]):.1f})  "
              f"x{med / ref:.2f} of hf_static  rows equal to hf_eager {same}/{B}")
    if a.json:
        import json

        Path(a.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
