"""The evaluate stage: real speculative decoding against the configured target.

``run_evaluate(cfg)``:

1. Opens the drafter export (``drafter_dir``, default
   ``data/drafters/<model>/sharegpt/export/sglang``) the way a server does
   (:func:`eagle3.export.sglang.load_sglang_export`: ``config.json``, ``d2t``, aux ids) and
   compares its ``eagle3_meta.json`` with the configured target: a different content
   hash or quantization gives a loud warning (a drafter trained on BF16 features
   meeting an INT4 deployment accepts little); a different chat template is refused.
2. Loads the benchmarks (:func:`eagle3.prompts.load_benchmark`): gsm8k, humaneval,
   held-out sharegpt (refused if its ids overlap the training manifest), mtbench when
   ``data.mtbench_path`` is set; ``data.limit`` prompts each.
3. ``engine=hf``: for every prompt (every user turn of multi-turn prompts, the history
   carrying the speculative answer), speculative decoding
   (:class:`eagle3.spec.decoder.SpeculativeDecoder`) and the target's own decoding
   (the baseline, same prefill and KV cache code) on the same rendered prompt, both
   timed with device synchronisation at batch 1 after ``warmup_prompts`` untimed
   prompts. At temperature 0 the two token sequences must be equal (lossless check).
   ``engine=sglang``: :func:`eagle3.evaluate.served.run_sglang_evaluation`.
4. Writes the report (:func:`eagle3.evaluate.report.write_report`) and per-turn records
   (``samples.jsonl``) under ``output_dir`` (default ``data/eval/<model>``; the Hydra
   job folder in a multirun). Each finished benchmark is kept in
   ``output_dir/partial/<name>.json``; the same command run again (e.g. after a time
   limit stopped it) reuses finished benchmarks whose settings, target, export and
   prompt ids are unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from eagle3.errors import Eagle3Error
from eagle3.paths import stage_output_dir
from eagle3.evaluate.metrics import acceptance_summary, diversity, is_loop, longest_loop, ratio, tokens_per_second
from eagle3.evaluate.report import write_report
from eagle3.spec import (
    Eagle3Proposer,
    SpecSettings,
    SpeculativeDecoder,
    TargetRunner,
    target_generate,
)

log = logging.getLogger("eagle3")

BENCHMARKS = ("gsm8k", "humaneval", "sharegpt", "mtbench")
SAMPLES_FILE = "samples.jsonl"
META_FILE = "eagle3_meta.json"


def benchmark_names(data_cfg) -> list[str]:
    """Benchmarks to run: ``data.names`` (+ mtbench when ``data.mtbench_path`` is set).

    Raises:
        Eagle3Error: unknown names, an empty list, or mtbench without a path.
    """
    names = list(dict.fromkeys(str(n) for n in data_cfg.names))
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise Eagle3Error(f"unknown benchmarks {unknown} in data.names; choose among {list(BENCHMARKS)}")
    if data_cfg.mtbench_path and "mtbench" not in names:
        names.append("mtbench")
    if "mtbench" in names and not data_cfg.mtbench_path:
        raise Eagle3Error("the mtbench benchmark needs its questions file: set data.mtbench_path=PATH/question.jsonl")
    if not names:
        raise Eagle3Error("data.names is empty; list benchmarks such as [gsm8k, humaneval, sharegpt]")
    if data_cfg.limit is not None and data_cfg.limit < 1:
        raise Eagle3Error(f"data.limit={data_cfg.limit} must be a positive number of prompts per benchmark")
    return names


# ----------------------------------------------------------------------------- export checks
def read_export_meta(drafter_dir: Path) -> dict:
    """``eagle3_meta.json`` of an export (without loading weights).

    Raises:
        Eagle3Error: the folder is not an SGLang drafter export.
    """
    if not (drafter_dir / "config.json").is_file():
        raise Eagle3Error(
            f"no drafter export at {drafter_dir} (config.json missing); run train.py first or set "
            "drafter_dir=<train output_dir>/export/sglang"
        )
    p = drafter_dir / META_FILE
    if not p.is_file():
        return {}
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise Eagle3Error(f"{p} is not valid JSON ({e}); re-export the drafter") from None


def _norm_quant(q: Any) -> dict:
    """Quantization dicts compared on what changes numerics (method, bits, group, symmetry)."""
    if not isinstance(q, dict):
        return {}
    method = q.get("method", "none")
    if method in (None, "none"):
        return {"method": "none"}
    return {k: q.get(k) for k in ("method", "bits", "group_size", "symmetric")}


def check_export(meta: dict, target_info, template_hash: Optional[str]) -> list[str]:
    """Compare an export's provenance with the configured target; return warnings.

    Args:
        meta: the export's ``eagle3_meta.json``.
        target_info: :class:`eagle3.target.models.TargetInfo` of the configured target (or
            anything with ``name``, ``content_hash``, ``quantization``).
        template_hash: :func:`eagle3.target.chat.chat_template_hash` of the tokenizer that
            renders the benchmark prompts (None: not checked).

    Raises:
        Eagle3Error: the chat template differs from the one the drafter was trained on.
    """
    warnings = []
    if not meta:
        return ["the drafter export has no eagle3_meta.json: its target, quantization and chat template cannot be checked"]
    t = meta.get("target") or {}
    hash_differs = bool(t.get("content_hash")) and t.get("content_hash") != getattr(target_info, "content_hash", None)
    qa, qb = _norm_quant(t.get("quantization")), _norm_quant(getattr(target_info, "quantization", None))
    quant_differs = bool(qa) and qa != qb
    if hash_differs or quant_differs:
        warnings.append(
            "drafter trained on features of a different target/quantization: the export records "
            f"{t.get('name')} (content hash {str(t.get('content_hash'))[:16]}, quantization {qa or '?'}) but the "
            f"configured target is {getattr(target_info, 'name', '?')} (content hash "
            f"{str(getattr(target_info, 'content_hash', '?'))[:16]}, quantization {qb or '?'}); expect a low "
            "acceptance length: extract features from the served target and retrain"
        )
    want = meta.get("chat_template_hash")
    if want and template_hash and want != template_hash:
        raise Eagle3Error(
            f"the drafter was trained on prompts rendered with chat template {want[:23]}… but the configured "
            f"target's tokenizer renders with {template_hash[:23]}…; evaluate with the training template "
            "(set model.chat_template or model.tokenizer to what extraction used)"
        )
    if not want:
        warnings.append("the drafter export records no chat template hash; the prompt template is not checked")
    return warnings


def load_train_manifest(meta: dict) -> tuple[Optional[dict], list[str]]:
    """The training features manifest(s) named in the export meta, merged.

    Returns ``(manifest or None, warnings)``; the manifest carries ``plan`` and
    ``splits`` (sample ids), which :func:`eagle3.prompts.load_benchmark` uses to refuse
    held-out prompts that were trained on.
    """
    from eagle3.features import load_manifest

    dirs = meta.get("features_dir")
    if not dirs:
        return None, ["the export names no features folder: held-out ShareGPT prompts cannot be checked against training"]
    dirs = dirs if isinstance(dirs, list) else [dirs]
    merged: dict[str, Any] = {"plan": [], "splits": {}}
    for d in dirs:
        try:
            m = load_manifest(d, require_complete=False)
        except Eagle3Error as e:
            return None, [f"cannot read the training manifest ({e}); held-out ShareGPT prompts are not checked against training"]
        merged["plan"] += list(m.get("plan") or [])
        for k, ids in (m.get("splits") or {}).items():
            merged["splits"].setdefault(k, []).extend(ids)
        merged.setdefault("metadata", m.get("metadata"))
    return merged, []


def load_benchmarks(cfg, names: Sequence[str], train_manifest: Optional[dict]) -> dict:
    """``{name: datasets.Dataset(id, messages)}`` with at most ``data.limit`` rows each."""
    from eagle3.prompts import load_benchmark

    out = {}
    for name in names:
        ds = load_benchmark(name, cfg.data, train_manifest)
        if cfg.data.limit is not None and len(ds) > cfg.data.limit:
            ds = ds.select(range(cfg.data.limit))
        if len(ds) == 0:
            raise Eagle3Error(f"benchmark {name} has no prompts; check data.limit and its source")
        out[name] = ds
    return out


# ----------------------------------------------------------------------------- hf evaluation
@dataclass
class TurnRecord:
    """One evaluated turn: speculative and baseline generation of one rendered prompt."""

    benchmark: str
    sample_id: str
    turn: int
    prompt_tokens: int
    spec_tokens: list[int]
    base_tokens: list[int]
    spec_seconds: float
    base_seconds: float
    spec_prefill_seconds: float
    base_prefill_seconds: float
    verify_passes: int
    emitted: int
    accept_counts: list[int] = field(default_factory=list)
    mismatch: Optional[dict] = None  # see diagnose_mismatch (temperature 0 only)

    @property
    def match(self) -> bool:
        return self.spec_tokens == self.base_tokens


#: a greedy mismatch counts as a numerical near-tie when the two tokens' target logits
#: differ by at most this many units of the compute dtype's epsilon (relative to their size)
TIE_ULPS = 4.0


@torch.inference_mode()
def diagnose_mismatch(runner: TargetRunner, prompt_ids: Sequence[int], spec: Sequence[int],
                      base: Sequence[int]) -> dict:
    """Where speculative and baseline greedy tokens first differ, and whether it is a near-tie.

    Runs the target once on ``prompt + base[:i]`` (``i`` = first differing index) and
    compares the logits of the two tokens chosen there. A gap within ``TIE_ULPS`` units of
    the dtype's epsilon times the logits' size means the two argmaxes flipped on rounding
    (a batched verify pass and a one-token step round differently, notably in bf16);
    a larger gap points at a bug.

    Returns:
        ``{index, spec_token, base_token, logit_gap, tie}`` (``tie`` False when one output
        simply ended earlier).
    """
    i = next((j for j, (a, b) in enumerate(zip(spec, base)) if a != b), min(len(spec), len(base)))
    if i >= len(spec) or i >= len(base):
        return {"index": i, "spec_token": None, "base_token": None, "logit_gap": None, "tie": False}
    ids = list(prompt_ids) + list(base[:i])
    dev = runner.device
    logits, _ = runner.forward(torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None],
                               runner.new_cache(), last_only=True, capture=False)
    la, lb = float(logits[-1, spec[i]]), float(logits[-1, base[i]])
    eps = torch.finfo(logits.dtype).eps
    gap = abs(la - lb)
    return {"index": i, "spec_token": int(spec[i]), "base_token": int(base[i]), "logit_gap": gap,
            "tie": gap <= TIE_ULPS * eps * max(abs(la), abs(lb), 1.0)}


def _user_turns(messages: Sequence[dict]) -> list[list[dict]]:
    """Split a benchmark sample into its user turns, each with the messages before it
    (system messages lead; assistant messages of the sample are not used)."""
    system = [dict(m) for m in messages if m.get("role") == "system"]
    users = [dict(m) for m in messages if m.get("role") == "user"]
    if not users:
        raise Eagle3Error("a benchmark sample has no user message")
    return [system + [u] for u in users]


def _turn_seed(seed: int, benchmark: str, sample_id: str, turn: int) -> int:
    """Per-turn generator seed, stable across runs and resumptions."""
    return seed + zlib.crc32(f"{benchmark}/{sample_id}/{turn}".encode())


def evaluate_hf(
    benchmarks: dict[str, Sequence[dict]],
    decoder: SpeculativeDecoder,
    render: Callable[[list[dict]], list[int]],
    decode: Callable[[list[int]], str],
    settings: SpecSettings,
    warmup_prompts: int = 2,
    max_prompt_tokens: Optional[int] = None,
    seed: int = 0,
    progress: bool = True,
    done: Optional[dict[str, tuple[list[TurnRecord], list[str]]]] = None,
    on_done: Optional[Callable[[str, list[TurnRecord], list[str]], None]] = None,
) -> tuple[dict, list[TurnRecord], list[str]]:
    """Speculative and baseline decoding of every benchmark prompt at batch 1.

    Args:
        benchmarks: ``{name: rows}``; each row has ``id`` and ``messages`` (user turns).
        decoder: the speculative decoder (its ``runner`` also runs the baseline).
        render: messages -> prompt token ids (chat template with generation prompt).
        decode: generated token ids -> text (the assistant message of the next turn).
        settings: the decoder's settings (temperature, max_new_tokens, steps).
        warmup_prompts: prompts of the first benchmark still to run, run once untimed.
        max_prompt_tokens: longer rendered prompts are skipped (counted in warnings).
        seed: base of the per-turn random generators (temperature > 0).
        done: benchmarks already evaluated (resumed): ``{name: (records, warnings)}``.
        on_done: called with ``(name, records, warnings)`` after each benchmark.

    Returns:
        ``(per-benchmark results, turn records, warnings)``; the results hold the
        report keys (:mod:`eagle3.evaluate.report`).
    """
    from tqdm.auto import tqdm

    runner, dev = decoder.runner, decoder.runner.device
    stop = sorted(decoder.stop)
    done = done or {}

    def gen(seed_: int):
        return torch.Generator(device=dev).manual_seed(seed_) if not settings.greedy else None

    # warm-up: kernels, allocator, caches; not measured
    todo = [n for n in benchmarks if n not in done]
    first = benchmarks[todo[0]] if todo else []
    for row in list(first)[: max(0, warmup_prompts)]:
        ids = render(_user_turns(row["messages"])[0])
        if max_prompt_tokens and len(ids) > max_prompt_tokens:
            continue
        decoder.generate(ids, gen(seed))
        target_generate(runner, ids, settings, stop, gen(seed))

    results: dict[str, dict] = {}
    records: list[TurnRecord] = []
    warnings: list[str] = []
    for name, rows in benchmarks.items():
        if name in done:
            recs, warn = done[name]
        else:
            recs, warn = [], []
            skipped = 0
            bar = tqdm(list(rows), desc=f"evaluate {name}", unit="prompt", disable=not progress)
            for row in bar:
                history: list[dict] = []
                for t, turn in enumerate(_user_turns(row["messages"])):
                    msgs = history + [turn[-1]] if history else turn
                    ids = render(msgs)
                    if max_prompt_tokens and len(ids) > max_prompt_tokens:
                        skipped += 1
                        break
                    s = _turn_seed(seed, name, str(row["id"]), t)
                    spec = decoder.generate(ids, gen(s))
                    base = target_generate(runner, ids, settings, stop, gen(s))
                    rec = TurnRecord(name, str(row["id"]), t, len(ids), spec.tokens, base.tokens,
                                     spec.seconds, base.seconds, spec.prefill_seconds, base.prefill_seconds,
                                     spec.verify_passes, spec.emitted, spec.accept_counts)
                    if settings.greedy and not rec.match:
                        rec.mismatch = diagnose_mismatch(runner, ids, spec.tokens, base.tokens)
                    recs.append(rec)
                    history = msgs + [{"role": "assistant", "content": decode(spec.tokens)}]
                if recs:
                    p = sum(r.verify_passes for r in recs)
                    bar.set_postfix(tau=f"{sum(r.emitted for r in recs) / p:.2f}" if p else "-")
            if skipped:
                warn.append(f"{name}: {skipped} prompts longer than max_prompt_tokens={max_prompt_tokens} were skipped")
            if on_done is not None:
                on_done(name, recs, warn)
        warnings += warn
        results[name] = summarize_benchmark(recs, settings)
        records += recs
    return results, records, warnings


def summarize_benchmark(recs: Sequence[TurnRecord], settings: SpecSettings) -> dict:
    """Report fields of one benchmark from its turn records."""
    passes = sum(r.verify_passes for r in recs)
    emitted = sum(r.emitted for r in recs)
    out = acceptance_summary(passes, emitted, [a for r in recs for a in r.accept_counts], settings.num_steps)
    spec_tok, base_tok = sum(len(r.spec_tokens) for r in recs), sum(len(r.base_tokens) for r in recs)
    out["tokens_per_s_spec"] = tokens_per_second(spec_tok, sum(r.spec_seconds for r in recs))
    out["tokens_per_s_base"] = tokens_per_second(base_tok, sum(r.base_seconds for r in recs))
    out["speedup"] = ratio(out["tokens_per_s_spec"], out["tokens_per_s_base"])
    # decode only: tokens after the first / time after the prefill (the prefill is the same work in both)
    out["decode_tokens_per_s_spec"] = tokens_per_second(
        spec_tok - len(recs), sum(r.spec_seconds - r.spec_prefill_seconds for r in recs))
    out["decode_tokens_per_s_base"] = tokens_per_second(
        base_tok - len(recs), sum(r.base_seconds - r.base_prefill_seconds for r in recs))
    out["decode_speedup"] = ratio(out["decode_tokens_per_s_spec"], out["decode_tokens_per_s_base"])
    prompts = {r.sample_id for r in recs}
    if settings.greedy:
        ok = {sid: True for sid in prompts}
        tie = {sid: True for sid in prompts}
        for r in recs:
            ok[r.sample_id] = ok[r.sample_id] and r.match
            tie[r.sample_id] = tie[r.sample_id] and (r.match or bool(r.mismatch and r.mismatch.get("tie")))
        out["lossless_matches"] = sum(ok.values())
        out["lossless_checked"] = len(prompts)
        # prompts that differ only where the target's top two logits tie within rounding
        out["lossless_near_ties"] = sum(tie[sid] and not ok[sid] for sid in prompts)
        out["first_mismatches"] = [{"id": r.sample_id, "turn": r.turn, **(r.mismatch or {})}
                                   for r in recs if not r.match][:10]
    else:
        out["lossless_matches"] = None
        out["lossless_checked"] = None
        out["lossless_near_ties"] = None
    outputs = [r.spec_tokens for r in recs]
    out["diversity"] = diversity(outputs)
    clean = [r for r in recs if not is_loop(r.spec_tokens, longest_loop(r.spec_tokens)[0])]
    cp = sum(r.verify_passes for r in clean)
    out["acceptance_length_non_looping"] = sum(r.emitted for r in clean) / cp if cp else None
    out["num_prompts"] = len(prompts)
    out["num_turns"] = len(recs)
    out["output_tokens_spec"] = spec_tok
    out["output_tokens_base"] = base_tok
    return out


def _overall(records: Sequence[TurnRecord], settings: SpecSettings) -> dict:
    s = summarize_benchmark(records, settings)
    keep = ("acceptance_length", "acceptance_rate", "verify_passes", "generated_tokens", "per_position_acceptance",
            "tokens_per_s_spec", "tokens_per_s_base", "speedup", "decode_speedup", "lossless_matches",
            "lossless_checked", "num_turns")
    return {k: s.get(k) for k in keep}


def write_samples(path: Path, records: Sequence[TurnRecord], decode: Callable[[list[int]], str]) -> None:
    """One JSON line per evaluated turn (atomic)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for r in records:
            span, period = longest_loop(r.spec_tokens)
            f.write(json.dumps({
                "benchmark": r.benchmark, "id": r.sample_id, "turn": r.turn, "prompt_tokens": r.prompt_tokens,
                "tokens_spec": len(r.spec_tokens), "tokens_base": len(r.base_tokens), "match": r.match,
                "verify_passes": r.verify_passes, "acceptance_length": r.emitted / r.verify_passes if r.verify_passes else None,
                "accept_counts": r.accept_counts, "seconds_spec": r.spec_seconds, "seconds_base": r.base_seconds,
                "prefill_seconds_spec": r.spec_prefill_seconds, "prefill_seconds_base": r.base_prefill_seconds,
                "mismatch": r.mismatch,
                "longest_loop": span, "loop_period": period, "text": decode(r.spec_tokens),
            }) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- resume
PARTIAL_DIR = "partial"


def run_key(parts: dict) -> str:
    """Fingerprint of everything that decides a benchmark's records (sha256 of JSON)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def export_fingerprint(drafter_dir: Path) -> dict:
    """What identifies an export cheaply: its config and the weights' size and mtime."""
    w = drafter_dir / "model.safetensors"
    st = w.stat() if w.exists() else None
    cfg = (drafter_dir / "config.json").read_text() if (drafter_dir / "config.json").exists() else ""
    return {"config": cfg, "weights": [st.st_size, st.st_mtime_ns] if st else None}


def load_partial(output_dir: Path, name: str, key: str) -> Optional[tuple[list[TurnRecord], list[str]]]:
    """Records of a benchmark finished by an earlier run with the same key, else None."""
    p = output_dir / PARTIAL_DIR / f"{name}.json"
    if not p.is_file():
        return None
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError:
        return None
    if d.get("key") != key:
        return None
    return [TurnRecord(**r) for r in d["records"]], list(d.get("warnings") or [])


def save_partial(output_dir: Path, name: str, key: str, records: Sequence[TurnRecord], warnings: Sequence[str]) -> None:
    """Keep a finished benchmark's records so a stopped run resumes after it (atomic)."""
    d = output_dir / PARTIAL_DIR
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{name}.json"
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps({"key": key, "records": [dataclasses.asdict(r) for r in records],
                               "warnings": list(warnings)}))
    os.replace(tmp, p)


