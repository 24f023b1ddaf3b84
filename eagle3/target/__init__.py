"""The target as it is served: model sources, the bf16 / INT4 builds, loading, content hash, aux-layer conventions, chat templates."""
