"""The vLLM engine: an HTTP client of its OpenAI server, its /metrics counters, launching a server, its effective settings."""

from __future__ import annotations

from eagle3.engines.vllm.client import (  # noqa: F401
    RETRY_STATUS,
    VLLMUnavailable,
    Completion,
    VLLMClient,
)
from eagle3.engines.vllm.metrics import (  # noqa: F401
    DRAFTS,
    DRAFT_TOKENS,
    ACCEPTED,
    ACCEPTED_PER_POS,
    CACHE_CONFIG_INFO,
    parse_prometheus,
    SpecCounters,
    spec_counters,
    info_labels,
)
from eagle3.engines.vllm.launch import (  # noqa: F401
    LAUNCH_MODULE,
    vllm_device,
    speculative_config,
    render_vllm_command,
    vllm_env,
    max_num_seqs_from_log,
    VLLMServer,
    start_vllm,
    launch_vllm,
)
from eagle3.engines.vllm.server_info import (  # noqa: F401
    SPEC_KEYS,
    effective_settings,
)