# ----------------------------------------------------------------------------- the stage
def run_evaluate(cfg) -> dict:
    """The evaluate stage (see the module docstring). Returns the report's results dict.

    Raises:
        Eagle3Error: no export, a chat-template mismatch, a drafter that does not fit the
            target (vocabulary/hidden size/aux layers), bad speculative settings, or
            benchmark problems (unknown name, overlap with training, missing MT-Bench file).
    """
    settings, note = SpecSettings.make(
        cfg.speculative.num_steps, cfg.speculative.topk, cfg.speculative.num_draft_tokens,
        cfg.temperature, cfg.top_p, cfg.max_new_tokens,
    )
    warnings = [note] if note else []
    if getattr(cfg.engine, "name", "hf") == "hf" and int(cfg.workers) > 1 and cfg.worker is None:
        return run_evaluate_parallel(cfg, settings)
    drafter_dir = Path(cfg.drafter_dir)
    meta = read_export_meta(drafter_dir)
    names = benchmark_names(cfg.data)
    output_dir = stage_output_dir(cfg)
    output_dir.mkdir(parents=True, exist_ok=True)
    manifest, w = load_train_manifest(meta)
    warnings += w
    engine = getattr(cfg.engine, "name", "hf")

    if engine == "sglang":
        from eagle3.target import chat_template_hash
        from eagle3.target import load_tokenizer, resolve_target

        info = resolve_target(cfg.model, cfg.cache_dir)
        warnings += check_export(meta, info, chat_template_hash(load_tokenizer(cfg.model, cfg.cache_dir, info)))
        for x in warnings:
            log.warning(x)
        benchmarks = load_benchmarks(cfg, names, manifest)
        from eagle3.evaluate.served import run_sglang_evaluation

        results = run_sglang_evaluation(cfg, benchmarks, meta, output_dir)
        results["warnings"] = warnings + list(results.get("warnings") or [])
        results.setdefault("settings", {}).update(drafter_dir=str(drafter_dir), target=cfg.model.name)
        write_report(output_dir, results)
        return results
    if engine != "hf":
        raise Eagle3Error(f"engine '{engine}' cannot evaluate; use engine=hf or engine=sglang")

    from eagle3.target import chat_template_hash, end_of_turn_ids, render_prompt
    from eagle3.devices import resolve_device
    from eagle3.export import load_sglang_export
    from eagle3.target import load_target

    device = resolve_device(cfg.engine.device)
    model, tokenizer, info = load_target(cfg.model, cfg.cache_dir, device=str(device),
                                         attn_implementation=cfg.engine.attn_implementation)
    warnings += check_export(meta, info, chat_template_hash(tokenizer))
    feat_dtype = (((manifest or {}).get("metadata") or {}).get("target") or {}).get("dtype")
    if feat_dtype and feat_dtype != cfg.model.dtype:
        warnings.append(
            f"the drafter's features were extracted with the target computing in {feat_dtype}, but it is evaluated "
            f"in {cfg.model.dtype}; set model.dtype={feat_dtype} to serve the numerics it was trained on"
        )
    drafter, meta = load_sglang_export(drafter_dir, embed_tokens=model.get_input_embeddings().weight, device=device)
    arch = drafter.arch
    if arch.vocab_size != info.vocab_size or arch.target_hidden_size != info.hidden_size:
        raise Eagle3Error(
            f"the drafter at {drafter_dir} was built for a target with vocabulary {arch.vocab_size} and hidden size "
            f"{arch.target_hidden_size}, but {info.name} has {info.vocab_size} and {info.hidden_size}; "
            "evaluate it against the target it was trained for"
        )
    aux = meta.get("aux_layer_ids")
    if not aux:
        raise Eagle3Error(f"the export at {drafter_dir} does not say which aux layers it reads; re-export it")
    for x in warnings:
        log.warning(x)
    benchmarks = load_benchmarks(cfg, names, manifest)
    if cfg.worker is not None:  # one worker of run_evaluate_parallel: every workers-th prompt
        benchmarks = {n: ds.select(range(int(cfg.worker), len(ds), int(cfg.workers))) for n, ds in benchmarks.items()}
        benchmarks = {n: ds for n, ds in benchmarks.items() if len(ds)}
    runner = TargetRunner(model, aux)
    decoder = SpeculativeDecoder(runner, Eagle3Proposer(drafter, aux), settings, end_of_turn_ids(tokenizer))
    if settings.max_new_tokens + settings.num_draft_tokens + cfg.max_prompt_tokens > (info.max_position_embeddings or 10**9):
        warnings.append(
            f"max_prompt_tokens + max_new_tokens exceed the target's {info.max_position_embeddings} positions"
        )

    def render(msgs):
        return render_prompt(tokenizer, msgs)

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    base_key = {
        "settings": dataclasses.asdict(settings), "target": info.content_hash, "dtype": str(model.dtype),
        "device": device.type, "attn": cfg.engine.attn_implementation, "export": export_fingerprint(drafter_dir),
        "seed": cfg.seed, "max_prompt_tokens": cfg.max_prompt_tokens,
    }
    keys = {n: run_key({**base_key, "benchmark": n, "ids": [str(i) for i in ds["id"]]}) for n, ds in benchmarks.items()}
    done = {}
    for n in benchmarks:
        got = load_partial(output_dir, n, keys[n])
        if got is not None:
            done[n] = got
            log.info("%s: reusing the %d turns evaluated by an earlier run in %s", n, len(got[0]), output_dir)
    per_bench, records, w = evaluate_hf(
        {n: ds for n, ds in benchmarks.items()}, decoder, render, decode, settings,
        warmup_prompts=cfg.warmup_prompts, max_prompt_tokens=cfg.max_prompt_tokens, seed=cfg.seed,
        done=done, on_done=lambda n, r, ww: save_partial(output_dir, n, keys[n], r, ww),
    )
    warnings += w
    runner.close()
    write_samples(output_dir / SAMPLES_FILE, records, decode)
    results = {
        "engine": "hf",
        "benchmarks": per_bench,
        "overall": _overall(records, settings),
        "speculative": {"num_steps": settings.num_steps, "topk": settings.topk,
                        "num_draft_tokens": settings.num_draft_tokens},
        "sampling": {"temperature": settings.temperature, "top_p": settings.top_p,
                     "max_new_tokens": settings.max_new_tokens},
        "settings": {
            "target": info.name, "target_content_hash": info.content_hash, "quantization": info.quantization,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "device": str(device),
            "attn_implementation": cfg.engine.attn_implementation, "drafter_dir": str(drafter_dir),
            "drafter_dtype": str(drafter.fc.weight.dtype).replace("torch.", ""),
            "aux_layer_ids": list(aux), "draft_vocab_size": arch.draft_vocab_size,
            "limit": cfg.data.limit, "warmup_prompts": cfg.warmup_prompts, "seed": cfg.seed,
            "batch_size": 1, "torch_threads": torch.get_num_threads(),
            "resumed_benchmarks": sorted(done),
        },
        "warnings": warnings,
    }
    write_report(output_dir, results)
    return results


