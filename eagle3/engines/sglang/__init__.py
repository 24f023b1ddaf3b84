"""The SGLang engine: an HTTP client, response parsing, server settings, launching a server, the bootstrap drafter."""
