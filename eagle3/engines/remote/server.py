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
  Bad input answers 400 with the message, a failure of the capture 500.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from eagle3.engines.remote.transfer import publish
from eagle3.errors import Eagle3Error

log = logging.getLogger(__name__)


def target_record(target) -> dict[str, Any]:
    """What ``GET /info`` says of the target (a :class:`eagle3.target.TargetInfo`)."""
    return {k: getattr(target, k, None) for k in ("name", "content_hash", "aux_layer_ids", "hidden_size", "vocab_size",
                                                  "quantization", "build")}


class CaptureNode:
    """An engine with ``capture`` and a Mooncake store; :meth:`handle` runs one request.

    Args:
        engine: an in-process engine (:class:`eagle3.engines.hf.engine.HFEngine`) serving ``target``.
        target: its :class:`eagle3.target.TargetInfo`.
        store: a set-up ``MooncakeHiddenStatesStore`` (:func:`eagle3.engines.remote.transfer.open_store`).
    """

    def __init__(self, engine, target, store):
        self.engine, self.target, self.store = engine, target, store
        self._lock = threading.Lock()  # one capture at a time: the engine is not thread-safe

    def info(self) -> dict[str, Any]:
        return {"engine": self.engine.info(), "target": target_record(self.target)}

    def capture(self, body: dict) -> dict[str, Any]:
        """``POST /capture``'s answer for ``body``.

        Raises:
            Eagle3Error: a malformed request (no ``request`` id, sequences that are not lists
                of ints, a bad ``top_k``) or what the engine raises for its input.
        """
        req, seqs, top_k = body.get("request"), body.get("sequences"), body.get("top_k")
        if not isinstance(req, str) or not req or "/" in req:
            raise Eagle3Error("'request' must be a non-empty id without '/'")
        if not isinstance(seqs, list) or not seqs or not all(
                isinstance(s, list) and all(isinstance(t, int) for t in s) for s in seqs):
            raise Eagle3Error("'sequences' must be a non-empty list of lists of token ids")
        if not isinstance(top_k, int):
            raise Eagle3Error("'top_k' must be an integer")
        with self._lock:
            caps = self.engine.capture(seqs, top_k)
            return {"manifests": [publish(self.store, f"{req}/{i}", c) for i, c in enumerate(caps)]}


def _handler(node: CaptureNode):
    class Handler(BaseHTTPRequestHandler):
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
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                return self._send(200, node.capture(body if isinstance(body, dict) else {}))
            except (ValueError, Eagle3Error) as e:
                return self._send(400, {"error": str(e)})
            except Exception as e:  # noqa: BLE001 - the trainer retries; the node stays up
                log.exception("capture failed")
                return self._send(500, {"error": f"{type(e).__name__}: {e}"})

        def log_message(self, fmt, *args):  # quiet: one line a micro-batch otherwise
            log.debug(fmt, *args)

    return Handler


def serve(node: CaptureNode, host: str, port: int) -> ThreadingHTTPServer:
    """An HTTP server for ``node`` bound to ``host:port`` (call ``serve_forever`` on it)."""
    return ThreadingHTTPServer((host, int(port)), _handler(node))
