"""The SGLang engine: an HTTP client, response parsing, server settings, launching a server, the bootstrap drafter."""

from __future__ import annotations

from eagle3.engines.sglang.bootstrap import (  # noqa: F401
    CAPTURE_SPEC,
    BOOTSTRAP_DRAFT_VOCAB,
    bootstrap_arch,
    write_bootstrap_drafter,
    ensure_bootstrap_drafter,
    read_draft_aux_ids,
)
from eagle3.engines.sglang.command import (  # noqa: F401
    LAUNCH_MODULE,
    VERIFIED_FLAGS,
    sglang_available,
    probe_server_flags,
    cuda_graph_flag,
    unknown_flags,
    render_launch_command,
    resolve_model_path,
    launch_flags,
    server_device,
    CPU_MAX_TOTAL_TOKENS,
    CPU_MEM_FRACTION_STATIC,
)
from eagle3.engines.sglang.launch import (  # noqa: F401
    LaunchedServer,
    free_port,
    launch_server,
    server_env,
)
from eagle3.engines.sglang.client import (  # noqa: F401
    RETRY_STATUS,
    TransientError,
    ServerUnavailable,
    StreamResult,
    SGLangClient,
)
from eagle3.engines.sglang.server_info import (  # noqa: F401
    effective_settings,
    STATIC_KEYS,
    static_settings,
    capture_setting_problems,
    server_version,
)
from eagle3.engines.sglang.protocol import (  # noqa: F401
    output_ids_from_response,
    parse_capture,
    capture_request,
    generate_request,
)
from eagle3.engines.sglang.scheduler import (  # noqa: F401
    R,
    run_parallel,
)
from eagle3.engines.sglang.engine import (  # noqa: F401
    configured_urls,
    connect,
    SGLangEngine,
)
from eagle3.engines.sglang.cli import (  # noqa: F401
    main,
)
