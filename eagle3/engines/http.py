"""What the SGLang and vLLM clients share: JSON over HTTP with retries, timeouts and server-sent events.

Every request is retried on HTTP 5xx (:data:`RETRY_STATUS`), connection errors (refused,
reset, dropped without a response), socket timeouts and malformed JSON, waiting
``backoff_s * 2**attempt`` seconds (capped at 60, with jitter) in between; HTTP 4xx is not
retried and raises :class:`~eagle3.errors.Eagle3Error` with the server's message. A request
that keeps failing raises the client's :attr:`JSONHTTPClient.unavailable` error, a
:class:`ServerUnavailable`. Streams are read as server-sent events (``data: {json}`` lines
ended by ``data: [DONE]``), the framing both servers use for ``stream=true``.
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
from typing import Any, Callable, Iterator, Optional, TypeVar

from eagle3.errors import Eagle3Error

log = logging.getLogger(__name__)

T = TypeVar("T")

#: HTTP statuses retried (raised as :class:`TransientError`); any other error status is not.
RETRY_STATUS = {500, 502, 503, 504}
#: errors of the socket and of ``http.client`` that a retry may cure
NET_ERRORS = (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError, OSError)


class TransientError(Exception):
    """A failure worth retrying: HTTP 5xx, a dropped/refused connection, a timeout or a
    truncated / malformed JSON body."""


class HTTPClientError(Exception):
    """An HTTP error status outside :data:`RETRY_STATUS` (a 4xx): not retried, and turned
    into an :class:`~eagle3.errors.Eagle3Error` with the server's message."""

    def __init__(self, code: int, text: str):
        super().__init__(f"HTTP {code}: {text}")
        self.code, self.text = code, text


class RequestRefused(Eagle3Error):
    """A server answered a request with an HTTP 4xx: the request is wrong, so the same request
    will not succeed later (online training does not retry it)."""


class ServerUnavailable(Eagle3Error):
    """A server kept failing after all retries (the request may succeed elsewhere)."""


class JSONHTTPClient:
    """The plumbing of one server's client: requests with retries, ``/health``, event streams.

    Subclasses name the server (``server_name``, used in every message), the error raised
    when retries are exhausted (``unavailable``) and may replace :meth:`loads`.

    Args:
        url: ``http://host:port`` (a trailing ``/`` is dropped).
        timeout_s: bound of every socket operation of a request (connect, each read), seconds.
        max_retries: retries after the first attempt.
        backoff_s: the first wait between attempts, seconds (doubled each time).
    """

    server_name = "HTTP"
    unavailable: type[ServerUnavailable] = ServerUnavailable

    def __init__(self, url: str, timeout_s: float = 600.0, max_retries: int = 5, backoff_s: float = 2.0):
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)

    @staticmethod
    def loads(data: bytes | str) -> Any:
        """Parse a JSON body (``json.loads``; raises ``ValueError`` when malformed)."""
        return json.loads(data)

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
            raise HTTPClientError(e.code, text) from None
        except NET_ERRORS as e:
            raise TransientError(f"{type(e).__name__} talking to {self.url}{path}: {e}") from None

    def _sleep_before(self, attempt: int) -> None:
        delay = min(60.0, self.backoff_s * (2**attempt))
        time.sleep(delay * (0.5 + random.random() / 2))

    def _with_retries(self, what: str, fn: Callable[[], T], retries: Optional[int] = None) -> T:
        retries = self.max_retries if retries is None else retries
        last: Optional[Exception] = None
        for attempt in range(retries + 1):
            if attempt:
                self._sleep_before(attempt - 1)
            try:
                return fn()
            except TransientError as e:
                last = e
                log.debug("retrying %s on %s (attempt %d): %s", what, self.url, attempt + 1, e)
            except HTTPClientError as e:
                raise RequestRefused(
                    f"the {self.server_name} server at {self.url} refused {what} with HTTP {e.code}: {e.text}"
                ) from None
        raise self.unavailable(
            f"the {self.server_name} server at {self.url} failed {what} {retries + 1} times (last error: {last}); "
            "check that it is up (its /health) and its log for errors"
        )

    def request(self, method: str, path: str, body: Any | None = None, *, retries: Optional[int] = None,
                timeout_s: Optional[float] = None, parse_json: bool = True) -> Any:
        """Send one request and return its parsed JSON body (its text when ``parse_json`` is
        False), retrying transient failures.

        Raises:
            Eagle3Error: HTTP 4xx.
            ServerUnavailable: (the client's ``unavailable``) still failing after the retries.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s

        def once():
            with self._open(method, path, body, timeout) as resp:
                try:
                    raw = resp.read()
                except NET_ERRORS as e:
                    raise TransientError(f"{type(e).__name__} reading {self.url}{path}: {e}") from None
            if not parse_json:
                return raw.decode(errors="replace")
            try:
                return self.loads(raw)
            except ValueError as e:
                raise TransientError(f"malformed JSON from {self.url}{path} ({len(raw)} bytes): {e}") from None

        return self._with_retries(f"{method} {path}", once, retries)

    def health(self, timeout_s: float = 10.0) -> bool:
        """True when ``GET /health`` answers 200 (one attempt, no retries)."""
        try:
            with self._open("GET", "/health", None, timeout_s) as resp:
                resp.read()
                return resp.status == 200
        except (TransientError, HTTPClientError):
            return False

    def events(self, path: str, body: dict) -> Iterator[Any]:
        """``POST path`` and yield each server-sent event's JSON until ``[DONE]`` or the end.

        One attempt (callers retry the whole stream, timing included). Raises
        :class:`TransientError` when reading fails or a chunk is malformed, ``Eagle3Error``
        when a chunk reports an ``error``.
        """
        resp = self._open("POST", path, body, self.timeout_s)
        try:
            while True:
                try:
                    line = resp.readline()
                except NET_ERRORS as e:
                    raise TransientError(f"{type(e).__name__} while streaming from {self.url}: {e}") from None
                if not line:
                    return
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                try:
                    chunk = self.loads(payload)
                except ValueError as e:
                    raise TransientError(f"malformed JSON chunk from {self.url}: {e}") from None
                if isinstance(chunk, dict) and "error" in chunk:
                    raise Eagle3Error(f"the {self.server_name} server at {self.url} failed a streamed request: "
                                      f"{chunk['error']}")
                yield chunk
        finally:
            resp.close()
