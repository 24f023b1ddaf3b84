"""The doctor's acceptance probe: a few greedy generations with the drafter, and a verdict.

In process (:func:`probe_in_process`): the target and the export are loaded as the hf
evaluation loads them (``eagle3.evaluate.run``), the target's aux hooks on the layers the
serving engine would capture for the export's ``config.json`` ids
(:func:`eagle3.target.engine_captured_ids`), and :class:`eagle3.spec.SpeculativeDecoder`
decodes ``doctor.probe_prompts`` fixed prompts (:data:`PROBE_PROMPTS`) greedily. Against
a live SGLang server (:func:`probe_served`): the same prompts through ``/generate``,
read back from ``meta_info`` (``completion_tokens / spec_verify_ct``).

Chance level: a draft token drawn at random from the draft vocabulary equals the
target's greedy token with probability about ``1 / draft_vocab_size``, so a drafter that
reads nothing useful has a first-position acceptance near that and ``tau`` near
``1 + 1 / draft_vocab_size``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Optional

from eagle3.doctor.checks import row, split_fix
from eagle3.errors import Eagle3Error

NAME, SERVED_NAME = "acceptance probe", "served acceptance probe"

#: built-in prompts (short chat requests of the kinds the benchmarks hold: arithmetic, code, chat)
PROBE_PROMPTS = (
    "What is 12 times 7? Answer briefly.",
    "Write a Python function that returns the square of a number.",
    "Give me three tips for staying focused while studying.",
    "Explain in two sentences why the sky is blue.",
    "List the first five prime numbers.",
    "Write a short poem about the sea.",
    "How many days are there in a leap year?",
    "Translate 'good morning' into French and Spanish.",
)

#: most likely first: which failed check explains an export that accepts nothing
CAUSE_ORDER = ("aux layer ids", "d2t", "target and quantization", "tie_word_embeddings", "export schema",
               "export reads back", "chat template", "compute dtype")


def probe_messages(n: int) -> list[list[dict]]:
    """The first ``n`` built-in prompts as one-turn conversations (cycled when ``n`` exceeds them).

    Raises:
        Eagle3Error: ``n < 1``.
    """
    if n < 1:
        raise Eagle3Error(f"doctor.probe_prompts is {n}; set it to 1 or more, or doctor.probe=false")
    return [[{"role": "user", "content": PROBE_PROMPTS[i % len(PROBE_PROMPTS)]}] for i in range(n)]


def _load_drafter(export_dir, embed, device):
    """The drafter as :func:`eagle3.export.load_sglang_export` loads it; when that refuses the
    export's aux ids or its convention (the aux row reports both), the same weights read in the
    export's own convention (the files are still checked by :func:`eagle3.export.read_sglang_export`)."""
    from eagle3.export import load_sglang_export, read_sglang_export
    from eagle3.export.sglang import drafter_from_export

    try:
        return load_sglang_export(export_dir, embed_tokens=embed, device=device)[0]
    except Eagle3Error:
        pass  # its aux ids or convention do not suit SGLang: the aux row says so; the probe feeds what the engine captures
    exp = read_sglang_export(export_dir, convention=None)
    return drafter_from_export(exp, embed).to(device=device, dtype=exp.dtype).eval()


def summarize(accept_counts: list[int], emitted: int, draft_vocab_size: int, num_steps: int) -> dict:
    """Probe measures from the verify passes of all prompts.

    Args:
        accept_counts: drafts accepted by each verify pass.
        emitted: tokens the verify passes emitted (bonus included).
        draft_vocab_size: ``Vd``; chance = ``1 / Vd``.
        num_steps: draft depth.

    Returns:
        ``{verify_passes, emitted, tau, first_position_acceptance, accepted_drafts,
        proposed_drafts, chance_first_position, at_chance}``; ``at_chance`` is true when the
        first-position acceptance is within 3 standard deviations of chance (binomial over
        the passes). ``tau``/rates are None without a pass.
    """
    n = len(accept_counts)
    chance = 1.0 / draft_vocab_size
    first = sum(1 for a in accept_counts if a >= 1) / n if n else None
    bound = chance + 3 * math.sqrt(chance * (1 - chance) / n) if n else None
    return {"verify_passes": n, "emitted": int(emitted), "tau": emitted / n if n else None,
            "first_position_acceptance": first, "accepted_drafts": int(sum(accept_counts)),
            "proposed_drafts": n * num_steps, "chance_first_position": chance,
            "at_chance": bool(first is not None and first <= bound)}


