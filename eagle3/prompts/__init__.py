"""Prompt datasets from files shipped in packages and user files: extraction prompts, their splits, benchmarks."""

from __future__ import annotations

from eagle3.prompts.sources import (  # noqa: F401
    SHAREGPT_ROLES,
    HUMANEVAL_TEMPLATE,
    package_file,
    iter_json_array,
)
from eagle3.prompts.load import (  # noqa: F401
    SPLITS,
    FEATURES,
    split_of,
    load_conversations,
    select_for_extraction,
    load_benchmark,
)
