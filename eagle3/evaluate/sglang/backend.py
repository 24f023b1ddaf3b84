"""``engine=sglang`` as a backend: the export checked against the target, then
:func:`eagle3.evaluate.sglang.evaluation.run_sglang_evaluation` on the benchmarks."""

from __future__ import annotations

import logging

from eagle3.evaluate.base import Backend, StageInputs
from eagle3.evaluate.benchmarks import benchmark_names, load_benchmarks, prompt_settings

log = logging.getLogger("eagle3")


class SGLangBackend(Backend):
    """A baseline and a speculative SGLang server, connected or launched here."""

    name = "sglang"
    export_engine = "sglang"

    def check(self, settings) -> list[str]:
        """``engine.url`` / ``engine.urls`` are refused (two servers are compared).

        Raises:
            Eagle3Error: as :func:`eagle3.evaluate.sglang.servers.check_served_urls`.
        """
        from eagle3.evaluate.sglang.servers import check_served_urls

        check_served_urls(self.cfg.engine)
        return []

    def run(self, inputs: StageInputs) -> dict:
        """Provenance against the target (content hash, quantization, chat template), the
        benchmarks, then the servers' measurements; the report's results dict.

        Raises:
            Eagle3Error: a chat-template mismatch, benchmark problems, or as
                :func:`eagle3.evaluate.sglang.evaluation.run_sglang_evaluation`.
        """
        from eagle3.evaluate.sglang.evaluation import run_sglang_evaluation
        from eagle3.export.provenance import check_export
        from eagle3.target import chat_template_hash, load_tokenizer, resolve_target

        cfg = self.cfg
        names = benchmark_names(cfg.data)
        output_dir = inputs.output_dir
        output_dir.mkdir(parents=True, exist_ok=True)
        info = resolve_target(cfg.model, cfg.cache_dir)
        tokenizer = load_tokenizer(cfg.model, cfg.cache_dir, info)
        warnings = inputs.warnings + check_export(inputs.meta, info, chat_template_hash(tokenizer))
        for x in warnings:
            log.warning(x)
        left_out: dict = {}
        benchmarks = load_benchmarks(cfg, names, inputs.manifest, left_out)
        results = run_sglang_evaluation(cfg, benchmarks, inputs.meta, output_dir)
        results["warnings"] = warnings + list(results.get("warnings") or [])
        results.setdefault("settings", {}).update(drafter_dir=str(inputs.drafter_dir), target=cfg.model.name,
                                                  trained_on_left_out=left_out, **prompt_settings(cfg.data))
        return results
