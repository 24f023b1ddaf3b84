"""The target as it is served: model sources, the bf16 / INT4 builds, loading, content hash, aux-layer conventions, chat templates."""

from __future__ import annotations

from eagle3.target.chat import (  # noqa: F401
    ROLES,
    validate_messages,
    render_prompt,
    chat_template_hash,
    end_of_turn_ids,
    render_conversation,
    reply_tail_ids,
    close_reply,
)
from eagle3.target.layers import (  # noqa: F401
    ARCHITECTURES,
    default_aux_layer_ids,
    resolve_aux_layer_ids,
    sglang_captured_ids,
    to_sglang_ids,
    from_sglang_ids,
    ENGINES,
    vllm_captured_ids,
    to_vllm_ids,
    to_engine_ids,
    engine_captured_ids,
)
from eagle3.target.source import (  # noqa: F401
    DTYPES,
    locate_package_file,
    dense_folder_name,
    quantized_folder_name,
)
from eagle3.target.quantize import (  # noqa: F401
    w4a16_quantization_config,
    quantize_w4a16_,
)
from eagle3.target.resolve import (  # noqa: F401
    WEIGHT_SUFFIXES,
    TargetInfo,
    content_hash,
    target_folder,
    resolve_target,
)
from eagle3.target.load import (  # noqa: F401
    load_tokenizer,
    load_target,
    load_target_embeddings,
)
