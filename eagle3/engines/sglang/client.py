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

import http.client
import json
import logging
import random
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from eagle3.engines.sglang.protocol import _raise_if_aborted, _with_stop_token
from eagle3.errors import Eagle3Error

try:  # orjson parses the large hidden-state payloads several times faster
    import orjson as _orjson
except ImportError:  # pragma: no cover - optional
    _orjson = None

log = logging.getLogger(__name__)

T = TypeVar("T")

#: HTTP statuses retried (raised as :class:`TransientError`); any other error status is not.
RETRY_STATUS = {500, 502, 503, 504}


class TransientError(Exception):
    """A failure worth retrying: HTTP 5xx, a dropped/refused connection, a timeout or a
    truncated / malformed JSON body."""


class ServerUnavailable(Eagle3Error):
    """A server kept failing after all retries (the request may succeed elsewhere)."""


class _HTTPClientError(Exception):
    """An HTTP error status outside :data:`RETRY_STATUS` (a 4xx): not retried, and
    turned into an :class:`~eagle3.errors.Eagle3Error` with the server's message."""

    def __init__(self, code: int, text: str):
        super().__init__(f"HTTP {code}: {text}")
        self.code, self.text = code, text


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


class SGLangClient:
    """HTTP client for one SGLang server, with retries and per-request timeouts.

    Every request is retried up to ``max_retries`` times on HTTP 5xx, connection errors
    (refused, reset, dropped without a response), socket timeouts and malformed JSON,
    waiting ``backoff_s * 2**attempt`` (capped at 60 s, with jitter) in between. HTTP
    4xx is not retried: it raises :class:`Eagle3Error` with the server's message.
    ``timeout_s`` bounds every socket operation of a request (connect, each read).
    """

    def __init__(self, url: str, timeout_s: float = 600.0, max_retries: int = 5, backoff_s: float = 2.0):
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)

    # ---------------------------------------------------------------- plumbing
    def _open(self, method: str, path: str, body: Any | None, timeout: float):
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
                raise TransientError(f"HTTP {e.code} from {self.url}{path}: {text}") from None
            raise _HTTPClientError(e.code, text) from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError, OSError) as e:
            raise TransientError(f"{type(e).__name__} talking to {self.url}{path}: {e}") from None

    def _sleep_before(self, attempt: int) -> None:
        delay = min(60.0, self.backoff_s * (2**attempt))
        time.sleep(delay * (0.5 + random.random() / 2))

    def _with_retries(self, what: str, fn: Callable[[], T], retries: int | None = None) -> T:
        retries = self.max_retries if retries is None else retries
        last: Exception | None = None
        for attempt in range(retries + 1):
            if attempt:
                self._sleep_before(attempt - 1)
            try:
                return fn()
            except TransientError as e:
                last = e
                log.debug("retrying %s on %s (attempt %d): %s", what, self.url, attempt + 1, e)
            except _HTTPClientError as e:
                raise Eagle3Error(
                    f"the SGLang server at {self.url} refused {what} with HTTP {e.code}: {e.text}"
                ) from None
        raise ServerUnavailable(
            f"the SGLang server at {self.url} failed {what} {retries + 1} times "
            f"(last error: {last}); check that it is up and its log for errors"
        )

    def request(self, method: str, path: str, body: Any | None = None, *, retries: int | None = None,
                timeout_s: float | None = None, parse_json: bool = True) -> Any:
        """Send one request and return its parsed JSON body (or text if ``parse_json``
        is False), retrying transient failures.

        Raises:
            Eagle3Error: HTTP 4xx.
            ServerUnavailable: still failing after the retries.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s

        def once():
            with self._open(method, path, body, timeout) as resp:
                try:
                    raw = resp.read()
                except (http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError, OSError) as e:
                    raise TransientError(f"{type(e).__name__} reading {self.url}{path}: {e}") from None
            if not parse_json:
                return raw.decode(errors="replace")
            try:
                return _loads(raw)
            except ValueError as e:
                raise TransientError(f"malformed JSON from {self.url}{path} ({len(raw)} bytes): {e}") from None

        return self._with_retries(f"{method} {path}", once, retries)

    # ---------------------------------------------------------------- endpoints
    def health(self, timeout_s: float = 10.0) -> bool:
        """True when ``GET /health`` answers 200 (one attempt, no retries)."""
        try:
            with self._open("GET", "/health", None, timeout_s) as resp:
                resp.read()
                return resp.status == 200
        except (TransientError, _HTTPClientError):
            return False

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
            resp = self._open("POST", "/generate", body, self.timeout_s)
            try:
                while True:
                    try:
                        line = resp.readline()
                    except (http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError, OSError) as e:
                        raise TransientError(f"{type(e).__name__} while streaming from {self.url}: {e}") from None
                    if not line:
                        break
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    try:
                        chunk = _loads(payload)
                    except ValueError as e:
                        raise TransientError(f"malformed JSON chunk from {self.url}: {e}") from None
                    if isinstance(chunk, dict) and "error" in chunk:
                        raise Eagle3Error(f"the SGLang server at {self.url} failed a streamed request: {chunk['error']}")
                    ids = chunk.get("output_ids") or []
                    n = (chunk.get("meta_info") or {}).get("completion_tokens", len(ids))
                    if ttft is None and (n or chunk.get("text")):
                        ttft = time.perf_counter() - t0
                    acc.extend(ids)
                    last = chunk
            finally:
                resp.close()
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