WORKERS_DIR = "workers"


def run_evaluate_parallel(cfg, settings: SpecSettings) -> dict:
    """``workers`` evaluation processes (hf engine), then one merged report.

    Worker ``w`` evaluates prompts ``w, w+N, ...`` of every benchmark on ``devices[w]``
    into ``output_dir/workers/W-of-N`` (a report of its own, and resumable partials);
    the merged report recomputes every measure from all turn records, so tau,
    acceptance rate, per-position acceptance and lossless matches equal a one-process
    run's. Timings are summed per prompt as usual; when workers share a device they
    measure that shared device (recorded in ``settings.workers`` and a warning).

    Raises:
        Eagle3Error: a worker failed (finished benchmarks are kept), bad device list.
    """
    import copy

    from eagle3.workers import run_workers, worker_devices

    n = int(cfg.workers)
    devices = worker_devices(str(cfg.engine.device), list(cfg.devices), n, "devices")
    output_dir = stage_output_dir(cfg)
    drafter_dir = Path(cfg.drafter_dir)
    cfgs = []
    for w, dev in enumerate(devices):
        c = copy.deepcopy(cfg)
        c.worker, c.engine.device = w, dev
        c.output_dir = str(output_dir / WORKERS_DIR / f"{w}-of-{n}")
        c.drafter_dir = str(drafter_dir)
        cfgs.append(c)
    log.info("evaluate: %d workers on %s", n, ", ".join(devices))
    run_workers("eagle3.evaluate.run.run_evaluate", cfgs, "evaluation")
    reports = [json.loads((Path(c.output_dir) / "report.json").read_text()) for c in cfgs]
    by_bench: dict[str, list[TurnRecord]] = {}
    for c in cfgs:
        for f in sorted((Path(c.output_dir) / PARTIAL_DIR).glob("*.json")):
            d = json.loads(f.read_text())
            by_bench.setdefault(f.stem, []).extend(TurnRecord(**r) for r in d["records"])
    names = [b for b in benchmark_names(cfg.data) if b in by_bench]
    records = [r for b in names for r in by_bench[b]]
    with open(output_dir / SAMPLES_FILE, "w") as out:  # the workers' per-turn lines, concatenated
        for c in cfgs:
            p = Path(c.output_dir) / SAMPLES_FILE
            if p.exists():
                out.write(p.read_text())
    results = copy.deepcopy(reports[0])
    for k in ("plots", "verdicts", "verdict", "headline"):
        results.pop(k, None)
    results["benchmarks"] = {b: summarize_benchmark(by_bench[b], settings) for b in names}
    results["overall"] = _overall(records, settings)
    shared = len(set(devices)) < len(devices)
    results["settings"].update(device=", ".join(devices), workers=n, resumed_benchmarks=[])
    warnings, skipped = [], {}
    for w in (x for r in reports for x in (r.get("warnings") or [])):
        m = re.match(r"^(\w+): (\d+) prompts longer than (max_prompt_tokens=\d+) were skipped$", w)
        if m:  # one count per worker: add them up
            key = (m.group(1), m.group(3))
            skipped[key] = skipped.get(key, 0) + int(m.group(2))
        elif w not in warnings:
            warnings.append(w)
    warnings += [f"{b}: {n} prompts longer than {lim} were skipped" for (b, lim), n in skipped.items()]
    if shared:
        warnings.append(f"{n} workers shared {', '.join(sorted(set(devices)))}: tokens/s and speed-up were measured on a "
                        "shared device (acceptance and lossless checks are unaffected); use workers=1 for batch-1 timings")
    results["warnings"] = warnings
    write_report(output_dir, results)
    return results