def probe_in_process(cfg, export_dir: Path, aux_ids: list[int]) -> dict:
    """Greedy speculative decoding of the built-in prompts with the export, in this process.

    Args:
        cfg: the ``EvaluateConfig`` (``model``, ``engine.device``, ``speculative``,
            ``doctor.probe_prompts``, ``doctor.probe_max_new_tokens``).
        export_dir: the export folder checked (:func:`eagle3.export.export_dir` of ``drafter_dir``).
        aux_ids: HF layer ids whose states feed the drafter (what the serving engine captures).

    Returns:
        :func:`summarize`'s dict plus ``prompts``, ``aux_layer_ids``, ``draft_vocab_size``,
        ``seconds``.

    Raises:
        Eagle3Error: the target or the export cannot be loaded, or bad speculative settings.
    """
    from eagle3.devices import resolve_device
    from eagle3.spec import Eagle3Proposer, SpecSettings, SpeculativeDecoder, TargetRunner
    from eagle3.target import end_of_turn_ids, load_target, render_prompt

    s = cfg.speculative
    settings, _ = SpecSettings.make(s.num_steps, s.topk, s.num_draft_tokens, 0.0, 1.0, cfg.doctor.probe_max_new_tokens)
    device = resolve_device(cfg.engine.device)
    model, tokenizer, _ = load_target(cfg.model, cfg.cache_dir, device=str(device),
                                      attn_implementation=getattr(cfg.engine, "attn_implementation", "sdpa"))
    drafter = _load_drafter(export_dir, model.get_input_embeddings().weight, device)
    runner = TargetRunner(model, list(aux_ids))
    decoder = SpeculativeDecoder(runner, Eagle3Proposer(drafter, list(aux_ids)), settings, end_of_turn_ids(tokenizer))
    counts, emitted, t0 = [], 0, time.perf_counter()
    msgs = probe_messages(cfg.doctor.probe_prompts)
    try:
        for m in msgs:
            r = decoder.generate(render_prompt(tokenizer, m))
            counts += list(r.accept_counts)
            emitted += r.emitted
    finally:
        runner.close()
    out = summarize(counts, emitted, drafter.arch.draft_vocab_size, settings.num_steps)
    out.update(prompts=len(msgs), aux_layer_ids=list(aux_ids), draft_vocab_size=drafter.arch.draft_vocab_size,
               seconds=time.perf_counter() - t0, engine="hf")
    return out


def probe_served(cfg, tokenizer, draft_vocab_size: int) -> dict:
    """The built-in prompts through a live SGLang server serving the drafter
    (``engine.speculative_url``), greedy; tau = ``completion_tokens / spec_verify_ct`` summed
    over requests.

    Returns:
        ``{engine, url, prompts, verify_passes, completion_tokens, tau, tau_sglang,
        draft_vocab_size, chance_first_position}``: ``tau_sglang`` is SGLang's
        ``completion_tokens / spec_verify_ct``, which counts each request's prefill token;
        ``tau`` leaves those out, as the in-process count does (:mod:`eagle3.spec.decoder`).

    Raises:
        Eagle3Error: the server cannot be reached, or answers without ``spec_verify_ct``
            (it is not serving a drafter).
    """
    from eagle3.engines.sglang import SGLangClient
    from eagle3.target import render_prompt

    e = cfg.engine
    client = SGLangClient(e.speculative_url, timeout_s=e.request_timeout_s, max_retries=e.max_retries,
                          backoff_s=e.backoff_s)
    passes = tokens = 0
    msgs = probe_messages(cfg.doctor.probe_prompts)
    for m in msgs:
        body = {"input_ids": render_prompt(tokenizer, m),
                "sampling_params": {"max_new_tokens": int(cfg.doctor.probe_max_new_tokens), "temperature": 0.0}}
        meta = client.generate(body)["meta_info"]
        if not meta.get("spec_verify_ct"):
            raise Eagle3Error(f"the server at {e.speculative_url} answered without spec_verify_ct: it is not serving "
                              "a drafter; set engine.speculative_url to the server launched with the EAGLE-3 drafter")
        passes += int(meta["spec_verify_ct"])
        tokens += int(meta.get("completion_tokens") or 0)
    return {"engine": "sglang", "url": e.speculative_url, "prompts": len(msgs), "verify_passes": passes,
            "completion_tokens": tokens, "tau": (tokens - len(msgs)) / passes if passes else None,
            "tau_sglang": tokens / passes if passes else None,
            "draft_vocab_size": draft_vocab_size, "chance_first_position": 1.0 / draft_vocab_size}


