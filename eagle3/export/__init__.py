"""Drafter exports in the formats servers load (SGLang, vLLM, and vLLM through speculators), and reading them back."""

from __future__ import annotations

from eagle3.export.files import (  # noqa: F401
    META_FILE,
    DTYPES,
    CONVENTION_FIELD,
    CONVENTIONS,
    export_convention,
    check_convention,
)
from eagle3.export.sglang import (  # noqa: F401
    sglang_config,
    sglang_state_dict,
    write_eagle3_export,
    export_sglang,
    load_sglang_export,
)
from eagle3.export.validate import (  # noqa: F401
    SGLANG_ARCHITECTURE,
    ExportFiles,
    SGLangExport,
    arch_from_sglang_config,
    check_vocab_maps,
    read_json_object,
    read_sglang_export,
)
from eagle3.export.locate import (  # noqa: F401
    ENGINE_EXPORTS,
    export_dir,
)
from eagle3.export.vllm import (  # noqa: F401
    export_vllm,
    read_vllm_export,
)
from eagle3.export.speculators import (  # noqa: F401
    speculators_available,
    to_speculators_model,
    export_speculators,
)
