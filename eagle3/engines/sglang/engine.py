"""SGLang engine: regenerate and capture through a live SGLang deployment.

The engine either connects to running servers (``engine.url`` / ``engine.urls``) or
launches one (``python -m sglang.launch_server``) with every setting rendered as an
explicit flag. It never patches SGLang: aux hidden states come out of a stock server
started in EAGLE3 mode with a randomly initialised *bootstrap drafter* for this target,
because only in that mode does the target capture the three aux layers and return them
through ``return_hidden_states``.

What this module relies on, read from the SGLang sources (``python/sglang/`` of the
0.5.14 and 0.5.23 wheels; paths relative to it):

* Server flags (``srt/server_args.py`` and, from 0.5.14 on, the dataclass fields in
  ``srt/arg_groups/fields/*.py`` whose names become ``--field-name``):
  ``--model-path``, ``--tp-size`` (``--tp`` is argparse's unique-prefix abbreviation of
  it, the spelling of Kimi's own deployment guide), ``--trust-remote-code``,
  ``--tool-call-parser``, ``--reasoning-parser``, ``--host``, ``--port``,
  ``--max-running-requests``, ``--chunked-prefill-size``, ``--disable-radix-cache``,
  ``--enable-return-hidden-states``, ``--context-length``, ``--mem-fraction-static``,
  ``--language-only``, ``--tokenizer-path``, ``--revision``, ``--speculative-algorithm``,
  ``--speculative-draft-model-path``, ``--speculative-num-steps``,
  ``--speculative-eagle-topk``, ``--speculative-num-draft-tokens``.
  The CUDA-graph batch cap is ``--cuda-graph-max-bs`` up to 0.5.14 (where it is already
  a deprecated alias of ``--cuda-graph-max-bs-decode``) and only
  ``--cuda-graph-max-bs-decode`` in 0.5.23; the launcher asks the installed server's
  ``--help`` which one it has (:func:`probe_server_flags`).
* HTTP API (``srt/entrypoints/http_server.py``): ``GET /health`` (503 while starting),
  ``GET /server_info`` (``/get_server_info`` is the deprecated older name): the resolved
  server arguments as flat keys plus ``version``, ``internal_states`` (one per DP rank,
  with ``effective_max_running_requests_per_dp`` and ``avg_spec_accept_length``) and,
  from 0.5.23, ``launch_command``; ``POST /generate`` with the fields of
  ``GenerateReqInput`` (``srt/managers/io_struct.py``); ``POST /flush_cache``.
* Response shapes (``srt/managers/tokenizer_manager.py``): ``{"text", "output_ids",
  "meta_info"}``. ``meta_info["input_top_logprobs"][i]`` is the top-k of the
  distribution of input token ``i`` given tokens ``< i`` (``None`` for ``i = 0``), each
  entry a ``[logprob, token_id, text-or-null]`` triple; ``output_top_logprobs[j]`` is
  the same for generated token ``j``. ``meta_info["hidden_states"]`` holds one block of
  ``[prompt_len][D]`` rows for the prefill, then one ``[D]`` row per decoded token;
  in EAGLE3 mode ``D = 3H``, the aux states concatenated in layer order
  (``srt/layers/logits_processor.py``, ``srt/layers/aux_hidden_states.py``).
  With greedy sampling the returned log-probs are the raw ``log_softmax`` of the
  logits (``srt/layers/sampler.py``).

Position convention (see docs/design.md): capture position ``t`` holds the aux states
at token ``t`` and the distribution of token ``t + 1``. So row ``t`` of the top-k comes
from ``input_top_logprobs[t + 1]`` for ``t < T - 1`` and, for the last position, from
``output_top_logprobs[0]`` of the single generated token.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import queue
import random
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch

from eagle3.errors import Eagle3Error
from eagle3.features import Capture
from eagle3.target import to_sglang_ids

try:  # the shared interface; a structural stand-in keeps this module importable alone
    from eagle3.engines.base import Engine
except ImportError:  # pragma: no cover - only while the base module does not exist yet
    import abc

    class Engine(abc.ABC):  # type: ignore[no-redef]
        """Stand-in for ``eagle3.engines.base.Engine``."""

try:  # orjson parses the large hidden-state payloads several times faster
    import orjson as _orjson
except ImportError:  # pragma: no cover - optional
    _orjson = None

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

LAUNCH_MODULE = "sglang.launch_server"
#: Every flag the launcher may render, with where it is defined in SGLang (0.5.14 and
#: 0.5.23 wheels). ``--tp`` is argparse's abbreviation of ``--tp-size``.
VERIFIED_FLAGS = {
    "--model-path": "srt/arg_groups/fields/model.py (model_path)",
    "--tp-size": "srt/arg_groups/fields/parallel.py (tp_size)",
    "--trust-remote-code": "srt/arg_groups/fields/model.py (trust_remote_code)",
    "--tool-call-parser": "srt/server_args.py (ServerArgs.add_cli_args)",
    "--reasoning-parser": "srt/server_args.py (ServerArgs.add_cli_args)",
    "--tokenizer-path": "srt/arg_groups/fields/serving.py (tokenizer_path)",
    "--revision": "srt/arg_groups/fields/model.py (revision)",
    "--context-length": "srt/arg_groups/fields/model.py (context_length)",
    "--mem-fraction-static": "srt/arg_groups/fields/schedule.py (mem_fraction_static)",
    "--language-only": "srt/arg_groups/fields/disagg.py (language_only)",
    "--host": "srt/arg_groups/fields/serving.py (host)",
    "--port": "srt/arg_groups/fields/serving.py (port)",
    "--max-running-requests": "srt/arg_groups/fields/schedule.py (max_running_requests)",
    "--chunked-prefill-size": "srt/arg_groups/fields/schedule.py (chunked_prefill_size)",
    "--cuda-graph-max-bs": "srt/server_args.py <= 0.5.14 (deprecated alias of --cuda-graph-max-bs-decode)",
    "--cuda-graph-max-bs-decode": "srt/arg_groups/fields/exec_.py (cuda_graph_max_bs_decode), 0.5.14+",
    "--disable-radix-cache": "srt/arg_groups/fields/memory.py (disable_radix_cache)",
    "--enable-return-hidden-states": "srt/arg_groups/fields/exec_.py (enable_return_hidden_states)",
    "--speculative-algorithm": "srt/arg_groups/fields/spec.py (speculative_algorithm)",
    "--speculative-draft-model-path": "srt/arg_groups/fields/spec.py (speculative_draft_model_path)",
    "--speculative-num-steps": "srt/arg_groups/fields/spec.py (speculative_num_steps)",
    "--speculative-eagle-topk": "srt/arg_groups/fields/spec.py (speculative_eagle_topk)",
    "--speculative-num-draft-tokens": "srt/arg_groups/fields/spec.py (speculative_num_draft_tokens)",
}
#: Minimal speculative settings for the capture server: the bootstrap drafter only has
#: to exist so the target runs in EAGLE3 mode; one chain step keeps its overhead small.
CAPTURE_SPEC = {"num_steps": 1, "topk": 1, "num_draft_tokens": 2}
#: Draft vocabulary of the bootstrap drafter (its lm_head is never trained).
BOOTSTRAP_DRAFT_VOCAB = 4096
RETRY_STATUS = {500, 502, 503, 504}


# =============================================================================== errors
class TransientError(Exception):
    """A failure worth retrying: HTTP 5xx, a dropped/refused connection, a timeout or a
    truncated / malformed JSON body."""


class ServerUnavailable(Eagle3Error):
    """A server kept failing after all retries (the request may succeed elsewhere)."""


# =============================================================================== client
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


class _HTTPClientError(Exception):
    def __init__(self, code: int, text: str):
        super().__init__(f"HTTP {code}: {text}")
        self.code, self.text = code, text


def _raise_if_aborted(out: dict, url: str) -> None:
    reason = (out.get("meta_info") or {}).get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        raise Eagle3Error(f"the SGLang server at {url} aborted a request: {reason.get('message', reason)}")


def _with_stop_token(output_ids: list[int], meta_info: dict) -> list[int]:
    """Generated ids ending with the matched stop token (the engine contract keeps the
    EOS / end-of-turn token). SGLang reports it as ``finish_reason.matched``."""
    ids = [int(i) for i in output_ids]
    reason = meta_info.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "stop":
        matched = reason.get("matched")
        if isinstance(matched, int) and not isinstance(matched, bool) and (not ids or ids[-1] != matched):
            ids.append(matched)
    return ids


def output_ids_from_response(out: dict) -> list[int]:
    """Generated token ids of a non-streamed ``/generate`` answer, stop token included."""
    return _with_stop_token(list(out.get("output_ids") or []), out.get("meta_info") or {})


# ============================================================================ parallel
def run_parallel(
    clients: Sequence[SGLangClient],
    items: Sequence[T],
    fn: Callable[[SGLangClient, T], R],
    concurrency: int,
    desc: str = "requests",
    progress: bool = True,
) -> list[R]:
    """Apply ``fn(client, item)`` to every item, ``concurrency`` requests at a time per
    server, data-parallel over ``clients``; results come back in item order.

    Items are taken from one shared queue, so each is processed exactly once. A server
    that raises :class:`ServerUnavailable` is dropped and its item handed to the others;
    any other error stops the run and is raised.

    Raises:
        ServerUnavailable: every server failed.
        Eagle3Error: a request failed for a reason retrying elsewhere cannot fix.
    """
    from tqdm.auto import tqdm

    n = len(items)
    results: list[Any] = [None] * n
    if n == 0:
        return []
    todo: queue.Queue[int] = queue.Queue()
    for i in range(n):
        todo.put(i)
    lock = threading.Lock()
    state = {"done": 0, "alive": len(clients), "error": None, "unavailable": []}
    stop = threading.Event()
    bar = tqdm(total=n, desc=desc, disable=not progress, leave=False)
    dead: set[int] = set()

    def worker(ci: int) -> None:
        client = clients[ci]
        while not stop.is_set():
            if ci in dead:
                return
            try:
                i = todo.get(timeout=0.05)
            except queue.Empty:
                with lock:
                    if state["done"] >= n:
                        return
                continue
            try:
                r = fn(client, items[i])
            except ServerUnavailable as e:
                todo.put(i)
                with lock:
                    if ci not in dead:
                        dead.add(ci)
                        state["alive"] -= 1
                        state["unavailable"].append(str(e))
                        log.warning("dropping %s from the pool: %s", client.url, e)
                        if state["alive"] == 0:
                            state["error"] = e
                            stop.set()
                return
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                with lock:
                    if state["error"] is None:
                        state["error"] = e
                stop.set()
                return
            results[i] = r
            with lock:
                state["done"] += 1
                if state["done"] >= n:
                    stop.set()
            bar.update(1)

    threads = [
        threading.Thread(target=worker, args=(ci,), daemon=True, name=f"sglang-{ci}-{k}")
        for ci in range(len(clients))
        for k in range(max(1, int(concurrency)))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    if state["error"] is not None:
        raise state["error"]
    if state["done"] != n:  # pragma: no cover - defensive
        raise Eagle3Error(f"only {state['done']} of {n} {desc} finished")
    return results


# ============================================================================ capture
def _block_of_prompt_rows(hidden_states: Any) -> list:
    """The prefill rows of ``meta_info["hidden_states"]`` (``[[rows...], row, row...]``
    in SGLang; a flat list of rows is accepted too)."""
    if not isinstance(hidden_states, list) or not hidden_states:
        return []
    first = hidden_states[0]
    if isinstance(first, list) and first and isinstance(first[0], list):
        return first
    return hidden_states


def _topk_row(entry: Any, top_k: int, where: str) -> tuple[list[int], list[float]]:
    if not isinstance(entry, list) or len(entry) < top_k:
        got = "nothing" if not isinstance(entry, list) else f"{len(entry)} entries"
        raise Eagle3Error(
            f"{where} has {got} where {top_k} top log-probs were requested; "
            "send top_logprobs_num equal to capture.top_k (and the target vocabulary must have that many tokens)"
        )
    pairs = sorted(((float(e[0]), int(e[1])) for e in entry[:top_k]), key=lambda p: -p[0])
    return [p[1] for p in pairs], [p[0] for p in pairs]


def parse_capture(out: dict, input_ids: Sequence[int], hidden_size: int, top_k: int, url: str = "the server") -> Capture:
    """Turn one capture answer of SGLang into a :class:`~eagle3.features.store.Capture`.

    Args:
        out: the ``/generate`` answer for ``input_ids`` sent with ``max_new_tokens=1``,
            ``return_hidden_states``, ``return_logprob``, ``logprob_start_len=0`` and
            ``top_logprobs_num=top_k``.
        input_ids: the ``T`` tokens sent.
        hidden_size: the target's ``H``.

    Returns:
        Capture with ``aux_hidden_states [T, 3, H]`` bf16, ``topk_ids [T, k]`` int32 and
        ``topk_logprobs [T, k]`` float32; row ``t`` is the distribution of token ``t+1``
        (``input_top_logprobs[t+1]``; the last row from ``output_top_logprobs[0]``).

    Raises:
        Eagle3Error: the width is not ``3H`` or the row count is not ``T`` (each message
            names the server setting to fix), or log-probs are missing.
    """
    meta = out.get("meta_info") or {}
    T = len(input_ids)
    if "hidden_states" not in meta:
        raise Eagle3Error(
            f"{url} returned no hidden_states; start the server with --enable-return-hidden-states "
            "(and --speculative-algorithm EAGLE3 with a drafter for this target)"
        )
    rows = _block_of_prompt_rows(meta["hidden_states"])
    cached = int(meta.get("cached_tokens") or 0)
    if not rows:
        raise Eagle3Error(
            f"{url} returned no hidden-state rows for a {T}-token sequence ({cached} tokens served from cache); "
            "start the server with --disable-radix-cache and --chunked-prefill-size -1"
        )
    width = len(rows[0]) if isinstance(rows[0], list) else 0
    if width != 3 * hidden_size:
        if width == hidden_size:
            hint = ("these are the final hidden states, not the aux states: start the server with "
                    "--speculative-algorithm EAGLE3 and a drafter whose config lists three aux layers")
        else:
            hint = ("the server's target is not this model (check model.hidden_size and --model-path) "
                    "or its drafter config does not list exactly three aux layers")
        raise Eagle3Error(f"{url} returned hidden states of width {width}, expected 3 x {hidden_size} = {3 * hidden_size}; {hint}")
    if len(rows) != T:
        raise Eagle3Error(
            f"{url} returned {len(rows)} hidden-state rows for a {T}-token sequence "
            f"({cached} tokens served from cache); start the server with --disable-radix-cache and "
            "--chunked-prefill-size -1 (or a chunk size above capture.max_length) so one prefill covers every token"
        )
    if cached:
        raise Eagle3Error(
            f"{url} served {cached} of {T} tokens from its radix cache, whose hidden states are not recomputed; "
            "start the server with --disable-radix-cache"
        )
    inp = meta.get("input_top_logprobs")
    outp = meta.get("output_top_logprobs")
    if not isinstance(inp, list) or len(inp) != T or not isinstance(outp, list) or not outp:
        n_in = len(inp) if isinstance(inp, list) else "no"
        raise Eagle3Error(
            f"{url} returned {n_in} input top log-prob rows for {T} tokens; send return_logprob, "
            "logprob_start_len=0 and top_logprobs_num (sglang versions without input top log-probs cannot capture)"
        )
    ids = torch.empty(T, top_k, dtype=torch.int32)
    lps = torch.empty(T, top_k, dtype=torch.float32)
    for t in range(T - 1):
        i, lp = _topk_row(inp[t + 1], top_k, f"{url} input_top_logprobs[{t + 1}]")
        ids[t] = torch.tensor(i, dtype=torch.int32)
        lps[t] = torch.tensor(lp, dtype=torch.float32)
    i, lp = _topk_row(outp[0], top_k, f"{url} output_top_logprobs[0]")
    ids[T - 1] = torch.tensor(i, dtype=torch.int32)
    lps[T - 1] = torch.tensor(lp, dtype=torch.float32)
    aux = torch.tensor(rows, dtype=torch.float32).to(torch.bfloat16).view(T, 3, hidden_size)  # [T, 3H] -> [T, 3, H]
    return Capture(aux_hidden_states=aux, topk_ids=ids, topk_logprobs=lps)


def capture_request(input_ids: Sequence[int], top_k: int) -> dict:
    """The ``/generate`` body of one capture (field names of ``GenerateReqInput``)."""
    return {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_hidden_states": True,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": int(top_k),
    }


def generate_request(prompt_ids: Sequence[int], sampling: Any) -> dict:
    """The ``/generate`` body of one regeneration (``SamplingConfig`` -> sampling params)."""
    params: dict[str, Any] = {
        "max_new_tokens": int(sampling.max_new_tokens),
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
    }
    if float(sampling.temperature) > 0 and getattr(sampling, "seed", None) is not None:
        params["sampling_seed"] = int(sampling.seed)
    return {"input_ids": [int(t) for t in prompt_ids], "sampling_params": params}


# ======================================================================= server info
def effective_settings(info: dict) -> dict:
    """The settings a server actually runs with, from its ``/server_info`` answer.

    ``effective_max_running_requests`` is the sum over DP ranks of what each scheduler
    admits (``internal_states[i]["effective_max_running_requests_per_dp"]``), falling back
    to the resolved ``max_running_requests``; ``cuda_graph_max_bs`` is read from
    ``cuda_graph_max_bs`` (older servers), ``cuda_graph_max_bs_decode`` or
    ``cuda_graph_config.decode.max_bs`` (0.5.23).
    """
    keys = (
        "model_path", "tokenizer_path", "tp_size", "dp_size", "dtype", "quantization", "kv_cache_dtype",
        "context_length", "mem_fraction_static", "max_running_requests", "chunked_prefill_size",
        "disable_radix_cache", "enable_return_hidden_states", "speculative_algorithm",
        "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
        "speculative_num_draft_tokens", "speculative_draft_model_quantization", "max_total_num_tokens",
        "reasoning_parser", "tool_call_parser",
    )
    out: dict[str, Any] = {k: info.get(k) for k in keys if k in info}
    cg = info.get("cuda_graph_max_bs", info.get("cuda_graph_max_bs_decode"))
    if cg is None and isinstance(info.get("cuda_graph_config"), dict):
        cg = (info["cuda_graph_config"].get("decode") or {}).get("max_bs")
    out["cuda_graph_max_bs"] = cg
    states = [s for s in (info.get("internal_states") or []) if isinstance(s, dict)]
    per_dp = [s.get("effective_max_running_requests_per_dp") for s in states]
    if per_dp and all(isinstance(v, int) for v in per_dp):
        out["effective_max_running_requests"] = int(sum(per_dp))
    else:
        out["effective_max_running_requests"] = info.get("max_running_requests")
    acc = [s.get("avg_spec_accept_length") for s in states if s.get("avg_spec_accept_length") is not None]
    if acc:
        out["avg_spec_accept_length"] = acc
    return out


#: Settings recorded in the manifest: resolved at start-up and unchanged while the server runs.
STATIC_KEYS = (
    "model_path", "tokenizer_path", "tp_size", "dp_size", "dtype", "quantization", "kv_cache_dtype",
    "context_length", "max_running_requests", "cuda_graph_max_bs", "chunked_prefill_size",
    "disable_radix_cache", "enable_return_hidden_states", "speculative_algorithm",
    "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
    "speculative_draft_model_quantization",
)


def static_settings(info: dict) -> dict:
    """The subset of :func:`effective_settings` fixed at start-up (what the manifest
    records; the scheduler's memory-dependent capacity and live counters are left out)."""
    eff = effective_settings(info)
    return {k: eff[k] for k in STATIC_KEYS if k in eff}


def launch_flags(cmd: Any) -> list[str] | None:
    """A launch command (argv list or string) without the interpreter and without
    ``--host``/``--port`` and their values: the part that defines the deployment."""
    if cmd is None:
        return None
    argv = shlex.split(cmd) if isinstance(cmd, str) else [str(a) for a in cmd]
    if LAUNCH_MODULE in argv:
        argv = argv[argv.index(LAUNCH_MODULE) + 1:]
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--host", "--port"):
            skip = True
            continue
        if a.startswith(("--host=", "--port=")):
            continue
        out.append(a)
    return out


def _warn_if_other_model(url: str, info: dict, model_cfg: Any) -> None:
    """Log a warning when the server's ``model_path`` does not look like ``model.source``
    (a server may load the same checkpoint from another folder, so this cannot be an error)."""
    served = info.get("model_path")
    if not served:
        return
    want = os.path.basename(str(model_cfg.source).rstrip("/")).lower()
    if want and want not in str(served).lower():
        log.warning("the SGLang server at %s serves %s, but model.source is %s; is it the configured target?",
                    url, served, model_cfg.source)


def _check_same_deployment(urls: list[str], infos: list[dict]) -> None:
    """Data-parallel servers must serve the same model the same way."""
    ref = (server_version(infos[0]), static_settings(infos[0]))
    for url, inf in zip(urls[1:], infos[1:]):
        other = (server_version(inf), static_settings(inf))
        if other != ref:
            diff = sorted(k for k in set(ref[1]) | set(other[1]) if ref[1].get(k) != other[1].get(k))
            if ref[0] != other[0]:
                diff.insert(0, "version")
            raise Eagle3Error(
                f"the SGLang server at {url} differs from {urls[0]} in {diff}; "
                "data-parallel extraction needs identically deployed servers in engine.urls"
            )


def capture_setting_problems(info: dict, max_length: int | None = None) -> list[str]:
    """The flags a server at ``info`` is missing for capture (empty when it is fine).

    Settings a server does not report are not held against it.
    """
    problems = []
    algo = info.get("speculative_algorithm")
    if "speculative_algorithm" in info and (algo is None or str(algo).upper() != "EAGLE3"):
        problems.append("--speculative-algorithm EAGLE3 --speculative-draft-model-path <a drafter for this target>")
    if "enable_return_hidden_states" in info and not info["enable_return_hidden_states"]:
        problems.append("--enable-return-hidden-states")
    if "disable_radix_cache" in info and not info["disable_radix_cache"]:
        problems.append("--disable-radix-cache")
    cps = info.get("chunked_prefill_size")
    if isinstance(cps, int) and cps > 0 and (max_length is None or cps < max_length):
        problems.append("--chunked-prefill-size -1")
    return problems


def server_version(info: dict) -> str | None:
    v = info.get("version")
    return str(v) if v is not None else None


# ============================================================================ launcher
def sglang_available(python: str) -> bool:
    """Whether ``python`` (on ``PATH`` or a path) can import ``sglang.launch_server``;
    asked in a subprocess so the answer is about that interpreter and environment."""
    code = f"import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('{LAUNCH_MODULE}') else 1)"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def probe_server_flags(python: str, timeout_s: float = 180.0) -> set[str] | None:
    """The long flags ``python -m sglang.launch_server --help`` lists (None if it fails)."""
    try:
        r = subprocess.run([python, "-m", LAUNCH_MODULE, "--help"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    import re

    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", r.stdout))


def cuda_graph_flag(flags: set[str] | None) -> str:
    """``--cuda-graph-max-bs-decode`` where the server has it (0.5.14+), else the older
    ``--cuda-graph-max-bs`` (also the choice when the flags are unknown)."""
    if flags and "--cuda-graph-max-bs-decode" in flags:
        return "--cuda-graph-max-bs-decode"
    return "--cuda-graph-max-bs"


def unknown_flags(cmd: Sequence[str], flags: set[str]) -> list[str]:
    """Flags of ``cmd`` the server does not accept; a unique prefix (argparse's
    abbreviation, e.g. ``--tp`` for ``--tp-size``) counts as accepted."""
    bad = []
    for tok in cmd:
        if not tok.startswith("--"):
            continue
        name = tok.split("=", 1)[0]
        if name in flags:
            continue
        if len([f for f in flags if f.startswith(name)]) == 1:
            continue
        bad.append(name)
    return bad


def render_launch_command(
    model_cfg: Any,
    engine_cfg: Any,
    *,
    model_path: str,
    port: int,
    speculative: dict | None = None,
    capture: bool = False,
    cuda_graph_flag_name: str = "--cuda-graph-max-bs",
) -> list[str]:
    """The full ``python -m sglang.launch_server`` command line, every setting explicit.

    Args:
        model_cfg: ``ModelConfig`` (``serve`` settings, tokenizer, revision, trust flag).
        engine_cfg: ``SGLangEngineConfig`` (host, caps, chunked prefill, extra args).
        model_path: what to pass to ``--model-path`` (hub id or local folder).
        speculative: ``{"draft_model_path", "num_steps", "topk", "num_draft_tokens"}``
            to serve a drafter with ``--speculative-algorithm EAGLE3``.
        capture: add ``--enable-return-hidden-states --disable-radix-cache`` (needs
            ``speculative``) so the server returns aux hidden states for every token.

    Returns:
        argv list; ``shlex.join`` of it is what the run folder records.
    """
    serve = model_cfg.serve
    cmd = [engine_cfg.python, "-m", LAUNCH_MODULE, "--model-path", str(model_path), "--tp", str(int(serve.tp))]
    if model_cfg.trust_remote_code:
        cmd.append("--trust-remote-code")
    if serve.tool_call_parser:
        cmd += ["--tool-call-parser", str(serve.tool_call_parser)]
    if serve.reasoning_parser:
        cmd += ["--reasoning-parser", str(serve.reasoning_parser)]
    if model_cfg.tokenizer:
        cmd += ["--tokenizer-path", str(model_cfg.tokenizer)]
    if model_cfg.revision:
        cmd += ["--revision", str(model_cfg.revision)]
    if serve.context_length:
        cmd += ["--context-length", str(int(serve.context_length))]
    if serve.mem_fraction_static:
        cmd += ["--mem-fraction-static", str(float(serve.mem_fraction_static))]
    if serve.language_only:
        cmd.append("--language-only")
    cmd += [
        "--host", str(engine_cfg.host),
        "--port", str(int(port)),
        "--max-running-requests", str(int(engine_cfg.max_running_requests)),
        cuda_graph_flag_name, str(int(engine_cfg.cuda_graph_max_bs)),
        "--chunked-prefill-size", str(int(engine_cfg.chunked_prefill_size)),
    ]
    if speculative is not None:
        cmd += [
            "--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", str(speculative["draft_model_path"]),
            "--speculative-num-steps", str(int(speculative["num_steps"])),
            "--speculative-eagle-topk", str(int(speculative["topk"])),
            "--speculative-num-draft-tokens", str(int(speculative["num_draft_tokens"])),
        ]
    if capture:
        if speculative is None:
            raise ValueError("capture mode needs a drafter: aux states are only captured in EAGLE3 mode")
        cmd += ["--enable-return-hidden-states", "--disable-radix-cache"]
        if int(engine_cfg.chunked_prefill_size) != -1:
            raise Eagle3Error(
                f"engine.chunked_prefill_size={engine_cfg.chunked_prefill_size} would split long samples into "
                "several prefills whose earlier hidden states SGLang does not return; set engine.chunked_prefill_size=-1"
            )
    cmd += [str(a) for a in serve.extra_args] + [str(a) for a in engine_cfg.extra_args]
    return cmd


def _tail(path: Path, n: int = 20) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    return [ln for ln in lines if ln.strip()][-n:]


class LaunchedServer:
    """One ``sglang.launch_server`` process started by us, logging to ``log_path``.

    The process runs in its own session so :meth:`stop` can end it together with the
    scheduler processes it spawns (its process group), and nothing else.
    """

    def __init__(self, cmd: list[str], log_path: Path, url: str, env: dict | None = None):
        self.cmd, self.log_path, self.url, self.env = list(cmd), Path(log_path), url, env
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as f:
            f.write(f"$ {shlex.join(self.cmd)}\n".encode())
            f.flush()
            self.proc = subprocess.Popen(
                self.cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, start_new_session=True,
            )

    def wait_healthy(self, timeout_s: float, poll_s: float = 5.0, report_every_s: float = 60.0) -> float:
        """Poll ``GET /health`` until it answers 200; returns the seconds waited.

        A progress line shows the elapsed time and the server log's last line, so a
        5-10 minute load of a large model is visibly alive.

        Raises:
            Eagle3Error: the process exited, or ``timeout_s`` passed (the process is then
                stopped); both carry the log's last lines.
        """
        from tqdm.auto import tqdm

        client = SGLangClient(self.url)
        t0 = time.monotonic()
        last_report = t0
        bar = tqdm(total=None, bar_format="waiting for SGLang at {desc} [{elapsed}] {postfix}", desc=self.url, leave=False)
        try:
            while True:
                if client.health(timeout_s=min(10.0, max(1.0, poll_s * 2))):
                    return time.monotonic() - t0
                elapsed = time.monotonic() - t0
                rc = self.proc.poll() if self.proc else None
                if rc is not None:
                    tail = "\n".join(_tail(self.log_path))
                    raise Eagle3Error(
                        f"the SGLang server exited with code {rc} after {elapsed:.0f} s before answering /health "
                        f"(full log: {self.log_path}); its last lines:\n{tail}"
                    )
                if elapsed > timeout_s:
                    tail = "\n".join(_tail(self.log_path))
                    self.stop()
                    raise Eagle3Error(
                        f"the SGLang server did not answer {self.url}/health within {timeout_s:.0f} s; raise "
                        f"engine.launch_timeout_s if it is still loading (log: {self.log_path}); its last lines:\n{tail}"
                    )
                lines = _tail(self.log_path, 1)
                last_line = lines[-1][-160:] if lines else ""
                bar.set_postfix_str(last_line, refresh=True)
                if time.monotonic() - last_report >= report_every_s:
                    log.info("still waiting for SGLang at %s after %.0f s: %s", self.url, elapsed, last_line)
                    last_report = time.monotonic()
                time.sleep(poll_s)
        finally:
            bar.close()

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace_s``."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_server(
    model_cfg: Any,
    engine_cfg: Any,
    *,
    model_path: str,
    run_dir: str | os.PathLike,
    name: str,
    speculative: dict | None = None,
    capture: bool = False,
    port: int | None = None,
) -> tuple[LaunchedServer, list[str]]:
    """Render, check and start one server, wait until it is healthy.

    The installed server's ``--help`` decides the CUDA-graph flag's spelling and every
    rendered flag is checked against it before the (long) start. The log goes to
    ``<run_dir>/sglang-<name>.log`` and the command to ``<run_dir>/sglang-<name>.cmd``.

    Raises:
        Eagle3Error: sglang is not installed for ``engine.python``, a rendered flag is
            unknown to it, or the server does not come up (with the log's last lines).
    """
    python = engine_cfg.python
    if not sglang_available(python):
        raise Eagle3Error(
            f"the sglang package is not installed for '{python}' and engine.url is not set: install sglang "
            "where the GPUs are, or start a server yourself (docs/sglang.md) and pass engine.url=http://HOST:PORT"
        )
    port = int(port or engine_cfg.port)
    flags = probe_server_flags(python)
    cmd = render_launch_command(
        model_cfg, engine_cfg, model_path=model_path, port=port, speculative=speculative, capture=capture,
        cuda_graph_flag_name=cuda_graph_flag(flags),
    )
    if flags:
        bad = unknown_flags(cmd, flags)
        if bad:
            raise Eagle3Error(
                f"the installed sglang does not accept {bad}; remove them from engine.extra_args / "
                "model.serve.extra_args or install an sglang version that has them"
            )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"sglang-{name}.cmd").write_text(shlex.join(cmd) + "\n")
    url = f"http://{_connect_host(engine_cfg.host)}:{port}"
    server = LaunchedServer(cmd, run_dir / f"sglang-{name}.log", url)
    log.info("starting SGLang (%s): %s", name, shlex.join(cmd))
    server.start()
    try:
        waited = server.wait_healthy(float(engine_cfg.launch_timeout_s), float(getattr(engine_cfg, "health_poll_s", 5.0)))
    except BaseException:
        server.stop()
        raise
    log.info("SGLang (%s) is up at %s after %.0f s", name, url, waited)
    return server, cmd


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def resolve_model_path(model_cfg: Any, dims: dict) -> str:
    """What ``--model-path`` gets: the local folder ``eagle3.target.models`` resolved or built
    for the target (``package:`` sources, quantised builds), else the hub id."""
    return str(dims.get("path") or model_cfg.source)


# ====================================================================== bootstrap drafter
def _target_dims(model_cfg: Any, cache_dir: str | os.PathLike) -> dict:
    """Target sizes, aux ids and local folder from ``eagle3.target.models.resolve_target``
    (for a hub-only target such as Kimi these come from the model config alone)."""
    from eagle3.target import resolve_target

    info = resolve_target(model_cfg, cache_dir)
    dims = {k: getattr(info, k, None) for k in (
        "num_layers", "hidden_size", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings",
        "aux_layer_ids", "path", "content_hash")}
    return dims


def bootstrap_arch(dims: dict, tp: int) -> dict:
    """Sizes of the bootstrap drafter: the target's hidden size (so SGLang shares the
    target's embeddings), a small attention/MLP that divides by the TP degree, a
    :data:`BOOTSTRAP_DRAFT_VOCAB`-token draft vocabulary. Its outputs are never used."""
    tp = max(1, int(tp))
    heads = tp * max(1, -(-8 // tp))  # >= 8, divisible by tp
    return {
        "hidden_size": int(dims["hidden_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": 64,
        "intermediate_size": 128 * tp * max(1, -(-8 // tp)),
        "num_layers": 1,
        "target_hidden_size": int(dims["hidden_size"]),
        "vocab_size": int(dims["vocab_size"]),
        "draft_vocab_size": min(BOOTSTRAP_DRAFT_VOCAB, int(dims["vocab_size"])),
        "rms_norm_eps": float(dims.get("rms_norm_eps") or 1e-6),
        "rope_theta": float(dims.get("rope_theta") or 10000.0),
        "max_position_embeddings": int(dims.get("max_position_embeddings") or 131072),
    }


def write_bootstrap_drafter(out_dir: Path, arch: dict, aux_layer_ids: list[int], architecture: str, meta: dict, seed: int = 0) -> Path:
    """Write a randomly initialised drafter in the SGLang format.

    Uses the project's exporter (``eagle3.export.sglang.export_sglang`` on an
    ``eagle3.train.drafter.Eagle3Drafter``) when it is available, else writes the documented
    format directly (docs/design.md, "Export"): ``config.json``
    (``LlamaForCausalLMEagle3``, aux ids in SGLang's convention for the architecture)
    and ``model.safetensors`` with ``fc.weight [H, 3H]``, ``midlayer.*``,
    ``norm.weight``, ``lm_head.weight [Vd, H]``, ``d2t [Vd]`` int64 offsets, ``t2d [V]``.
    """
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    try:
        from eagle3.train.drafter import DrafterArch, Eagle3Drafter
        from eagle3.export import export_sglang
    except ImportError:  # pragma: no cover - only without the train modules
        export_sglang = None  # type: ignore[assignment]
    meta = dict(meta, aux_layer_ids=list(aux_layer_ids))
    meta.setdefault("target", {})["architecture"] = architecture
    if export_sglang is not None:
        drafter = Eagle3Drafter(DrafterArch(**{k: arch[k] for k in DrafterArch.__dataclass_fields__ if k in arch}))
        return Path(export_sglang(drafter, out_dir, meta))
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    _write_sglang_format(tmp, arch, aux_layer_ids, architecture, meta)
    os.replace(tmp, out_dir)
    return out_dir


def _write_sglang_format(out: Path, arch: dict, aux_layer_ids: list[int], architecture: str, meta: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    H, Ht = arch["hidden_size"], arch["target_hidden_size"]
    nh, nkv, hd, inter = arch["num_attention_heads"], arch["num_key_value_heads"], arch["head_dim"], arch["intermediate_size"]
    V, Vd = arch["vocab_size"], arch["draft_vocab_size"]

    def w(*shape):
        return (torch.randn(*shape) * 0.02).to(torch.bfloat16)

    tensors = {
        "fc.weight": w(H, 3 * Ht),
        "midlayer.hidden_norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "midlayer.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        "midlayer.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        "midlayer.self_attn.q_proj.weight": w(nh * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(nkv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(nkv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, nh * hd),
        "midlayer.mlp.gate_proj.weight": w(inter, H),
        "midlayer.mlp.up_proj.weight": w(inter, H),
        "midlayer.mlp.down_proj.weight": w(H, inter),
        "norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "lm_head.weight": w(Vd, H),
        "d2t": torch.zeros(Vd, dtype=torch.int64),  # draft id i is target id i
        "t2d": torch.arange(V) < Vd,
    }
    save_file(tensors, str(out / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "target_hidden_size": Ht,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": arch["rms_norm_eps"],
        "rope_theta": arch["rope_theta"],
        "max_position_embeddings": arch["max_position_embeddings"],
        "vocab_size": V,
        "draft_vocab_size": Vd,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": to_sglang_ids(list(aux_layer_ids), architecture),
            "use_aux_hidden_state": True,
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "eagle3_meta.json").write_text(json.dumps(dict(meta, aux_layer_ids=list(aux_layer_ids)), indent=2) + "\n")


def ensure_bootstrap_drafter(model_cfg: Any, dims: dict, aux_layer_ids: list[int], cache_dir: str | os.PathLike) -> Path:
    """The bootstrap drafter folder for this target under ``cache_dir`` (written once)."""
    arch = bootstrap_arch(dims, model_cfg.serve.tp)
    key = json.dumps({"arch": arch, "aux": aux_layer_ids, "family": model_cfg.architecture}, sort_keys=True)
    import hashlib

    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    out = Path(cache_dir) / "bootstrap-drafters" / f"{model_cfg.name}-{tag}"
    if (out / "config.json").exists():
        return out
    meta = {
        "purpose": "bootstrap drafter: random weights; serves only to run the target in EAGLE3 mode for capture",
        "target": {"name": model_cfg.name, "architecture": model_cfg.architecture,
                   "quantization": {"method": model_cfg.quantization.method}},
        "draft_vocab_size": arch["draft_vocab_size"],
    }
    log.info("writing the bootstrap drafter for %s to %s", model_cfg.name, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_bootstrap_drafter(out, arch, aux_layer_ids, model_cfg.architecture, meta)


def read_draft_aux_ids(draft_path: str | None, architecture: str) -> list[int] | None:
    """HF-convention aux ids a server captures with the drafter at ``draft_path`` (a
    local folder with ``config.json``), or None when it cannot be read from here."""
    if not draft_path or not os.path.isfile(os.path.join(draft_path, "config.json")):
        return None
    from eagle3.target import from_sglang_ids

    cfg = json.loads(Path(draft_path, "config.json").read_text())
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else from_sglang_ids(list(ids), architecture)


# ============================================================================== engine
def configured_urls(engine_cfg: Any) -> list[str]:
    """``engine.urls`` or ``[engine.url]`` (deduplicated, order kept)."""
    urls = list(getattr(engine_cfg, "urls", None) or [])
    if getattr(engine_cfg, "url", None):
        urls = [engine_cfg.url] + urls
    seen: list[str] = []
    for u in urls:
        u = str(u).rstrip("/")
        if u not in seen:
            seen.append(u)
    return seen


def connect(url: str, engine_cfg: Any, wait_s: float | None = None) -> tuple[SGLangClient, dict]:
    """Check ``/health`` (waiting up to ``wait_s``, default ``engine.connect_timeout_s``),
    then read ``/server_info``.

    Raises:
        Eagle3Error: nothing healthy answers at ``url``.
    """
    client = SGLangClient(url, engine_cfg.request_timeout_s, engine_cfg.max_retries, engine_cfg.backoff_s)
    wait_s = float(getattr(engine_cfg, "connect_timeout_s", 30.0) if wait_s is None else wait_s)
    t0 = time.monotonic()
    while not client.health(timeout_s=10.0):
        if time.monotonic() - t0 > wait_s:
            raise Eagle3Error(
                f"no healthy SGLang server answers at {url}/health; start one (docs/sglang.md) or fix engine.url / engine.urls"
            )
        time.sleep(1.0)
    return client, client.server_info()


class SGLangEngine(Engine):
    """:class:`~eagle3.engines.base.Engine` backed by one or more SGLang servers.

    ``generate`` and ``capture`` spread their requests over all servers (each item is
    sent once; a server that keeps failing is dropped and its work goes to the others),
    ``engine.concurrency`` generation requests and ``engine.capture_concurrency``
    capture requests in flight per server.
    """

    def __init__(
        self,
        clients: list[SGLangClient],
        server_infos: list[dict],
        engine_cfg: Any,
        hidden_size: int,
        aux_layer_ids: list[int],
        launched: list[LaunchedServer] | None = None,
        launch_command: list[str] | None = None,
        bootstrap_dir: str | None = None,
        model_name: str | None = None,
    ):
        self.clients = clients
        self.server_infos = server_infos
        self.engine_cfg = engine_cfg
        self.hidden_size = int(hidden_size)
        self.aux_layer_ids = list(aux_layer_ids)
        self.launched = launched or []
        self.launch_command = launch_command
        self.bootstrap_dir = bootstrap_dir
        self.model_name = model_name

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.clients]

    # ------------------------------------------------------------------ build
    @classmethod
    def from_config(cls, model_cfg: Any, engine_cfg: Any, cache_dir: str | os.PathLike, run_dir: str | os.PathLike) -> "SGLangEngine":
        """Connect to ``engine.url``/``engine.urls`` or launch a capture server.

        Connecting checks ``/health`` and ``/server_info`` of every server, that each runs
        in capture mode (EAGLE3, hidden states returned, no radix cache, no chunked
        prefill) and, where its drafter folder is readable here, captures this target's
        aux layers. Launching writes the bootstrap drafter once under ``cache_dir`` and
        starts ``sglang.launch_server`` with the capture flags, logging to ``run_dir``.

        Raises:
            Eagle3Error: no server configured and sglang not installed; a server not
                reachable or not in capture mode; a launch that fails.
        """
        urls = configured_urls(engine_cfg)
        if not urls and not sglang_available(engine_cfg.python):
            raise Eagle3Error(
                "no SGLang server is configured (engine.url) and the sglang package is not installed here: "
                "start one where the GPUs are (python -m sglang.launch_server ... --speculative-algorithm EAGLE3 "
                "--enable-return-hidden-states --disable-radix-cache --chunked-prefill-size -1, see docs/sglang.md) "
                "and pass engine.url=http://HOST:PORT"
            )
        dims = _target_dims(model_cfg, cache_dir)
        aux = list(dims["aux_layer_ids"])
        if urls:
            clients, infos = [], []
            for url in urls:
                client, info = connect(url, engine_cfg)
                problems = capture_setting_problems(info)
                if problems:
                    raise Eagle3Error(
                        f"the SGLang server at {url} cannot return aux hidden states for every token; "
                        f"restart it with {' '.join(problems)}"
                    )
                served = read_draft_aux_ids(info.get("speculative_draft_model_path"), model_cfg.architecture)
                if served is not None and served != aux:
                    raise Eagle3Error(
                        f"the drafter served at {url} makes the target capture aux layers {served} (HF ids) but "
                        f"model.aux_layer_ids is {aux}; serve a drafter exported for these layers"
                    )
                _warn_if_other_model(url, info, model_cfg)
                clients.append(client)
                infos.append(info)
            _check_same_deployment(urls, infos)
            return cls(clients, infos, engine_cfg, int(dims["hidden_size"]), aux, model_name=model_cfg.name)

        boot = ensure_bootstrap_drafter(model_cfg, dims, aux, cache_dir)
        model_path = resolve_model_path(model_cfg, dims)
        spec = dict(CAPTURE_SPEC, draft_model_path=str(boot))
        server, cmd = launch_server(
            model_cfg, engine_cfg, model_path=model_path, run_dir=run_dir, name="capture", speculative=spec, capture=True
        )
        try:
            client = SGLangClient(server.url, engine_cfg.request_timeout_s, engine_cfg.max_retries, engine_cfg.backoff_s)
            info = client.server_info()
        except BaseException:
            server.stop()
            raise
        return cls([client], [info], engine_cfg, int(dims["hidden_size"]), aux, launched=[server],
                   launch_command=cmd, bootstrap_dir=str(boot), model_name=model_cfg.name)

    # ------------------------------------------------------------------ Engine
    def info(self) -> dict:
        """Manifest metadata that fixes the numerics: server version, launch flags
        (without host/port) and the server's static effective settings. URLs, request
        concurrency and memory-dependent capacities are left out (a resumed extraction
        compares this dict)."""
        inf = self.server_infos[0] if self.server_infos else {}
        launch = self.launch_command if self.launch_command else inf.get("launch_command")
        return {
            "name": "sglang",
            "server_version": server_version(inf),
            "launch_flags": launch_flags(launch),
            "effective": static_settings(inf),
            "aux_layer_ids": self.aux_layer_ids,
            "capture_request": {k: v for k, v in capture_request([0], 0).items() if k not in ("input_ids", "top_logprobs_num")},
        }

    def generate(self, prompts: list[list[int]], sampling: Any) -> list[list[int]]:
        """Rendered prompt ids -> generated ids (stop token included), in order.

        Raises:
            Eagle3Error / ServerUnavailable: see :func:`run_parallel`.
        """
        def one(client: SGLangClient, prompt: list[int]) -> list[int]:
            return output_ids_from_response(client.generate(generate_request(prompt, sampling)))

        return run_parallel(self.clients, prompts, one, int(self.engine_cfg.concurrency), desc="generate (sglang)")

    def capture(self, sequences: list[list[int]], top_k: int) -> list[Capture]:
        """Full sequences -> per sequence ``Capture`` (aux ``[T, 3, H]`` bf16, top-k ids
        ``[T, k]`` int32, log-probs ``[T, k]`` float32), CPU tensors, in order.

        Raises:
            Eagle3Error: a server answers with the wrong width / row count (the message
                names the flag to fix) or fails for good.
        """
        H = self.hidden_size

        def one(client: SGLangClient, seq: list[int]) -> Capture:
            if len(seq) < 1:
                raise Eagle3Error("cannot capture an empty sequence")
            out = client.generate(capture_request(seq, top_k))
            return parse_capture(out, seq, H, top_k, url=client.url)

        conc = int(getattr(self.engine_cfg, "capture_concurrency", self.engine_cfg.concurrency))
        return run_parallel(self.clients, sequences, one, conc, desc="capture (sglang)")

    def close(self) -> None:
        """Stop the servers this engine launched (connected servers keep running)."""
        for s in self.launched:
            s.stop()
        self.launched = []


# ================================================================================= CLI
def main(argv: list[str] | None = None) -> int:
    """Print the ``sglang.launch_server`` command eagle3 would run, for starting a server
    by hand: ``python -m eagle3.engines.sglang.engine {capture|baseline|speculative} model=... [overrides]``.

    ``capture`` first writes the bootstrap drafter under ``cache_dir`` (once) and prints
    its folder; ``speculative`` serves ``drafter_dir`` (or the default export folder).
    Overrides are those of ``extract.py`` (capture) or ``evaluate.py`` (the others).
    """
    import sys

    from hydra import compose, initialize_config_dir

    from eagle3.cli import to_typed

    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argv.pop(0) if argv and argv[0] in ("capture", "baseline", "speculative") else "capture"
    conf = Path(__file__).resolve().parents[2] / "conf"
    stage = "extract" if mode == "capture" else "evaluate"
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = to_typed(compose(config_name=stage, overrides=["engine=sglang"] + argv))
        dims = _target_dims(cfg.model, cfg.cache_dir)
        spec = None
        if mode == "capture":
            boot = ensure_bootstrap_drafter(cfg.model, dims, list(dims["aux_layer_ids"]), cfg.cache_dir)
            print(f"# bootstrap drafter: {boot}", file=sys.stderr)
            spec = dict(CAPTURE_SPEC, draft_model_path=str(boot.resolve()))
        elif mode == "speculative":
            spec = {"draft_model_path": str(Path(cfg.drafter_dir).resolve()), "num_steps": cfg.speculative.num_steps,
                    "topk": cfg.speculative.topk, "num_draft_tokens": cfg.speculative.num_draft_tokens}
        flags = probe_server_flags(cfg.engine.python) if sglang_available(cfg.engine.python) else None
        cmd = render_launch_command(
            cfg.model, cfg.engine, model_path=resolve_model_path(cfg.model, dims), port=int(cfg.engine.port),
            speculative=spec, capture=mode == "capture", cuda_graph_flag_name=cuda_graph_flag(flags),
        )
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(shlex.join(cmd))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
