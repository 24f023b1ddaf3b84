"""A loopback server that answers like vLLM's OpenAI-compatible server, for served-evaluation tests.

It speaks the parts of the API :class:`eagle3.engines.vllm.VLLMClient` uses, in vLLM 0.32's
shapes: ``GET /health``, ``GET /v1/models`` (``data[i].id``, ``max_model_len``), ``GET
/metrics`` (Prometheus text: ``vllm:cache_config_info`` and, when speculative, the
``vllm:spec_decode_*`` counters), ``GET /server_info?config_format=json`` (dev mode:
``vllm_config.scheduler_config.max_num_seqs`` and ``speculative_config``), ``POST
/reset_prefix_cache`` and ``POST /v1/completions`` (token-id prompts, ``return_token_ids``,
streamed as server-sent events with a last ``usage`` chunk, or not streamed).

Its "model" is closed-form, for tests to recompute: the reply to prompt ids ``p`` is
:func:`reply`; a speculative server counts, per request of ``n`` tokens, ``(n + 1) // 2``
verify passes of ``num_speculative_tokens`` drafts each, ``n - passes`` accepted (all at
draft position 0). Every event is recorded in order in :attr:`FakeVLLM.events`:
``("complete", prompt ids, stream)`` and ``("reset",)``.
"""

from __future__ import annotations

import json
import threading
from http.server import ThreadingHTTPServer
from typing import Optional

from loopback_http import QuietHandler


def reply(prompt: list[int], max_tokens: int, vocab: int) -> list[int]:
    """The fake's answer to ``prompt``: ``min(max_tokens, 3 + sum(prompt) % 4)`` ids, each
    ``6 + (prompt[-1] + 5 * (i + 1)) % (vocab - 6)`` (never a special token of the tiny
    ChatML tokenizer, whose ids 0-5 are special or role words)."""
    n = min(int(max_tokens), 3 + sum(prompt) % 4)
    return [6 + (prompt[-1] + 5 * (i + 1)) % (vocab - 6) for i in range(n)]


class FakeVLLM:
    """Start with :meth:`start` (returns the base URL), stop with :meth:`stop`.

    Args:
        speculative: answer as a server running EAGLE-3 (``speculative_config``, counters).
        drafter_dir: the ``speculative_config.model`` it reports.
        vocab: the tokenizer's vocabulary size (reply ids stay below it).
    """

    def __init__(self, speculative: bool, drafter_dir: Optional[str] = None, vocab: int = 512,
                 num_speculative_tokens: int = 3, max_num_seqs: int = 8, max_model_len: int = 2048):
        self.speculative, self.drafter_dir, self.vocab = speculative, drafter_dir, vocab
        self.k, self.max_num_seqs, self.max_model_len = num_speculative_tokens, max_num_seqs, max_model_len
        self.lock = threading.Lock()
        self.events: list[tuple] = []
        self.drafts = self.accepted = 0
        self.httpd: Optional[ThreadingHTTPServer] = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        fake = self

        class Handler(QuietHandler):
            def do_GET(self):
                fake.get(self)

            def do_POST(self):
                fake.post(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self.url

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None

    def completions(self, stream: Optional[bool] = None) -> list[list[int]]:
        """The prompts of the completions received, in order (only streamed / plain ones when given)."""
        return [e[1] for e in self.events if e[0] == "complete" and (stream is None or e[2] == stream)]

    # ------------------------------------------------------------------ answers
    def metrics(self) -> str:
        lines = ['vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="512"} 1.0']
        if self.speculative:
            with self.lock:
                d, a = self.drafts, self.accepted
            lines += [f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="target"}} {float(d)}',
                      f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="target"}} {float(d * self.k)}',
                      f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="target"}} {float(a)}']
            lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="target",'
                      f'position="{i}"}} {float(a if i == 0 else 0)}' for i in range(self.k)]
        return "\n".join(lines) + "\n"

    def server_info(self) -> dict:
        spec = ({"method": "eagle3", "model": self.drafter_dir, "num_speculative_tokens": self.k}
                if self.speculative else None)
        return {"vllm_config": {"scheduler_config": {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": 2048},
                                "speculative_config": spec, "model_config": {"dtype": "bfloat16", "seed": 0}}}

    def get(self, h: QuietHandler) -> None:
        if h.path == "/health":
            return h.send_text("", ctype="text/plain")
        if h.path == "/v1/models":
            return h.send_text(json.dumps({"object": "list", "data": [
                {"id": "target", "object": "model", "max_model_len": self.max_model_len}]}))
        if h.path == "/metrics":
            return h.send_text(self.metrics(), ctype="text/plain")
        if h.path == "/server_info?config_format=json":
            return h.send_text(json.dumps(self.server_info()))
        h.send_text('{"detail":"Not Found"}', 404)

    def post(self, h: QuietHandler) -> None:
        n = int(h.headers.get("Content-Length") or 0)
        body = json.loads(h.rfile.read(n)) if n else {}
        if h.path == "/reset_prefix_cache":
            with self.lock:
                self.events.append(("reset",))
            return h.send_text("", ctype="text/plain")
        if h.path != "/v1/completions":
            return h.send_text('{"detail":"Not Found"}', 404)
        prompt = [int(t) for t in body["prompt"]]
        ids = reply(prompt, int(body.get("max_tokens", 16)), self.vocab)
        finish = "length" if len(ids) == int(body.get("max_tokens", 16)) else "stop"
        with self.lock:
            self.events.append(("complete", prompt, bool(body.get("stream"))))
            if self.speculative:  # counted before the answer, so a read right after sees them
                passes = (len(ids) + 1) // 2
                self.drafts += passes
                self.accepted += len(ids) - passes
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
        if not body.get("stream"):
            return h.send_text(json.dumps({"choices": [{"index": 0, "text": "", "token_ids": ids,
                                                        "finish_reason": finish}], "usage": usage}))
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.end_headers()
        for i, t in enumerate(ids):
            chunk = {"choices": [{"index": 0, "text": "", "token_ids": [t],
                                  "finish_reason": finish if i == len(ids) - 1 else None}]}
            h.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        h.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        h.wfile.flush()
        h.close_connection = True
