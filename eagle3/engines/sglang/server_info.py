"""Reading a server's ``/server_info``: the settings it runs with, and whether they fit.

``GET /server_info`` (``srt/entrypoints/http_server.py`` of SGLang) answers the
resolved server arguments as flat keys plus ``version``, ``internal_states`` (one per
DP rank) and, from 0.5.23, ``launch_command``. From it come the settings the manifest
records (:func:`static_settings`), the flags a capture server is missing
(:func:`capture_setting_problems`) and the checks that data-parallel servers are
deployed alike.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from eagle3.errors import Eagle3Error

log = logging.getLogger(__name__)


def effective_settings(info: dict) -> dict:
    """The settings a server actually runs with, from its ``/server_info`` answer.

    ``effective_max_running_requests`` is the sum over DP ranks of what each scheduler
    admits (``internal_states[i]["effective_max_running_requests_per_dp"]``), falling back
    to the resolved ``max_running_requests``; ``cuda_graph_max_bs`` is read from
    ``cuda_graph_max_bs`` (older servers), ``cuda_graph_max_bs_decode`` or
    ``cuda_graph_config.decode.max_bs`` (0.5.23), and is None on a CPU server
    (``device: "cpu"``), which reports a ``max_bs`` but captures no graphs
    (``memory_usage.graph`` all zero in its ``internal_states``).
    """
    keys = (
        "model_path", "tokenizer_path", "tp_size", "dp_size", "dtype", "quantization", "kv_cache_dtype",
        "context_length", "mem_fraction_static", "max_running_requests", "chunked_prefill_size",
        "disable_radix_cache", "enable_return_hidden_states", "speculative_algorithm",
        "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
        "speculative_num_draft_tokens", "speculative_draft_model_quantization", "max_total_num_tokens",
        "reasoning_parser", "tool_call_parser",
    )
    out: dict[str, Any] = {k: info.get(k) for k in keys if k in info}
    cg = info.get("cuda_graph_max_bs", info.get("cuda_graph_max_bs_decode"))
    if cg is None and isinstance(info.get("cuda_graph_config"), dict):
        cg = (info["cuda_graph_config"].get("decode") or {}).get("max_bs")
    if str(info.get("device") or "").lower() == "cpu":
        cg = None  # a CPU server reports a decode max_bs (32) but captures no CUDA graphs
    out["cuda_graph_max_bs"] = cg
    if "device" in info:
        out["device"] = info["device"]
    states = [s for s in (info.get("internal_states") or []) if isinstance(s, dict)]
    per_dp = [s.get("effective_max_running_requests_per_dp") for s in states]
    if per_dp and all(isinstance(v, int) for v in per_dp):
        out["effective_max_running_requests"] = int(sum(per_dp))
    else:
        out["effective_max_running_requests"] = info.get("max_running_requests")
    acc = [s.get("avg_spec_accept_length") for s in states if s.get("avg_spec_accept_length") is not None]
    if acc:
        out["avg_spec_accept_length"] = acc
    return out


#: Settings recorded in the manifest: resolved at start-up and unchanged while the server runs.
STATIC_KEYS = (
    "device", "model_path", "tokenizer_path", "tp_size", "dp_size", "dtype", "quantization", "kv_cache_dtype",
    "context_length", "max_running_requests", "cuda_graph_max_bs", "chunked_prefill_size",
    "disable_radix_cache", "enable_return_hidden_states", "speculative_algorithm",
    "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
    "speculative_draft_model_quantization",
)


def static_settings(info: dict) -> dict:
    """The subset of :func:`effective_settings` fixed at start-up (what the manifest
    records; the scheduler's memory-dependent capacity and live counters are left out)."""
    eff = effective_settings(info)
    return {k: eff[k] for k in STATIC_KEYS if k in eff}


def server_version(info: dict) -> str | None:
    """The SGLang version a ``/server_info`` answer reports (``version``), or None."""
    v = info.get("version")
    return str(v) if v is not None else None


def capture_setting_problems(info: dict, max_length: int | None = None) -> list[str]:
    """The flags a server at ``info`` is missing for capture (empty when it is fine).

    Settings a server does not report are not held against it.
    """
    problems = []
    algo = info.get("speculative_algorithm")
    if "speculative_algorithm" in info and (algo is None or str(algo).upper() != "EAGLE3"):
        problems.append("--speculative-algorithm EAGLE3 --speculative-draft-model-path <a drafter for this target>")
    if "enable_return_hidden_states" in info and not info["enable_return_hidden_states"]:
        problems.append("--enable-return-hidden-states")
    if "disable_radix_cache" in info and not info["disable_radix_cache"]:
        problems.append("--disable-radix-cache")
    cps = info.get("chunked_prefill_size")
    if isinstance(cps, int) and cps > 0 and (max_length is None or cps < max_length):
        problems.append("--chunked-prefill-size -1")
    return problems


def _warn_if_other_model(url: str, info: dict, model_cfg: Any) -> None:
    """Log a warning when the server's ``model_path`` does not look like ``model.source``
    (a server may load the same checkpoint from another folder, so this cannot be an error)."""
    served = info.get("model_path")
    if not served:
        return
    want = os.path.basename(str(model_cfg.source).rstrip("/")).lower()
    if want and want not in str(served).lower():
        log.warning("the SGLang server at %s serves %s, but model.source is %s; is it the configured target?",
                    url, served, model_cfg.source)


def _check_same_deployment(urls: list[str], infos: list[dict]) -> None:
    """Data-parallel servers must serve the same model the same way.

    Raises:
        Eagle3Error: a server's version or :func:`static_settings` differ from the
            first one's (the message lists the keys).
    """
    ref = (server_version(infos[0]), static_settings(infos[0]))
    for url, inf in zip(urls[1:], infos[1:]):
        other = (server_version(inf), static_settings(inf))
        if other != ref:
            diff = sorted(k for k in set(ref[1]) | set(other[1]) if ref[1].get(k) != other[1].get(k))
            if ref[0] != other[0]:
                diff.insert(0, "version")
            raise Eagle3Error(
                f"the SGLang server at {url} differs from {urls[0]} in {diff}; "
                "data-parallel extraction needs identically deployed servers in engine.urls"
            )
