"""The capture node: the target in this process, captures published into a Mooncake store.

``python -m eagle3.engines.remote --port 8100 --master HOST:50051 [extract.py overrides]``
composes ``extract.py``'s config (``engine=hf`` and the overrides: ``model=``,
``engine.device=``, ``engine.capture_batch_size=``, ...), loads the target and answers:

* ``GET /health``: 200 once the target is loaded.
* ``GET /info``: ``{"engine": <the hf engine's info>, "target": {name, content_hash,
  aux_layer_ids, hidden_size, vocab_size, quantization, build}}``; the trainer refuses a
  node whose target is not the one its kept replies came from.
* ``POST /capture`` ``{"request": str, "sequences": [[int]], "top_k": int}``: one
  ``engine.capture`` call over the sequences (one micro-batch of the trainer), each
  sequence's capture put into the store as one object under ``<request>/<i>``; answers
  ``{"manifests": [...]}`` (hs-connectors' transfer manifests) once every put is visible.
  Bad input answers 400 with the message (token ids outside the vocabulary included: on a GPU
  they would end the node's CUDA context), a failed put into the store 503 (the master
  unreachable, the store full: the trainer retries), any other failure of the capture 500.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from eagle3.engines.remote.transfer import StoreError, discard, publish
from eagle3.errors import Eagle3Error

log = logging.getLogger(__name__)


def target_record(target) -> dict[str, Any]:
    """What ``GET /info`` says of the target (a :class:`eagle3.target.TargetInfo`)."""
    return {k: getattr(target, k, None) for k in ("name", "content_hash", "aux_layer_ids", "hidden_size", "vocab_size",
                                                  "quantization", "build")}


class CaptureNode:
    """An engine with ``capture`` and a Mooncake store; :meth:`capture` answers one request.

    Args:
        engine: an in-process engine (:class:`eagle3.engines.hf.engine.HFEngine`) serving ``target``.
        target: its :class:`eagle3.target.TargetInfo`.
        store: a set-up ``MooncakeHiddenStatesStore`` (:func:`eagle3.engines.remote.transfer.open_store`).
    """

    def __init__(self, engine, target, store):
        self.engine, self.target, self.store = engine, target, store
        self._lock = threading.Lock()  # one capture at a time: the engine is not thread-safe

    def info(self) -> dict[str, Any]:
        """``GET /info``'s answer: ``{"engine": the engine's info, "target": target_record(target)}``."""
        return {"engine": self.engine.info(), "target": target_record(self.target)}

    def capture(self, body: Any) -> dict[str, Any]:
        """``POST /capture``'s answer for ``body`` (the parsed JSON).

        Raises:
            Eagle3Error: a malformed request (:func:`check_request`) or what the engine raises
                for its input (HTTP 400).
            StoreError: a put into the store failed (HTTP 503: the trainer retries).
        """
        req, seqs, top_k = check_request(body, getattr(self.target, "vocab_size", None))
        with self._lock:
            caps = self.engine.capture(seqs, top_k)
            manifests: list[dict[str, Any]] = []
            try:
                for i, c in enumerate(caps):
                    manifests.append(publish(self.store, f"{req}/{i}", c))
            except StoreError:
                for m in manifests:  # no manifest of them reaches the trainer: nothing would read them
                    discard(self.store, m["handle"])
                raise
            return {"manifests": manifests}


#: the largest ``POST /capture`` body read, bytes (token ids as JSON: about 7 bytes a token)
MAX_BODY = 256 << 20
#: what a ``POST /capture`` body is, for the errors
BODY = '{"request": "<id>", "sequences": [[token ids], ...], "top_k": <int>}'


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_request(body: Any, vocab_size: Optional[int]) -> tuple[str, list[list[int]], int]:
    """``(request id, sequences, top_k)`` of a ``POST /capture`` body.

    Args:
        body: the parsed JSON.
        vocab_size: the target's vocabulary (token ids must be below it; ``top_k`` at most it).

    Raises:
        Eagle3Error: not an object; a ``request`` id that is empty, has ``/`` or is over 200
            characters; ``sequences`` not a non-empty list of lists of ints (booleans are not
            ids); an id outside ``0..vocab_size-1``; ``top_k`` not an int in ``1..vocab_size``.
    """
    if not isinstance(body, dict):
        raise Eagle3Error(f"the body of POST /capture must be a JSON object {BODY}, not {type(body).__name__}")
    req, seqs, top_k = body.get("request"), body.get("sequences"), body.get("top_k")
    if not isinstance(req, str) or not req or "/" in req or len(req) > 200:
        raise Eagle3Error("'request' must be a non-empty id of at most 200 characters without '/'")
    if not isinstance(seqs, list) or not seqs or not all(isinstance(s, list) and all(map(_is_int, s)) for s in seqs):
        raise Eagle3Error("'sequences' must be a non-empty list of lists of token ids (integers)")
    if not _is_int(top_k) or top_k < 1 or (vocab_size and top_k > vocab_size):
        raise Eagle3Error(f"'top_k' must be an integer in 1..{vocab_size or 'the vocabulary size'}, not {top_k!r}")
    if vocab_size:
        for i, s in enumerate(seqs):
            bad = next((t for t in s if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise Eagle3Error(f"sequence {i} has token id {bad}, outside this target's vocabulary 0..{vocab_size - 1}; "
                                  "send ids of the target's tokenizer")
    return req, seqs, top_k


def _read_body(handler: BaseHTTPRequestHandler) -> Any:
    """The parsed JSON body of ``handler``'s request.

    Raises:
        Eagle3Error: no or a bad ``Content-Length``, a body over :data:`MAX_BODY`, not JSON.
    """
    length = handler.headers.get("Content-Length")
    if length is None or not length.strip().isdigit():
        raise Eagle3Error(f"POST /capture needs a Content-Length header and a JSON body {BODY}")
    if int(length) > MAX_BODY:
        raise Eagle3Error(f"a POST /capture body of {int(length)} bytes is over {MAX_BODY} bytes; send fewer tokens a request")
    raw = handler.rfile.read(int(length))
    try:
        return json.loads(raw)
    except ValueError as e:
        raise Eagle3Error(f"the body of POST /capture is not JSON ({e}); send {BODY}") from None


def _handler(node: CaptureNode):
    class Handler(BaseHTTPRequestHandler):
        timeout = 120  # seconds a client may take to send its request (a stalled one frees its thread)

        def _send(self, code: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path == "/health":
                return self._send(200, {"ok": True})
            if self.path == "/info":
                return self._send(200, node.info())
            self._send(404, {"error": f"no {self.path}; GET /health, GET /info, POST /capture"})

        def do_POST(self):  # noqa: N802
            if self.path != "/capture":
                return self._send(404, {"error": f"no {self.path}; POST /capture"})
            try:
                return self._send(200, node.capture(_read_body(self)))
            except StoreError as e:
                log.warning("capture not published: %s", e)
                return self._send(503, {"error": str(e)})
            except Eagle3Error as e:
                return self._send(400, {"error": str(e)})
            except OSError as e:  # the client went away, or stalled past the timeout
                log.warning("POST /capture: %s", e)
            except Exception as e:  # noqa: BLE001 - the trainer retries; the node stays up
                log.exception("capture failed")
                return self._send(500, {"error": f"{type(e).__name__}: {e}"})

        def log_message(self, fmt, *args):  # quiet: one line a micro-batch otherwise
            log.debug(fmt, *args)

    return Handler


def serve(node: CaptureNode, host: str, port: int) -> ThreadingHTTPServer:
    """An HTTP server for ``node`` bound to ``host:port`` (call ``serve_forever`` on it).

    Raises:
        Eagle3Error: ``host:port`` cannot be listened on (:func:`listen_error`).
    """
    try:
        return ThreadingHTTPServer((host, int(port)), _handler(node))
    except OSError as e:
        raise listen_error(host, port, e) from None


def listen_error(host: str, port: int, e: OSError) -> Eagle3Error:
    """The sentence for an ``OSError`` of binding ``host:port``."""
    why = "it is in use" if e.errno == errno.EADDRINUSE else str(e)
    return Eagle3Error(f"the capture node cannot listen on {host}:{port} ({why}); pass another --port, stop what "
                       "listens there, or pass --host an address of this machine")


def check_listen(host: str, port: int) -> None:
    """Bind ``host:port`` and let it go: a port in use fails now, before the target is loaded.

    Raises:
        Eagle3Error: the port is out of range, in use, or ``host`` is not an address of this machine.
    """
    if not 0 < int(port) < 65536:
        raise Eagle3Error(f"--port {port} is out of range; pass a port in 1..65535")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server binds it
        try:
            s.bind((host, int(port)))
        except OSError as e:
            raise listen_error(host, port, e) from None
