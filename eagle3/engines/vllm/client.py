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

import http.client
import json
import logging
import random
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

from eagle3.errors import Eagle3Error

log = logging.getLogger(__name__)

T = TypeVar("T")

#: HTTP statuses retried; any other error status is not.
RETRY_STATUS = {500, 502, 503, 504}
_NET_ERRORS = (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError, OSError)


class _Transient(Exception):
    """HTTP 5xx, a refused/dropped connection, a timeout or a malformed body: retried."""


class _ClientError(Exception):
    """HTTP 4xx: not retried."""

    def __init__(self, code: int, text: str):
        super().__init__(f"HTTP {code}: {text}")
        self.code, self.text = code, text


class VLLMUnavailable(Eagle3Error):
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


class VLLMClient:
    """HTTP client of one vLLM server.

    Every request is retried up to ``max_retries`` times on HTTP 5xx, connection errors
    and timeouts, waiting ``backoff_s * 2**attempt`` (capped at 60 s, with jitter);
    HTTP 4xx raises :class:`Eagle3Error` with the server's message at once.
    ``timeout_s`` bounds every socket operation of a request.
    """

    def __init__(self, url: str, timeout_s: float = 600.0, max_retries: int = 3, backoff_s: float = 2.0):
        self.url = url.rstrip("/")
        self.timeout_s, self.max_retries, self.backoff_s = float(timeout_s), int(max_retries), float(backoff_s)

    def _open(self, method: str, path: str, body: Any, timeout: float):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            return urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")[:500]
            e.close()
            if e.code in RETRY_STATUS:
                raise _Transient(f"HTTP {e.code} from {self.url}{path}: {text}") from None
            raise _ClientError(e.code, text) from None
        except _NET_ERRORS as e:
            raise _Transient(f"{type(e).__name__} talking to {self.url}{path}: {e}") from None

    def _with_retries(self, what: str, fn: Callable[[], T], retries: Optional[int] = None) -> T:
        retries = self.max_retries if retries is None else retries
        last: Optional[Exception] = None
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(min(60.0, self.backoff_s * 2 ** (attempt - 1)) * (0.5 + random.random() / 2))
            try:
                return fn()
            except _Transient as e:
                last = e
                log.debug("retrying %s on %s (attempt %d): %s", what, self.url, attempt + 1, e)
            except _ClientError as e:
                raise Eagle3Error(f"the vLLM server at {self.url} refused {what} with HTTP {e.code}: {e.text}") from None
        raise VLLMUnavailable(f"the vLLM server at {self.url} failed {what} {retries + 1} times (last error: {last}); "
                              "check that it is up (its /health) and its log for errors")

    def request(self, method: str, path: str, body: Any = None, *, retries: Optional[int] = None,
                timeout_s: Optional[float] = None, parse_json: bool = True) -> Any:
        """One request; its JSON body (text when ``parse_json`` is False), transient failures retried.

        Raises:
            Eagle3Error: HTTP 4xx. VLLMUnavailable: still failing after the retries.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s

        def once():
            with self._open(method, path, body, timeout) as resp:
                try:
                    raw = resp.read()
                except _NET_ERRORS as e:
                    raise _Transient(f"{type(e).__name__} reading {self.url}{path}: {e}") from None
            if not parse_json:
                return raw.decode(errors="replace")
            try:
                return json.loads(raw)
            except ValueError as e:
                raise _Transient(f"malformed JSON from {self.url}{path} ({len(raw)} bytes): {e}") from None

        return self._with_retries(f"{method} {path}", once, retries)

    def health(self, timeout_s: float = 10.0) -> bool:
        """True when ``GET /health`` answers 200 (one attempt)."""
        try:
            with self._open("GET", "/health", None, timeout_s) as resp:
                resp.read()
                return resp.status == 200
        except (_Transient, _ClientError):
            return False

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
        resp = self._open("POST", "/v1/completions", body, self.timeout_s)
        try:
            while True:
                try:
                    line = resp.readline()
                except _NET_ERRORS as e:
                    raise _Transient(f"{type(e).__name__} while streaming from {self.url}: {e}") from None
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                try:
                    chunk = json.loads(payload)
                except ValueError as e:
                    raise _Transient(f"malformed JSON chunk from {self.url}: {e}") from None
                if "error" in chunk:
                    raise Eagle3Error(f"the vLLM server at {self.url} failed a streamed request: {chunk['error']}")
                chunks.append(chunk)
                for choice in chunk.get("choices") or []:
                    new = choice.get("token_ids") or []
                    if new and ttft is None:
                        ttft = time.perf_counter() - t0
                    ids.extend(new)
                    finish = choice.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
        finally:
            resp.close()
        latency = time.perf_counter() - t0
        if not chunks:
            raise _Transient(f"empty stream from {self.url}")
        return Completion(ids, ttft if ttft is not None else latency, latency, finish, usage, chunks)