def likely_causes(rows: list[dict]) -> list[str]:
    """Names of the failed (then warned) checks, most likely cause of no acceptance first (:data:`CAUSE_ORDER`)."""
    rank = {n: i for i, n in enumerate(CAUSE_ORDER)}
    out = []
    for status in ("fail", "warn"):
        out += sorted((r["name"] for r in rows if r["status"] == status and r["name"] in rank), key=rank.get)
    return out


def verdict_row(result: dict, rows: list[dict], threshold: float, name: str = NAME) -> dict:
    """The probe's row: ``fail`` ("accepts nothing") when ``tau < threshold``, with the likely
    causes ranked from the failed checks; else ``pass``.

    Args:
        result: :func:`probe_in_process` or :func:`probe_served`.
        rows: the checks' rows so far.
        threshold: ``doctor.accepts_nothing_below`` (1.05).
    """
    tau, vd = result.get("tau"), result["draft_vocab_size"]
    chance = (f"chance: a random draft token from the {vd}-token draft vocabulary is accepted with probability "
              f"{1 / vd:.2g}")
    p1 = result.get("first_position_acceptance")
    what = (f"tau {tau:.2f} over {result['verify_passes']} verify passes ({result['prompts']} prompts)"
            if tau is not None else f"no verify pass in {result['prompts']} prompts")
    if p1 is not None:
        what += f", first-position acceptance {p1:.3f}" + (" (at chance level)" if result.get("at_chance") else "")
    what += f"; {chance}"
    if tau is not None and tau >= threshold:
        return row(name, "pass", what)
    causes = likely_causes(rows)
    fix = ("likely causes, most likely first: " + ", ".join(causes) + " (fix the rows above)") if causes else \
        ("no check failed: the drafter itself is untrained or trained on other features; retrain it on features "
         "extracted from this target")
    return row(name, "fail", "accepts nothing: " + what, fix)


def probe_rows(cfg, export_dir: Path, rows: list[dict], aux_ids: Optional[list[int]], tokenizer,
               draft_vocab_size: Optional[int]) -> tuple[list[dict], dict]:
    """The probe rows (in process with the export at ``export_dir``; also served when
    ``engine=sglang`` has ``speculative_url``).

    Returns:
        ``(rows, results)``; a probe that cannot run is a ``skip`` (a broken export) or a
        ``fail`` row (it raised), never an exception.
    """
    out, results = [], {}
    threshold = float(cfg.doctor.accepts_nothing_below)
    if aux_ids is None or draft_vocab_size is None:
        out.append(row(NAME, "skip", "the export cannot be loaded (see the failed rows above)"))
    elif getattr(cfg.engine, "name", "hf") == "hf":
        try:
            results["in_process"] = probe_in_process(cfg, export_dir, aux_ids)
            out.append(verdict_row(results["in_process"], rows, threshold))
        except Eagle3Error as e:
            what, fix = split_fix(str(e))
            out.append(row(NAME, "fail", f"the probe could not run: {what}", fix or "fix the error named here"))
    else:
        out.append(row(NAME, "skip", f"engine={cfg.engine.name}: the in-process probe runs with engine=hf"))
    url = getattr(cfg.engine, "speculative_url", None)
    if getattr(cfg.engine, "name", "hf") == "sglang" and url and tokenizer is not None and draft_vocab_size:
        try:
            results["served"] = probe_served(cfg, tokenizer, draft_vocab_size)
            out.append(verdict_row(results["served"], rows, threshold, SERVED_NAME))
        except Eagle3Error as e:
            what, fix = split_fix(str(e))
            out.append(row(SERVED_NAME, "fail", f"the served probe could not run: {what}",
                           fix or "check engine.speculative_url"))
    return out, results
