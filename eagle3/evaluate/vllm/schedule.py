"""``evaluate.py engine=vllm mode=schedule``: a served concurrency sweep that derives the number of
speculative tokens per batch size, then serves that schedule and measures it.

1. Launches, all at once and with the same explicit ``engine.max_num_seqs``, a server without
   a drafter (``off``) and one per static chain in ``schedule.chains`` (``chain-3``,
   ``chain-1``, ...), each serving the export with ``num_speculative_tokens`` k.
2. Sweeps ``schedule.concurrency``: in each of ``schedule.rounds`` rounds every server runs the
   same prompts (the first user turn of every benchmark prompt, cycled to at least the
   concurrency) at each concurrency, the servers' order rotating from point to point so drift
   of a shared machine hits all alike; throughput, TTFT and inter-token latency per run, tau
   and per-position acceptance from each speculative server's own counters.
3. Derives the schedule from those measurements (:mod:`eagle3.schedule`).
4. With ``schedule.check``, launches a fourth server serving the schedule (vLLM's
   ``num_speculative_tokens_per_batch_size``) and sweeps all of them again, interleaved: the
   comparison the report states (:mod:`eagle3.evaluate.schedule_report`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from eagle3.evaluate.vllm.measure import SweepRun, run_prompts

log = logging.getLogger("eagle3")

OFF = "off"
SCHEDULE = "schedule"


def chain_role(k: int) -> str:
    """The role name of the static chain of ``k`` speculative tokens (``chain-3``)."""
    return f"chain-{int(k)}"


def role_steps(role: str) -> Optional[int]:
    """``k`` of a chain role, 0 for ``off``, None for the schedule."""
    return 0 if role == OFF else (int(role.split("-")[1]) if role.startswith("chain-") else None)


def sweep(clients: dict, body: dict, prompts: list[list[int]], concurrency: list[int], rounds: int,
          phase: str) -> list[dict]:
    """Every server at every concurrency, ``rounds`` times, the order rotating (see the module docstring).

    Returns:
        one record per run: ``{phase, round, concurrency, role, order, run}`` (``run``: a
        :class:`eagle3.evaluate.vllm.measure.SweepRun`).
    """
    from tqdm.auto import tqdm

    roles = list(clients)
    out, k = [], 0
    bar = tqdm(total=rounds * len(concurrency) * len(roles), desc=f"{phase} sweep", leave=False)
    for r in range(int(rounds)):
        for c in concurrency:
            n = max(len(prompts), int(c))
            batch = [prompts[i % len(prompts)] for i in range(n)]
            order = roles[k % len(roles):] + roles[:k % len(roles)]
            for i, role in enumerate(order):
                run = run_prompts(clients[role], body, batch, int(c), role != OFF)
                out.append({"phase": phase, "round": r, "concurrency": int(c), "role": role, "order": i, "run": run})
                log.info("%s %s c=%d round %d: %.1f output tok/s%s", phase, role, c, r,
                         run.output_tokens / run.duration_s,
                         f", tau {run.counters.tau:.2f}" if run.counters and run.counters.tau else "")
                bar.update(1)
            k += 1
    bar.close()
    return out


def points(records: list[dict]):
    """The derivation's :class:`eagle3.schedule.derive.ChainPoint` per static server and
    concurrency: tokens/s pooled over rounds (tokens / seconds), tau and per-position
    acceptance from the summed counter deltas.

    Raises:
        Eagle3Error: a speculative run without counters (the server reports none).
    """
    from eagle3.engines.vllm import SpecCounters
    from eagle3.errors import Eagle3Error
    from eagle3.schedule.derive import ChainPoint

    out = []
    for key in sorted({(r["role"], r["concurrency"]) for r in records if role_steps(r["role"]) is not None}):
        role, c = key
        runs: list[SweepRun] = [r["run"] for r in records if (r["role"], r["concurrency"]) == key]
        tps = sum(x.output_tokens for x in runs) / sum(x.duration_s for x in runs)
        k = role_steps(role)
        if k == 0:
            out.append(ChainPoint(c, 0, tps))
            continue
        total = SpecCounters()
        for x in runs:
            total = total + (x.counters or SpecCounters())
        if not total.drafts:
            raise Eagle3Error(f"the {role} server reported no speculative counters at concurrency {c}: its tau "
                              "and per-position acceptance cannot be read (is it running the drafter?)")
        pp = tuple(min(1.0, v) for v in total.per_position_acceptance(k)[:k])
        out.append(ChainPoint(c, k, tps, total.tau, pp))
    return out


def first_turns(benchmarks: dict, render, limit: Optional[int]) -> list[list[int]]:
    """The rendered first user turn (system messages first) of every benchmark prompt that fits
    ``limit`` tokens, benchmarks in order.

    Raises:
        Eagle3Error: no prompt fits.
    """
    from eagle3.errors import Eagle3Error
    from eagle3.evaluate.measures import system_messages

    out = []
    for rows in benchmarks.values():
        for r in rows:
            users = [m for m in r["messages"] if m.get("role") == "user"][:1]
            ids = render(system_messages(r) + users)
            if users and (limit is None or len(ids) <= limit):
                out.append(ids)
    if not out:
        raise Eagle3Error(f"no benchmark prompt is {limit} tokens or shorter; raise engine.max_model_len or lower "
                          "max_new_tokens")
    return out


def evaluate_schedule(cfg: Any, export, info, tokenizer, benchmarks: dict, output_dir: Path) -> dict:
    """Launch, sweep, derive, check (see the module docstring); stop every server launched.

    Returns:
        the schedule results (:func:`eagle3.evaluate.schedule_report.schedule_results`).

    Raises:
        Eagle3Error: a server not coming up, a failing request, or no usable measurement.
    """
    from eagle3.engines.vllm import speculative_config
    from eagle3.evaluate.measures import prompt_limit
    from eagle3.evaluate.schedule_report import schedule_results
    from eagle3.evaluate.vllm.evaluation import _request_body
    from eagle3.evaluate.vllm.servers import cap_warnings, launch_servers
    from eagle3.schedule.bands import bands, vllm_speculative_config
    from eagle3.schedule.derive import derive
    from eagle3.target import render_prompt

    sc, e = cfg.schedule, cfg.engine
    draft = str(Path(export.dir).resolve())
    model_path = str(Path(info.path).resolve()) if info.path else str(cfg.model.source)
    roles = {OFF: (int(e.port), None)}
    for i, k in enumerate(sc.chains):
        roles[chain_role(k)] = (int(e.port) + 1 + i, speculative_config(draft, int(k)))
    body = _request_body(cfg, tokenizer)
    limit, _ = prompt_limit([int(e.max_model_len)], int(cfg.max_new_tokens), getattr(cfg, "max_prompt_tokens", None))
    prompts = first_turns(benchmarks, lambda m: render_prompt(tokenizer, m), limit)  # none fits: refused before launching
    opened = launch_servers(cfg, model_path, roles, output_dir)
    try:
        clients = {r: s.client for r, s in opened.items()}
        for _ in range(int(cfg.warmup_prompts)):
            for cl in clients.values():
                cl.complete(dict(body, prompt=list(prompts[0])))
        concurrency = sorted({int(c) for c in sc.concurrency})
        records = sweep(clients, body, prompts, concurrency, int(sc.rounds), "derive")
        measured = points(records)
        choices = derive(measured, float(sc.min_gain))
        schedule = bands(choices, int(e.max_num_seqs))
        spec = vllm_speculative_config(draft, schedule)
        if sc.check and spec is not None:
            port = int(e.port) + 1 + len(sc.chains)
            opened.update(launch_servers(cfg, model_path, {SCHEDULE: (port, spec)}, output_dir))
            clients[SCHEDULE] = opened[SCHEDULE].client
            for _ in range(int(cfg.warmup_prompts)):
                clients[SCHEDULE].complete(dict(body, prompt=list(prompts[0])))
            records += sweep(clients, body, prompts, concurrency, int(sc.rounds), "check")
        desc = {r: s.describe() for r, s in opened.items()}
    finally:
        for s in opened.values():
            s.stop()
    warnings = cap_warnings(desc, concurrency)
    if len(prompts) < max(concurrency):
        warnings.append(f"{len(prompts)} prompts were cycled to reach concurrency {max(concurrency)}: repeated "
                        "prompts share prefix-cache blocks within a run")
    return schedule_results(cfg, records, choices, schedule, desc, warnings, draft, model_path, len(prompts))
