"""The HTTP client of one SGLang server: requests with retries and per-request timeouts.

HTTP API, read from the SGLang sources (``python/sglang/`` of the 0.5.14 and 0.5.23
wheels; paths relative to it), ``srt/entrypoints/http_server.py``: ``GET /health``
(503 while starting), ``GET /server_info`` (``/get_server_info`` is the deprecated
older name): the resolved server arguments as flat keys plus ``version``,
``internal_states`` (one per DP rank, with ``effective_max_running_requests_per_dp``
and ``avg_spec_accept_length``) and, from 0.5.23, ``launch_command``; ``POST
/generate`` with the fields of ``GenerateReqInput`` (``srt/managers/io_struct.py``);
``POST /flush_cache``. Request bodies and the parsing of answers are
:mod:`eagle3.engines.sglang.protocol`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from eagle3.engines.http import (  # noqa: F401  (re-exported: the package's public names)
    RETRY_STATUS,
    HTTPClientError,
    JSONHTTPClient,
    ServerUnavailable,
    TransientError,
)
from eagle3.engines.sglang.protocol import _raise_if_aborted, _with_stop_token
from eagle3.errors import Eagle3Error

try:  # orjson parses the large hidden-state payloads several times faster
    import orjson as _orjson
except ImportError:  # pragma: no cover - optional
    _orjson = None

log = logging.getLogger(__name__)

def _loads(data: bytes | str) -> Any:
    if _orjson is not None:
        return _orjson.loads(data)
    return json.loads(data)


@dataclass
class StreamResult:
    """One streamed ``/generate`` request, timed as ``sglang.bench_serving`` does.

    Attributes:
        ttft_s: seconds from sending to the first chunk carrying output tokens.
        latency_s: seconds from sending to the end of the stream.
        output_ids: generated token ids.
        meta_info: the final chunk's ``meta_info``.
    """

    ttft_s: float
    latency_s: float
    output_ids: list[int]
    meta_info: dict


class SGLangClient(JSONHTTPClient):
    """HTTP client for one SGLang server, with retries and per-request timeouts
    (:class:`eagle3.engines.http.JSONHTTPClient`: 5xx, dropped connections, timeouts and
    malformed JSON retried up to ``max_retries`` times; 4xx raises :class:`Eagle3Error`
    with the server's message; :class:`ServerUnavailable` when retries run out)."""

    server_name = "SGLang"
    unavailable = ServerUnavailable

    @staticmethod
    def loads(data: bytes | str) -> Any:
        """Parse JSON with orjson when installed (the hidden-state payloads are large)."""
        return _loads(data)

    # ---------------------------------------------------------------- endpoints
    def server_info(self) -> dict:
        """``GET /server_info``, falling back to the older ``/get_server_info``."""
        try:
            return self.request("GET", "/server_info", timeout_s=60.0)
        except Eagle3Error as e:
            if "HTTP 404" not in str(e):
                raise
        return self.request("GET", "/get_server_info", timeout_s=60.0)

    def flush_cache(self) -> bool:
        """``POST /flush_cache`` (resets the radix cache and the server-wide acceptance
        counters; refused while requests run). Returns whether the server flushed."""
        try:
            self.request("POST", "/flush_cache", parse_json=False, retries=2, timeout_s=60.0)
            return True
        except Eagle3Error as e:
            log.warning("flush_cache on %s: %s", self.url, e)
            return False

    def generate(self, body: dict) -> dict:
        """Non-streaming ``POST /generate``; returns ``{"text", "output_ids", "meta_info"}``."""
        out = self.request("POST", "/generate", body)
        if not isinstance(out, dict) or "meta_info" not in out:
            raise Eagle3Error(f"the SGLang server at {self.url} answered /generate without meta_info: {str(out)[:200]}")
        _raise_if_aborted(out, self.url)
        return out

    def generate_stream(self, body: dict) -> StreamResult:
        """Streaming ``POST /generate`` (server-sent events), timed per request.

        TTFT is the time to the first chunk with output tokens; a failure before the
        end of the stream retries the whole request (and its timing).
        """
        body = dict(body, stream=True)

        def once() -> StreamResult:
            t0 = time.perf_counter()
            ttft = None
            last: dict | None = None
            acc: list[int] = []
            for chunk in self.events("/generate", body):
                ids = chunk.get("output_ids") or []
                n = (chunk.get("meta_info") or {}).get("completion_tokens", len(ids))
                if ttft is None and (n or chunk.get("text")):
                    ttft = time.perf_counter() - t0
                acc.extend(ids)
                last = chunk
            latency = time.perf_counter() - t0
            if last is None:
                raise TransientError(f"empty stream from {self.url}")
            meta = last.get("meta_info") or {}
            _raise_if_aborted(last, self.url)
            final_ids = list(last.get("output_ids") or [])
            n = meta.get("completion_tokens")
            ids = final_ids if n is None or len(final_ids) == n else acc  # cumulative or incremental
            return StreamResult(ttft if ttft is not None else latency, latency, _with_stop_token(ids, meta), meta)

        return self._with_retries("POST /generate (stream)", once)
