"""The evaluate stage: one backend per engine (:mod:`eagle3.evaluate.base`) chosen here.

``hf``: :mod:`eagle3.evaluate.inprocess`; ``sglang``: :mod:`eagle3.evaluate.sglang`;
``vllm``: :mod:`eagle3.evaluate.vllm`; shared: :mod:`eagle3.evaluate.benchmarks`,
:mod:`eagle3.evaluate.measures`, :mod:`eagle3.evaluate.metrics`, :mod:`eagle3.evaluate.report`.
"""

from __future__ import annotations

from eagle3.errors import Eagle3Error


def build_backend(cfg):
    """The evaluation backend named by ``cfg.engine.name`` (default ``hf``) for the
    ``EvaluateConfig`` ``cfg`` (:class:`eagle3.evaluate.base.Backend`; imported lazily, so
    the hf path never loads server clients).

    Raises:
        Eagle3Error: an engine that cannot evaluate.
    """
    name = getattr(cfg.engine, "name", "hf")
    if name == "hf":
        from eagle3.evaluate.inprocess.backend import InProcessBackend

        return InProcessBackend(cfg)
    if name == "sglang":
        from eagle3.evaluate.sglang.backend import SGLangBackend

        return SGLangBackend(cfg)
    if name == "vllm":
        from eagle3.evaluate.vllm.backend import VLLMBackend

        return VLLMBackend(cfg)
    raise Eagle3Error(f"engine '{name}' cannot evaluate; use engine=hf, engine=sglang or engine=vllm")
