"""``engine=vllm`` as a backend: the export as vLLM serves it (``<drafter_dir>/export/vllm``,
or the export folder given: :func:`eagle3.export.export_dir`;
:func:`eagle3.export.read_vllm_export`: files, ``d2t``, aux ids in vLLM's convention; an
SGLang export is refused with the ``export/vllm`` folder to use), its provenance against the
configured target (content hash, quantization, chat template) and its sizes
(:mod:`eagle3.export.provenance`), then the servers'
measurements (:func:`eagle3.evaluate.vllm.evaluation.evaluate_servers`)."""

from __future__ import annotations

import logging
from pathlib import Path

from eagle3.errors import Eagle3Error
from eagle3.evaluate.base import Backend, StageInputs
from eagle3.evaluate.benchmarks import benchmark_names, load_benchmarks, prompt_settings

log = logging.getLogger("eagle3")


class VLLMBackend(Backend):
    """A baseline and a speculative vLLM server, both up at once (connected or launched here)."""

    name = "vllm"
    export_engine = "vllm"

    def check(self, settings) -> list[str]:
        """``engine.url`` is refused (two servers are compared), ``concurrency`` must list
        positive counts; a warning when ``speculative.topk`` is not 1 (vLLM drafts a chain).

        Raises:
            Eagle3Error: ``engine.url`` set, or a bad ``concurrency`` list.
        """
        cfg = self.cfg
        if getattr(cfg.engine, "url", None):
            raise Eagle3Error(f"engine.url={cfg.engine.url} names one server, but served evaluation compares two: "
                              "pass engine.baseline_url (no drafter) and engine.speculative_url (serving the "
                              "drafter), or neither to launch both here")
        self.concurrency = sorted({int(c) for c in cfg.concurrency})
        if not self.concurrency or min(self.concurrency) < 1:
            raise Eagle3Error(f"concurrency {list(cfg.concurrency)} must list positive request counts, e.g. [1, 4, 16]")
        if int(settings.topk) != 1:
            return [f"vLLM's EAGLE-3 proposes a chain (topk 1); speculative.topk={settings.topk} is not used"]
        return []

    def read_export(self, drafter_dir: Path):
        """The vLLM export at ``drafter_dir`` (:func:`eagle3.export.read_vllm_export`).

        Raises:
            Eagle3Error: no export (``config.json`` missing), a damaged one, or an export for SGLang.
        """
        from eagle3.export import read_vllm_export

        d = Path(drafter_dir)
        if not (d / "config.json").is_file():
            raise Eagle3Error(f"no drafter export at {d} (config.json missing); run train.py first or set "
                              "drafter_dir=<train output_dir>/export/vllm")
        return read_vllm_export(d)

    def run(self, inputs: StageInputs) -> dict:
        """Provenance and sizes against the target, the benchmarks, the servers' measurements;
        the report's results dict (``engine: vllm``).

        Raises:
            Eagle3Error: a chat-template mismatch, a drafter that does not fit, benchmark
                problems, or as :func:`eagle3.evaluate.vllm.evaluation.evaluate_servers`.
        """
        from eagle3.evaluate.vllm.evaluation import evaluate_servers
        from eagle3.export.provenance import check_drafter_fits, check_export
        from eagle3.target import chat_template_hash, load_tokenizer, resolve_target

        cfg, export = self.cfg, inputs.export
        info = resolve_target(cfg.model, cfg.cache_dir)
        tokenizer = load_tokenizer(cfg.model, cfg.cache_dir, info)
        warnings = inputs.warnings + check_export(export.meta, info, chat_template_hash(tokenizer))
        check_drafter_fits(export.arch, export.meta, info, Path(inputs.drafter_dir))
        left_out: dict = {}
        benchmarks = load_benchmarks(cfg, benchmark_names(cfg.data), inputs.manifest, left_out)
        output_dir = inputs.output_dir
        output_dir.mkdir(parents=True, exist_ok=True)
        for w in warnings:
            log.warning(w)
        results = evaluate_servers(cfg, inputs.settings, export, info, tokenizer, benchmarks, self.concurrency,
                                   output_dir)
        results["warnings"] = warnings + results["warnings"]
        results["settings"].update(trained_on_left_out=left_out, **prompt_settings(cfg.data))
        return results

    def run_schedule(self, inputs: StageInputs) -> dict:
        """``mode=schedule``: provenance and sizes as :meth:`run`, then the schedule sweep
        (:func:`eagle3.evaluate.vllm.schedule.evaluate_schedule`) on the benchmarks' first turns.

        Raises:
            Eagle3Error: as :meth:`run`, a server given by URL (the sweep launches its own,
                one per chain), or a bad ``schedule`` section.
        """
        from eagle3.evaluate.vllm.schedule import evaluate_schedule
        from eagle3.export.provenance import check_drafter_fits, check_export
        from eagle3.target import chat_template_hash, load_tokenizer, resolve_target

        cfg, export, sc = self.cfg, inputs.export, self.cfg.schedule
        if cfg.engine.baseline_url or cfg.engine.speculative_url:
            raise Eagle3Error("mode=schedule launches one server per chain and one for the schedule; unset "
                              "engine.baseline_url / engine.speculative_url")
        if not sc.chains or min(int(k) for k in sc.chains) < 1 or int(sc.rounds) < 1:
            raise Eagle3Error(f"schedule.chains={list(sc.chains)} must list speculative token counts >= 1 (e.g. "
                              f"[3, 1]) and schedule.rounds={sc.rounds} be >= 1")
        if not sc.concurrency or min(int(c) for c in sc.concurrency) < 1:
            raise Eagle3Error(f"schedule.concurrency={list(sc.concurrency)} must list positive request counts")
        info = resolve_target(cfg.model, cfg.cache_dir)
        tokenizer = load_tokenizer(cfg.model, cfg.cache_dir, info)
        for w in inputs.warnings + check_export(export.meta, info, chat_template_hash(tokenizer)):
            log.warning(w)
        check_drafter_fits(export.arch, export.meta, info, Path(inputs.drafter_dir))
        names = benchmark_names(cfg.data)
        benchmarks = load_benchmarks(cfg, names, inputs.manifest, {})
        inputs.output_dir.mkdir(parents=True, exist_ok=True)
        return evaluate_schedule(cfg, export, info, tokenizer, benchmarks, inputs.output_dir)
