"""The HTTP client of one vLLM OpenAI-compatible server, with retries and timeouts.

HTTP API, read from vLLM 0.32 (``vllm/entrypoints/``): ``GET /health`` (200 once the
engine is up), ``GET /v1/models`` (``data[i].id``, ``max_model_len``), ``GET
/metrics`` (Prometheus text, :mod:`eagle3.engines.vllm.metrics`), ``POST
/v1/completions`` (``openai/completion/protocol.py``: ``prompt`` may be a list of
token ids; vLLM's extensions ``ignore_eos``, ``return_token_ids`` (``choices[0].
token_ids``; streamed as deltas) and ``stream_options.include_usage``); and, only
when the server runs with ``VLLM_SERVER_DEV_MODE=1`` (``entrypoints/serve/dev/``),
``GET /server_info?config_format=json`` (the whole ``VllmConfig``) and ``POST
/reset_prefix_cache``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from eagle3.engines.http import RETRY_STATUS, JSONHTTPClient, ServerUnavailable, TransientError  # noqa: F401
from eagle3.errors import Eagle3Error


class VLLMUnavailable(ServerUnavailable):
    """A vLLM server kept failing after all retries."""


@dataclass
class Completion:
    """One ``/v1/completions`` request (one prompt, one choice).

    Attributes:
        output_ids: generated target token ids (``return_token_ids``).
        ttft_s: seconds from sending to the first streamed chunk with tokens (= latency
            when not streamed); latency_s: seconds to the end of the answer.
        finish_reason: ``stop`` | ``length``; usage: ``{prompt_tokens, completion_tokens, ...}``.
        raw: the non-streamed response body, or the streamed chunks (for recording).
    """

    output_ids: list[int]
    ttft_s: float
    latency_s: float
    finish_reason: Optional[str]
    usage: dict = field(default_factory=dict)
    raw: Any = None

    @property
    def completion_tokens(self) -> int:
        """``usage.completion_tokens`` (the number of output ids when the server sent no usage)."""
        return int(self.usage.get("completion_tokens", len(self.output_ids)))


class VLLMClient(JSONHTTPClient):
    """HTTP client of one vLLM server (:class:`eagle3.engines.http.JSONHTTPClient`: 5xx,
    dropped connections and timeouts retried up to ``max_retries`` times; 4xx raises
    :class:`Eagle3Error` with the server's message at once; :class:`VLLMUnavailable` when
    retries run out). ``timeout_s`` bounds every socket operation of a request.
    """

    server_name = "vLLM"
    unavailable = VLLMUnavailable

    def __init__(self, url: str, timeout_s: float = 600.0, max_retries: int = 3, backoff_s: float = 2.0):
        super().__init__(url, timeout_s, max_retries, backoff_s)

    def models(self) -> list[dict]:
        """``GET /v1/models``'s ``data``: one dict per served name (``id``, ``max_model_len``, ``root``)."""
        out = self.request("GET", "/v1/models", timeout_s=60.0)
        return list(out.get("data") or []) if isinstance(out, dict) else []

    def metrics_text(self) -> str:
        """``GET /metrics``: the Prometheus text exposition."""
        return self.request("GET", "/metrics", timeout_s=60.0, parse_json=False)

    def server_info(self) -> Optional[dict]:
        """``GET /server_info?config_format=json`` (dev mode only); None when the server lacks it."""
        try:
            out = self.request("GET", "/server_info?config_format=json", timeout_s=60.0, retries=1)
        except Eagle3Error as e:
            if "HTTP 404" in str(e):
                return None
            raise
        return out if isinstance(out, dict) else None

    def reset_prefix_cache(self) -> bool:
        """``POST /reset_prefix_cache`` (dev mode only); whether the server reset it."""
        try:
            self.request("POST", "/reset_prefix_cache", parse_json=False, retries=1, timeout_s=60.0)
            return True
        except Eagle3Error:
            return False

    def complete(self, body: dict, stream: bool = True) -> Completion:
        """``POST /v1/completions`` for one prompt, with ``return_token_ids``; timed.

        Streamed (``stream_options.include_usage``), TTFT is the time to the first chunk
        with tokens; a failure before the end retries the whole request.

        Raises:
            Eagle3Error: HTTP 4xx or an answer without token ids. VLLMUnavailable: retries exhausted.
        """
        body = dict(body, return_token_ids=True, stream=bool(stream))
        if stream:
            body["stream_options"] = {"include_usage": True}
            return self._with_retries("POST /v1/completions (stream)", lambda: self._stream_once(body))

        def once() -> Completion:
            t0 = time.perf_counter()
            out = self.request("POST", "/v1/completions", body, retries=0)
            dt = time.perf_counter() - t0
            choice = (out.get("choices") or [{}])[0]
            if choice.get("token_ids") is None:
                raise Eagle3Error(f"the vLLM server at {self.url} returned no token_ids; it needs return_token_ids "
                                  "(vLLM 0.10.2 or newer)")
            return Completion(list(choice["token_ids"]), dt, dt, choice.get("finish_reason"), out.get("usage") or {}, out)

        return self._with_retries("POST /v1/completions", once)

    def _stream_once(self, body: dict) -> Completion:
        t0 = time.perf_counter()
        ttft, ids, finish, usage, chunks = None, [], None, {}, []
        for chunk in self.events("/v1/completions", body):
            chunks.append(chunk)
            for choice in chunk.get("choices") or []:
                new = choice.get("token_ids") or []
                if new and ttft is None:
                    ttft = time.perf_counter() - t0
                ids.extend(new)
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
        latency = time.perf_counter() - t0
        if not chunks:
            raise TransientError(f"empty stream from {self.url}")
        return Completion(ids, ttft if ttft is not None else latency, latency, finish, usage, chunks)
