"""What a running vLLM server effectively runs, read back from the server itself.

* ``max_model_len``: ``GET /v1/models`` (``data[0].max_model_len``).
* the KV-cache config: the labels of ``vllm:cache_config_info`` on ``GET /metrics``
  (``block_size``, ``num_gpu_blocks`` (KV blocks, also on CPU), ``cache_dtype``, ...).
* ``max_num_seqs`` (the running-request cap) and the speculative config: vLLM exposes
  them only through ``GET /server_info?config_format=json``, which exists when the server
  runs with ``VLLM_SERVER_DEV_MODE=1`` (``entrypoints/serve/dev/server_info``): its
  ``vllm_config.scheduler_config.max_num_seqs`` and ``vllm_config.speculative_config``.
  Without it, ``max_num_seqs`` comes from the start log of a server launched here
  (``non-default args``), and otherwise stays unknown; ``max_num_seqs_source`` says which.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from eagle3.engines.vllm.client import VLLMClient
from eagle3.engines.vllm.launch import max_num_seqs_from_log
from eagle3.engines.vllm.metrics import info_labels

#: the speculative-config fields kept in the report
SPEC_KEYS = ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size")


def _from_server_info(info: Optional[dict]) -> dict:
    cfg = (info or {}).get("vllm_config")
    if not isinstance(cfg, dict):
        return {}
    out: dict = {}
    sched = cfg.get("scheduler_config") or {}
    if isinstance(sched.get("max_num_seqs"), int):
        out["max_num_seqs"] = sched["max_num_seqs"]
        out["max_num_batched_tokens"] = sched.get("max_num_batched_tokens")
    spec = cfg.get("speculative_config")
    if isinstance(spec, dict):
        out["speculative_config"] = {k: spec.get(k) for k in SPEC_KEYS if k in spec}
    model = cfg.get("model_config") or {}
    for k in ("dtype", "seed", "quantization"):
        if k in model:
            out[k] = model[k]
    return out


def effective_settings(client: VLLMClient, log_path: Optional[Path] = None) -> dict:
    """The server's effective settings: ``{max_model_len, served_model_names, cache_config,
    max_num_seqs, max_num_seqs_source ('server_info' | 'launch log' | None),
    speculative_config (None: no speculation), dtype, seed, quantization}`` as far as it exposes them.

    Raises:
        eagle3.engines.vllm.VLLMUnavailable: ``/v1/models`` or ``/metrics`` keep failing.
    """
    models = client.models()
    out: dict = {
        "max_model_len": next((m.get("max_model_len") for m in models if m.get("max_model_len")), None),
        "served_model_names": [m.get("id") for m in models],
        "cache_config": info_labels(client.metrics_text()),
        "max_num_seqs": None, "max_num_seqs_source": None, "speculative_config": None,
    }
    info = client.server_info()
    out["server_info_available"] = info is not None
    out.update(_from_server_info(info))
    if out["max_num_seqs"] is not None:
        out["max_num_seqs_source"] = "server_info"
    elif log_path is not None:
        n = max_num_seqs_from_log(Path(log_path))
        if n is not None:
            out["max_num_seqs"], out["max_num_seqs_source"] = n, "launch log"
    return out
