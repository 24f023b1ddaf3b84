"""In-process (``engine=hf``) evaluation: speculative and baseline decoding of every
benchmark prompt at batch 1.

For every prompt (every user turn of multi-turn prompts, the history carrying the
speculative answer), speculative decoding (:class:`eagle3.spec.SpeculativeDecoder`) and
the target's own decoding (:func:`eagle3.spec.target_generate`: the baseline, same
prefill and KV cache code) run on the same rendered prompt, both timed with device
synchronisation after ``warmup_prompts`` untimed prompts. At temperature 0 the two
token sequences must be equal (lossless check); where they are not,
:func:`diagnose_mismatch` tells a numerical near-tie from a bug.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from eagle3.errors import Eagle3Error
from eagle3.evaluate.inprocess.records import TurnRecord, summarize_benchmark
from eagle3.evaluate.measures import gc_held
from eagle3.evaluate.inprocess.teacher_forced import teacher_forced_turn
from eagle3.spec import SpecSettings, SpeculativeDecoder, TargetRunner, target_generate

#: a greedy mismatch counts as a numerical near-tie when the two tokens' target logits
#: differ by at most this many units of the compute dtype's epsilon (relative to their size)
TIE_ULPS = 4.0
#: ... or by at most twice the drift of those logits between two numerics paths of the target
#: (a prefill, and verify-shaped passes), when that drift is itself at most this many units:
#: a larger drift means the verify pass computes something else, a fault, not rounding
DRIFT_MAX_ULPS = 32.0


def _verify_shaped_logits(runner: TargetRunner, prompt_ids: Sequence[int], reply: Sequence[int],
                          chunk: int) -> torch.Tensor:
    """Logits ``[V]`` of the position after ``prompt_ids + reply`` computed as speculative
    decoding computes them: a prefill of the prompt, then chain verify passes of up to
    ``chunk`` tokens over the reply (with an empty reply, the prompt's last token alone)."""
    ids = list(prompt_ids) + list(reply)
    p0 = max(1, len(prompt_ids) if reply else len(prompt_ids) - 1)  # a one-token prompt: the prefill alone
    cache = runner.new_cache()
    runner.reserve(cache, len(ids))
    logits, _ = runner.prefill(torch.tensor([ids[:p0]], device=runner.device), cache, capture=False)
    for a in range(p0, len(ids), chunk):
        part = torch.tensor(ids[a:a + chunk], device=runner.device)
        depth = torch.arange(part.numel(), device=runner.device)
        logits, _ = runner.verify(part, depth, None, cache, a)
    return logits[-1]


@torch.inference_mode()
def diagnose_mismatch(runner: TargetRunner, prompt_ids: Sequence[int], spec: Sequence[int],
                      base: Sequence[int], chunk: int = 4) -> dict:
    """Where speculative and baseline greedy tokens first differ, and whether it is a near-tie.

    At the first differing index ``i`` the target's logits for ``prompt + base[:i]`` are
    computed twice: by one prefill, and verify-shaped (a prefill of the prompt, then chain
    verify passes of ``chunk`` tokens, as the decoder runs them). The two chosen tokens'
    logit gap (in the prefill) is a rounding tie when it is within ``TIE_ULPS`` units of the
    dtype's epsilon times the logits' size, or within twice the drift of those two logits
    between the two paths (a flip between the paths is always such a case), provided that
    drift is at most ``DRIFT_MAX_ULPS`` units (a batched verify pass and a one-token step
    round differently, notably in bf16 and under fused kernels; a larger drift or a larger
    gap points at a bug).

    Args:
        runner: the target as the decoder ran it (a static runner's cache is reused).
        prompt_ids, spec, base: the prompt and the two greedy replies (token ids).
        chunk: tokens per verify pass (the decoder's ``num_draft_tokens``).

    Returns:
        ``{index, spec_token, base_token, logit_gap, drift, tie}`` (``tie`` False and the
        rest None when one output simply ended earlier). ``logit_gap`` and ``drift`` are in
        logit units.
    """
    i = next((j for j, (a, b) in enumerate(zip(spec, base)) if a != b), min(len(spec), len(base)))
    if i >= len(spec) or i >= len(base):
        return {"index": i, "spec_token": None, "base_token": None, "logit_gap": None, "drift": None, "tie": False}
    ids = list(prompt_ids) + list(base[:i])
    # a prefill: on a static runner it also places the new positions (a bare forward would not)
    logits, _ = runner.prefill(torch.tensor([ids], device=runner.device), runner.new_cache(), capture=False)
    a, b = int(spec[i]), int(base[i])
    la, lb = float(logits[-1, a]), float(logits[-1, b])
    other = _verify_shaped_logits(runner, prompt_ids, base[:i], max(1, chunk))
    drift = max(abs(la - float(other[a])), abs(lb - float(other[b])))
    eps, size = torch.finfo(logits.dtype).eps, max(abs(la), abs(lb), 1.0)
    gap = abs(la - lb)
    tie = gap <= TIE_ULPS * eps * size or (drift <= DRIFT_MAX_ULPS * eps * size and gap <= 2 * drift)
    return {"index": i, "spec_token": a, "base_token": b, "logit_gap": gap, "drift": drift, "tie": bool(tie)}


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


@dataclass
class _Evaluation:
    """What every turn of :func:`evaluate_hf` is run with (its arguments, bundled)."""

    decoder: SpeculativeDecoder
    render: Callable[[list[dict]], list[int]]
    decode: Callable[[list[int]], str]
    settings: SpecSettings
    max_prompt_tokens: Optional[int]
    seed: int
    teacher_forced: bool = False

    def __post_init__(self):
        self.runner, self.dev = self.decoder.runner, self.decoder.runner.device
        self.stop = sorted(self.decoder.stop)
        self.turns = 0  # turns decoded so far (sets which decoding runs first)

    def gen(self, seed_: int):
        """A fresh generator seeded with ``seed_`` on the target's device (None when greedy)."""
        return torch.Generator(device=self.dev).manual_seed(seed_) if not self.settings.greedy else None

    def too_long(self, ids: Sequence[int]) -> bool:
        """Whether a rendered prompt exceeds ``max_prompt_tokens`` (never when unset)."""
        return bool(self.max_prompt_tokens and len(ids) > self.max_prompt_tokens)

    def warm_up(self, rows, warmup_prompts: int) -> None:
        """The first turn of the first ``warmup_prompts`` rows, both decodings, untimed."""
        # warm-up: kernels, allocator, caches; not measured
        for row in list(rows)[: max(0, warmup_prompts)]:
            ids = self.render(_user_turns(row["messages"])[0])
            if self.too_long(ids):
                continue
            self.decoder.generate(ids, self.gen(self.seed))
            target_generate(self.runner, ids, self.settings, self.stop, self.gen(self.seed))

    def prompt(self, name: str, row: dict) -> tuple[list[TurnRecord], bool]:
        """Every user turn of one row in order: ``(records, skipped)``; a turn whose
        rendered prompt is too long ends the row (``skipped``), keeping earlier turns."""
        recs: list[TurnRecord] = []
        history: list[dict] = []
        for t, turn in enumerate(_user_turns(row["messages"])):
            msgs = history + [turn[-1]] if history else turn
            ids = self.render(msgs)
            if self.too_long(ids):
                return recs, True
            s = _turn_seed(self.seed, name, str(row["id"]), t)
            # alternate which decoding goes first, so a drift in machine load hits both alike
            self.turns += 1
            with gc_held():  # no collector pause inside a timed decoding
                if self.turns % 2:
                    spec = self.decoder.generate(ids, self.gen(s))
                    base = target_generate(self.runner, ids, self.settings, self.stop, self.gen(s))
                else:
                    base = target_generate(self.runner, ids, self.settings, self.stop, self.gen(s))
                    spec = self.decoder.generate(ids, self.gen(s))
            rec = TurnRecord(name, str(row["id"]), t, len(ids), spec.tokens, base.tokens,
                             spec.seconds, base.seconds, spec.prefill_seconds, base.prefill_seconds,
                             spec.verify_passes, spec.emitted, spec.accept_counts)
            if self.settings.greedy and not rec.match:
                rec.mismatch = diagnose_mismatch(self.runner, ids, spec.tokens, base.tokens,
                                                 self.settings.num_draft_tokens)
            if self.teacher_forced:
                rec.teacher_forced = teacher_forced_turn(self.runner, self.decoder.proposer.drafter, ids, spec.tokens,
                                                         self.settings.num_steps)
            recs.append(rec)
            history = msgs + [{"role": "assistant", "content": self.decode(spec.tokens)}]
        return recs, False

    def benchmark(self, name: str, rows, progress: bool) -> tuple[list[TurnRecord], list[str]]:
        """Every row of one benchmark: ``(records, warnings)`` (skipped prompts counted)."""
        from tqdm.auto import tqdm

        recs: list[TurnRecord] = []
        warn: list[str] = []
        skipped = 0
        bar = tqdm(list(rows), desc=f"evaluate {name}", unit="prompt", disable=not progress)
        for row in bar:
            got, skip = self.prompt(name, row)
            recs += got
            skipped += skip
            if recs:
                p = sum(r.verify_passes for r in recs)
                bar.set_postfix(tau=f"{sum(r.emitted for r in recs) / p:.2f}" if p else "-")
        if skipped:
            warn.append(f"{name}: {skipped} prompts longer than max_prompt_tokens={self.max_prompt_tokens} were skipped")
        return recs, warn


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
    teacher_forced: bool = False,
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
        teacher_forced: replay every turn teacher-forced
            (:func:`eagle3.evaluate.inprocess.teacher_forced.teacher_forced_turn`; greedy chains
            with an EAGLE-3 drafter only, else ignored).

    Returns:
        ``(per-benchmark results, turn records, warnings)``; the results hold the
        report keys (:mod:`eagle3.evaluate.report`).

    Raises:
        Eagle3Error: a benchmark sample without a user message.
    """
    tf = bool(teacher_forced and settings.greedy and settings.topk == 1 and hasattr(decoder.proposer, "drafter"))
    ev = _Evaluation(decoder, render, decode, settings, max_prompt_tokens, seed, tf)
    done = done or {}
    todo = [n for n in benchmarks if n not in done]
    ev.warm_up(benchmarks[todo[0]] if todo else [], warmup_prompts)

    results: dict[str, dict] = {}
    records: list[TurnRecord] = []
    warnings: list[str] = []
    for name, rows in benchmarks.items():
        if name in done:
            recs, warn = done[name]
        else:
            recs, warn = ev.benchmark(name, rows, progress)
            if on_done is not None:
                on_done(name, recs, warn)
        warnings += warn
        results[name] = summarize_benchmark(recs, settings)
        records += recs
    return results, records, warnings
