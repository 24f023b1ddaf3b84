"""A loopback server that answers like SGLang, for tests of the sglang engine.

It speaks the parts of SGLang's HTTP API the engine uses (``GET /health``,
``GET /server_info`` and ``/get_server_info``, ``POST /generate`` plain and streamed,
``POST /flush_cache``) in SGLang's JSON shapes: ``{"text", "output_ids", "meta_info"}``;
``meta_info.input_top_logprobs`` as ``[None, [[logprob, token_id, null] x k], ...]``;
``meta_info.hidden_states`` as ``[[prompt rows of width D]]``; speculative counters
``spec_verify_ct`` / ``spec_correct_drafts_histogram`` and friends.

Its "model" is a set of closed-form functions (below) that tests recompute independently:

* aux state of token ``tok`` at position ``pos``, aux slot ``j`` (0..2), channel ``c``:
  :func:`aux_value`, exactly representable in bf16;
* the next-token top-k after token ``tok``: :func:`topk_after`; the greedy continuation
  is its first entry;
* a response ends with ``eos_token_id`` after :func:`response_length` tokens;
* a speculative server accepts ``accept_pattern[p % len]`` drafts at verify pass ``p``.

Faults are switched on per instance (``FakeConfig``): slow start, bursts of HTTP 503,
dropped connections, malformed JSON, a wrong hidden-state width, missing
``spec_verify_ct``, a radix cache, chunked prefill and a cap on running requests (48).

Run as a module (``python -m fake_sglang --port N ...``) it serves until killed, which
is how the launcher tests stand in for ``python -m sglang.launch_server``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional


# ------------------------------------------------------------------ the fake "model"
def aux_value(tok: int, pos: int, slot: int, channel: int) -> float:
    """A multiple of 1/32 in [-1, 1): exact in bf16."""
    return ((tok * 31 + pos * 17 + slot * 7 + channel * 3) % 64 - 32) / 32.0


def topk_after(tok: int, k: int, vocab: int) -> list[tuple[float, int]]:
    """``k`` (log-prob, token id) pairs, most likely first, for the token after ``tok``."""
    out = []
    for j in range(k):
        out.append((math.log(0.5 ** (j + 1)), (tok * 7 + 3 + j * 11) % vocab))
    return out


def response_length(prompt: list[int]) -> int:
    """Tokens of the reply to ``prompt``, EOS included."""
    return 3 + sum(prompt) % 5


def greedy_reply(prompt: list[int], vocab: int, eos: int, max_new_tokens: int) -> tuple[list[int], bool]:
    """(tokens, stopped): the greedy continuation, EOS last when it fits."""
    n = response_length(prompt)
    out, last = [], prompt[-1]
    for i in range(min(n, max_new_tokens)):
        if i == n - 1:
            out.append(eos)
            return out, True
        nxt = topk_after(last, 1, vocab)[0][1]
        if nxt == eos:
            nxt = (nxt + 1) % vocab
        out.append(nxt)
        last = nxt
    return out, False


def spec_passes(n_tokens: int, pattern: list[int]) -> list[int]:
    """Accepted drafts per verify pass until ``n_tokens`` are out (each pass emits
    accepted + 1 tokens; the last pass is cut at ``n_tokens``)."""
    passes, emitted, p = [], 0, 0
    while emitted < n_tokens:
        acc = min(pattern[p % len(pattern)], n_tokens - emitted - 1)
        passes.append(acc)
        emitted += acc + 1
        p += 1
    return passes


def _logprob_of(prev: int, tok: int, vocab: int) -> float:
    """Log-prob of ``tok`` after ``prev`` under :func:`topk_after` (its top 8, else a floor)."""
    for lp, t in topk_after(prev, 8, vocab):
        if t == tok:
            return lp
    return math.log(0.5 ** 9)


def _stream_meta(meta: dict, emitted: int, first: bool) -> dict:
    """``meta_info`` of a streamed chunk before the last: the real server's keys
    (``tests/fixtures/sglang_stream_speculative.json`` records only the last chunk; the
    earlier ones carry the request's counters so far and no speculative counters)."""
    m = {k: meta[k] for k in ("id", "prompt_tokens", "weight_version", "num_retractions") if k in meta}
    m.update(finish_reason=None, reasoning_tokens=0, completion_tokens=emitted, cached_tokens=meta.get("cached_tokens", 0),
             cached_tokens_details=None, dp_rank=None)
    if first:
        m["response_sent_to_client_ts"] = time.time()
    return m


FIXTURES = Path(__file__).resolve().parent / "fixtures"


def load_fixture(name: str) -> dict:
    """``tests/fixtures/sglang_<name>.json``: ``{"note", "request", "answer"}``, recorded
    from a real server by ``tests/test_sglang_live.py``."""
    return json.loads((FIXTURES / f"sglang_{name}.json").read_text())


def recorded_server_info(speculative: bool) -> dict:
    """A deep copy of the recorded ``/server_info`` of a real EAGLE3 or plain server."""
    return json.loads(json.dumps(load_fixture("server_info_speculative" if speculative else "server_info_baseline")["answer"]))


def truncate_meta(meta: dict, rows: int = 2) -> dict:
    """``meta_info`` with the prefill block's hidden rows, the decode rows and every
    log-prob list cut to ``rows`` entries (how the fixtures are stored)."""
    m = dict(meta)
    hs = m.get("hidden_states")
    if isinstance(hs, list) and hs:
        block = hs[0] if isinstance(hs[0], list) and hs[0] and isinstance(hs[0][0], list) else None
        m["hidden_states"] = [block[:rows]] + hs[1:1 + rows] if block is not None else hs[:rows]
    for key in ("input_top_logprobs", "input_token_logprobs", "output_top_logprobs", "output_token_logprobs"):
        if isinstance(m.get(key), list):
            m[key] = m[key][:rows]
    return m


def signature(x: Any) -> Any:
    """The shape of a JSON value: dict -> {key: signature}; list -> ``["list", sorted
    distinct element signatures]``; a leaf -> its type name (int and float apart)."""
    if isinstance(x, dict):
        return {k: signature(v) for k, v in x.items()}
    if isinstance(x, list):
        sigs = {json.dumps(signature(v), sort_keys=True) for v in x}
        return ["list", [json.loads(v) for v in sorted(sigs)]]
    return type(x).__name__


# ----------------------------------------------------------------------- the server
@dataclass
class FakeConfig:
    hidden_size: int = 8
    vocab_size: int = 512
    eos_token_id: int = 2
    version: str = "0.5.23"
    model_path: str = "fake/model"
    # deployment
    speculative: bool = True  # EAGLE3 mode (capture server / speculative server)
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4
    draft_model_path: Optional[str] = "fake/drafter"
    enable_return_hidden_states: bool = True
    disable_radix_cache: bool = True
    chunked_prefill_size: int = -1
    max_running_requests: int = 128
    effective_max_running_requests: Optional[int] = None  # scheduler's cap (e.g. 48)
    cuda_graph_max_bs: int = 128
    old_api: bool = False  # only /get_server_info, flat cuda_graph_max_bs
    launch_command: Optional[list[str]] = None
    # timing
    startup_s: float = 0.0
    prefill_s: float = 0.0
    step_s: float = 0.0  # per decode step / verify pass
    accept_pattern: list[int] = field(default_factory=lambda: [2, 0, 3, 1])
    # faults on /generate, counted from the first request
    fail_5xx: int = 0
    drop: int = 0
    malformed: int = 0
    hidden_width: Optional[int] = None  # override D (e.g. H: final states only)
    missing_spec_verify_ct: bool = False
    avg_spec_accept_length: Optional[float] = None
    context_length: Optional[int] = None  # --context-length: a prompt this long or longer gets HTTP 400


class FakeSGLang:
    """Start with :meth:`start` (returns the base URL), stop with :meth:`stop`."""

    def __init__(self, cfg: FakeConfig | None = None, host: str = "127.0.0.1", port: int = 0):
        self.cfg = cfg or FakeConfig()
        self.host, self.port = host, port
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.n_generate = 0
        self.requests: list[dict] = []  # bodies of /generate requests that were answered
        self.flushes = 0
        self.seen: list[list[int]] = []  # prefixes in the fake radix cache
        self.running = 0
        self.max_seen_running = 0
        cap = self.cfg.effective_max_running_requests or self.cfg.max_running_requests
        self.slots = threading.BoundedSemaphore(cap)
        self.httpd: ThreadingHTTPServer | None = None

    # -------------------------------------------------------------- lifecycle
    def start(self) -> str:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):
                fake.handle(self, "GET")

            def do_POST(self):
                fake.handle(self, "POST")

        self.httpd = ThreadingHTTPServer((self.host, self.port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.t0 = time.monotonic()
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self.url

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    # -------------------------------------------------------------- plumbing
    @staticmethod
    def _send(h: BaseHTTPRequestHandler, code: int, body: bytes, ctype: str = "application/json") -> None:
        h.send_response(code)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _json(self, h, code: int, obj: Any) -> None:
        self._send(h, code, json.dumps(obj).encode())

    def started(self) -> bool:
        return time.monotonic() - self.t0 >= self.cfg.startup_s

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        path = h.path.split("?", 1)[0]
        body = None
        n = int(h.headers.get("Content-Length") or 0)
        if n:
            raw = h.rfile.read(n)
            try:
                body = json.loads(raw)
            except ValueError:
                return self._json(h, 400, {"error": "invalid JSON body"})
        if path in ("/health", "/health_generate"):
            return self._send(h, 200 if self.started() else 503, b"")
        if not self.started():
            return self._send(h, 503, b"")
        if path == "/server_info" and not self.cfg.old_api:
            return self._json(h, 200, self.server_info())
        if path == "/get_server_info":
            return self._json(h, 200, self.server_info())
        if path == "/flush_cache":
            with self.lock:
                self.flushes += 1
                self.seen.clear()
            return self._send(h, 200, b"Cache flushed.\n", "text/plain")
        if path == "/generate" and method == "POST":
            return self.generate(h, body or {})
        return self._json(h, 404, {"detail": "Not Found"})

    def server_info(self) -> dict:
        """The recorded ``/server_info`` of a real server in the same mode (EAGLE3 or
        plain; ``tests/fixtures/sglang_server_info_*.json``) with this fake's deployment
        written over it, so keys and types are the real server's."""
        c = self.cfg
        info = recorded_server_info(c.speculative)
        info.update({
            "model_path": c.model_path,
            "tokenizer_path": c.model_path,
            "tp_size": 1,
            "dp_size": 1,
            "dtype": "bfloat16",
            "quantization": None,
            "max_running_requests": c.max_running_requests,
            "chunked_prefill_size": c.chunked_prefill_size,
            "disable_radix_cache": c.disable_radix_cache,
            "enable_return_hidden_states": c.enable_return_hidden_states,
            "speculative_algorithm": "EAGLE3" if c.speculative else None,
            "speculative_draft_model_path": c.draft_model_path if c.speculative else None,
            "speculative_num_steps": c.num_steps if c.speculative else None,
            "speculative_eagle_topk": c.topk if c.speculative else None,
            "speculative_num_draft_tokens": c.num_draft_tokens if c.speculative else None,
            "max_total_num_tokens": 100000,
            "context_length": c.context_length,
            "version": c.version,
            "device": "cuda",
        })
        state = dict(info["internal_states"][0])
        state.update({k: v for k, v in info.items() if k in state and k != "internal_states"})
        state["effective_max_running_requests_per_dp"] = c.effective_max_running_requests or c.max_running_requests
        if c.avg_spec_accept_length is not None:
            state["avg_spec_accept_length"] = c.avg_spec_accept_length
        info["internal_states"] = [state]
        cg = dict(info["cuda_graph_config"])
        cg["decode"] = dict(cg["decode"], max_bs=c.cuda_graph_max_bs, bs=[b for b in (1, 2, 4, 8) if b <= c.cuda_graph_max_bs])
        info["cuda_graph_config"] = state["cuda_graph_config"] = cg
        if c.old_api:  # 0.5.14 and older: a flat cuda_graph_max_bs, no launch_command
            for d in (info, state):
                d.pop("cuda_graph_config", None)
                d.pop("launch_command", None)
                d["cuda_graph_max_bs"] = c.cuda_graph_max_bs
        elif c.launch_command is not None:
            info["launch_command"] = c.launch_command
        return info

    # -------------------------------------------------------------- /generate
    def _fault(self) -> Optional[str]:
        c = self.cfg
        with self.lock:
            i = self.n_generate
            self.n_generate += 1
        if i < c.fail_5xx:
            return "5xx"
        i -= c.fail_5xx
        if i < c.drop:
            return "drop"
        i -= c.drop
        if i < c.malformed:
            return "malformed"
        return None

    def generate(self, h: BaseHTTPRequestHandler, body: dict) -> None:
        c = self.cfg
        fault = self._fault()
        if fault == "5xx":
            return self._json(h, 503, {"error": "Service Unavailable (injected)"})
        if fault == "drop":
            h.close_connection = True
            try:
                h.connection.shutdown(2)
            except OSError:
                pass
            return
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            return self._json(h, 400, {"error": "input_ids required"})
        if c.context_length is not None and len(ids) >= c.context_length:  # SGLang's validate_input_length
            return self._json(h, 400, {"error": f"The input ({len(ids)} tokens) is longer than the model's context "
                                                f"length ({c.context_length} tokens)."})
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 128))
        if c.context_length is not None:  # SGLang shortens the reply to fit, silently
            max_new = min(max_new, c.context_length - len(ids) - 1)
        out_ids, stopped = greedy_reply(ids, c.vocab_size, c.eos_token_id, max_new)
        if not out_ids:
            out_ids, stopped = [], False
        k = int(body.get("top_logprobs_num") or 0)
        cached = 0
        if not c.disable_radix_cache:
            with self.lock:
                for s in self.seen:
                    m = 0
                    while m < min(len(s), len(ids) - 1) and s[m] == ids[m]:
                        m += 1
                    cached = max(cached, m)
                self.seen.append(list(ids))
        meta: dict[str, Any] = {  # the keys and order of a real answer (tests/fixtures/sglang_generate_*.json)
            "id": f"req-{self.n_generate}",
            "finish_reason": ({"type": "stop", "matched": c.eos_token_id} if stopped
                              else {"type": "length", "length": len(out_ids)}),
            "prompt_tokens": len(ids),
            "weight_version": "default",
            "num_retractions": 0,
        }
        if body.get("return_logprob"):
            start = max(0, int(body.get("logprob_start_len", -1)))
            prev = [ids[-1]] + out_ids[:-1]
            meta["input_token_logprobs"] = [
                [None if i == 0 else _logprob_of(ids[i - 1], ids[i], c.vocab_size), ids[i], None]
                for i in range(start, len(ids))]
            meta["output_token_logprobs"] = [[_logprob_of(p, t, c.vocab_size), t, None] for p, t in zip(prev, out_ids)]
            meta["output_token_logprobs_length"] = len(out_ids)
            if k > 0:
                meta["input_top_logprobs"] = [
                    None if i == 0 else [[lp, t, None] for lp, t in topk_after(ids[i - 1], k, c.vocab_size)]
                    for i in range(start, len(ids))]
                meta["output_top_logprobs"] = [[[lp, t, None] for lp, t in topk_after(p, k, c.vocab_size)] for p in prev]
        meta.update(reasoning_tokens=0, completion_tokens=len(out_ids), cached_tokens=cached,
                    cached_tokens_details={"device": cached, "host": 0} if cached else None)
        if body.get("return_hidden_states") and c.enable_return_hidden_states:
            H = c.hidden_size
            width = c.hidden_width if c.hidden_width is not None else (3 * H if c.speculative else H)
            first = cached
            if c.chunked_prefill_size > 0 and len(ids) - cached > c.chunked_prefill_size:
                rem = (len(ids) - cached) % c.chunked_prefill_size
                first = len(ids) - (rem or c.chunked_prefill_size)
            seq = ids + out_ids

            def row(pos: int) -> list[float]:
                r = [aux_value(seq[pos], pos, j, ch) for j in range(3) for ch in range(H)]
                return (r + [0.0] * width)[:width]

            # the prefill block, then one row per decoded token but the last (whose
            # forward pass never runs), as a real server answers
            meta["hidden_states"] = [[row(pos) for pos in range(first, len(ids))]] + [
                row(pos) for pos in range(len(ids), len(seq) - 1)]
        meta.update(dp_rank=None, e2e_latency=0.0)
        # the first token comes from the prefill, the others from verify passes (a real
        # server reports no spec_* counters for a one-token answer)
        spec = c.speculative and not c.missing_spec_verify_ct and len(out_ids) > 1
        passes = spec_passes(len(out_ids) - 1, c.accept_pattern) if c.speculative else [0] * max(0, len(out_ids) - 1)
        if spec:
            hist = [0] * (max(passes) + 1)
            for a in passes:
                hist[a] += 1
            proposed = len(passes) * (c.num_draft_tokens - 1)
            meta.update(
                spec_accept_rate=sum(passes) / proposed if proposed else 0.0,
                spec_accept_length=len(out_ids) / len(passes),
                spec_num_correct_drafts=sum(passes),
                spec_num_proposed_drafts=proposed,
                spec_verify_ct=len(passes),
                spec_accepted_drafts=sum(passes),
                spec_proposed_drafts=proposed,
                spec_correct_drafts_histogram=hist,
                spec_accept_histogram=list(hist),
            )
        meta["response_sent_to_client_ts"] = time.time()
        text = " ".join(f"t{t}" for t in out_ids)
        if body.get("stream"):
            with self.lock:
                self.requests.append(body)
            return self._stream(h, out_ids, passes, meta)
        with self.slots:
            self._enter()
            try:
                time.sleep(c.prefill_s + c.step_s * len(passes))
            finally:
                self._leave()
        if fault == "malformed":
            raw = json.dumps({"text": text, "output_ids": out_ids, "meta_info": meta}).encode()
            return self._send(h, 200, raw[: max(1, len(raw) // 2)])
        with self.lock:
            self.requests.append(body)
        return self._json(h, 200, {"text": text, "output_ids": out_ids, "meta_info": meta})

    def _enter(self):
        with self.lock:
            self.running += 1
            self.max_seen_running = max(self.max_seen_running, self.running)

    def _leave(self):
        with self.lock:
            self.running -= 1

    def _stream(self, h, out_ids: list[int], passes: list[int], meta: dict) -> None:
        """Server-sent events: a chunk for the prefill's token, then one per verify pass
        (per token without spec), cumulative ``text``/``output_ids``, the full
        ``meta_info`` on the last chunk (the real server's shapes)."""
        c = self.cfg
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True
        with self.slots:
            self._enter()
            try:
                time.sleep(c.prefill_s)
                emitted = 0
                emits = ([1] if out_ids else []) + [acc + 1 for acc in passes]  # the prefill's token, then the passes
                for p, n in enumerate(emits):
                    if p:
                        time.sleep(c.step_s)
                    emitted += n
                    last = p == len(emits) - 1
                    m = _stream_meta(meta, emitted, first=p == 0)
                    if last:  # the full meta_info, without the first chunk's timestamp
                        m = {k: v for k, v in meta.items() if k != "response_sent_to_client_ts" or p == 0}
                    chunk = {"text": " ".join(f"t{t}" for t in out_ids[:emitted]), "output_ids": out_ids[:emitted], "meta_info": m}
                    h.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    h.wfile.flush()
                h.wfile.write(b"data: [DONE]\n\n")
                h.wfile.flush()
            finally:
                self._leave()


# ------------------------------------------------------------------ as a process
FLAGS = [
    "--model-path", "--tp-size", "--tensor-parallel-size", "--trust-remote-code", "--tool-call-parser",
    "--reasoning-parser", "--tokenizer-path", "--revision", "--context-length", "--mem-fraction-static",
    "--language-only", "--host", "--port", "--max-running-requests", "--cuda-graph-max-bs-decode",
    "--chunked-prefill-size", "--speculative-algorithm", "--speculative-draft-model-path",
    "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens",
    "--enable-return-hidden-states", "--disable-radix-cache", "--device", "--disable-overlap-schedule",
    "--max-total-tokens",
]


def main(argv: list[str] | None = None) -> None:
    """``python -m sglang.launch_server``-like entry: parses the flags the launcher
    renders, prints a few log lines, waits ``FAKE_SGLANG_STARTUP_S``, serves. With
    ``FAKE_SGLANG_EXIT=<code>`` it prints an error and exits instead."""
    import os

    p = argparse.ArgumentParser(prog="sglang.launch_server")
    p.add_argument("--model-path", required=True)
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--cuda-graph-max-bs-decode", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--enable-return-hidden-states", action="store_true")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    for f in ("--tool-call-parser", "--reasoning-parser", "--tokenizer-path", "--revision",
              "--context-length", "--mem-fraction-static"):
        p.add_argument(f, default=None)
    p.add_argument("--language-only", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--max-total-tokens", type=int, default=None)
    args = p.parse_args(argv)
    print(f"[fake] server_args: {vars(args)}", flush=True)
    code = os.environ.get("FAKE_SGLANG_EXIT")
    if code:
        print("[fake] RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.", flush=True)
        sys.exit(int(code))
    spec = args.speculative_algorithm == "EAGLE3"
    mrr = args.max_running_requests
    if mrr is None and spec:
        print("[fake] Max running requests is reset to 48 for speculative decoding.", flush=True)
        mrr = 48
    cfg = FakeConfig(
        hidden_size=int(os.environ.get("FAKE_SGLANG_HIDDEN", "8")),
        vocab_size=int(os.environ.get("FAKE_SGLANG_VOCAB", "512")),
        model_path=args.model_path,
        speculative=spec,
        num_steps=args.speculative_num_steps or 3,
        topk=args.speculative_eagle_topk or 1,
        num_draft_tokens=args.speculative_num_draft_tokens or 4,
        draft_model_path=args.speculative_draft_model_path,
        enable_return_hidden_states=args.enable_return_hidden_states,
        disable_radix_cache=args.disable_radix_cache,
        chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=mrr or 128,
        cuda_graph_max_bs=args.cuda_graph_max_bs_decode or 128,
        launch_command=["python", "-m", "sglang.launch_server"] + list(argv if argv is not None else sys.argv[1:]),
    )
    startup = float(os.environ.get("FAKE_SGLANG_STARTUP_S", "0"))
    for i in range(int(startup / 0.2)):
        print(f"[fake] Load weight step {i}", flush=True)
        time.sleep(0.2)
    srv = FakeSGLang(cfg, host=args.host, port=args.port)
    srv.start()
    print(f"[fake] The server is fired up and ready to roll! {srv.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        srv.stop()


def help_text() -> str:
    return "usage: sglang.launch_server [options]\n" + "\n".join(f"  {f} VALUE" for f in FLAGS) + "\n"


if __name__ == "__main__":
    if "--help" in sys.argv[1:]:
        print(help_text())
        sys.exit(0)
    main()


# ------------------------------------------------------------------ a tiny chat tokenizer
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def write_tiny_chat_tokenizer(folder, vocab_size: int = 512) -> str:
    """A word-level ChatML tokenizer whose ids all lie below ``vocab_size``: 0 ``<unk>``,
    1 ``<|im_start|>``, 2 ``<|im_end|>`` (EOS, the fake server's default), 3 ``user``,
    4 ``assistant``, 5 ``system``, then words ``w6 .. w{vocab_size-1}``."""
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
    words += [f"w{i}" for i in range(len(words), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|im_end|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHATML
    Path(folder).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return str(folder)


def write_launch_shim(folder) -> str:
    """A ``sglang`` package in ``folder`` whose ``launch_server`` runs this fake (put
    ``folder`` on ``PYTHONPATH``); ``--help`` lists :data:`FLAGS`."""
    from pathlib import Path

    pkg = Path(folder) / "sglang"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "import fake_sglang\n"
        "if '--help' in sys.argv[1:]:\n"
        "    print(fake_sglang.help_text())\n"
        "    sys.exit(0)\n"
        "fake_sglang.main(sys.argv[1:])\n"
    )
    return str(folder)
