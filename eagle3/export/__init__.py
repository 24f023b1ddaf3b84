"""Drafter exports in the formats servers load (SGLang, and vLLM through speculators), and reading them back."""

from __future__ import annotations

from eagle3.export.files import (  # noqa: F401
    META_FILE,
    DTYPES,
)
from eagle3.export.sglang import (  # noqa: F401
    SGLANG_ARCHITECTURE,
    sglang_config,
    sglang_state_dict,
    export_sglang,
    arch_from_sglang_config,
    load_sglang_export,
)
from eagle3.export.speculators import (  # noqa: F401
    speculators_available,
    to_speculators_model,
    export_speculators,
)
