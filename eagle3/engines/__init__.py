"""Engines serving the target: ``hf`` (in-process transformers), ``sglang`` and ``vllm`` (servers)."""

from __future__ import annotations

from eagle3.engines.base import Engine
from eagle3.errors import Eagle3Error

__all__ = ["Engine", "build_engine"]


def build_engine(model_cfg, engine_cfg, cache_dir, run_dir) -> Engine:
    """The engine named by ``engine_cfg.name`` serving ``model_cfg``.

    ``hf`` loads the target in this process (building its folder on first use);
    ``sglang`` connects to / launches an SGLang server (imported lazily, so the hf path
    never needs SGLang's client code); ``vllm`` generates the replies on a vLLM server
    and captures their features in process (:mod:`eagle3.engines.vllm.engine`); ``remote`` reads
    online training's features from a capture node on another host (:mod:`eagle3.engines.remote`).

    Raises:
        Eagle3Error: an unknown engine name, SGLang support missing, or what the
            engine itself raises (no server reachable, a hub-only target on hf, ...).
    """
    name = getattr(engine_cfg, "name", None)
    if name == "hf":
        from eagle3.engines.hf.engine import HFEngine

        return HFEngine.from_config(model_cfg, engine_cfg, cache_dir, run_dir)
    if name == "sglang":
        try:
            from eagle3.engines.sglang import SGLangEngine
        except ImportError as e:
            raise Eagle3Error(
                f"SGLang support is missing in this installation ({e}); use engine=hf or install eagle3 with its sglang engine"
            ) from None
        return SGLangEngine.from_config(model_cfg, engine_cfg, cache_dir, run_dir)
    if name == "vllm":
        from eagle3.engines.vllm.engine import VLLMEngine

        return VLLMEngine.from_config(model_cfg, engine_cfg, cache_dir, run_dir)
    if name == "remote":
        from eagle3.engines.remote.engine import RemoteEngine

        return RemoteEngine.from_config(model_cfg, engine_cfg, cache_dir, run_dir)
    raise Eagle3Error(f"engine '{name}' is unknown; use engine=hf, engine=sglang, engine=vllm or engine=remote")
