"""``extract.py engine=vllm``: the replies come from a vLLM server, so the serving numerics
(on a CPU build, vLLM's real INT4 kernel ``cpu_gemm_wna16`` for a W4A16 target) pick every
training token. The aux hidden states and next-token distributions of those tokens come
from one of two places (``engine.capture``):

- ``server``: the same server, through vLLM's ``extract_hidden_states`` method
  (:mod:`eagle3.engines.vllm.capture`): features from the serving numerics themselves;
- ``hf``: this process, teacher-forced on the same ids by the ``hf`` engine (for a W4A16
  target that is the dequantized weights, which agree with vLLM's INT4 kernel on 93% of
  next tokens, docs/precision-study.md).

Why the replies come from the server either way: greedy replies of two numerics part
within a few dozen tokens, and a drafter is scored on the text the server writes. The
manifest records both halves (``info()["generation"]`` and ``info()["capture"]``).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from eagle3.engines.base import Engine
from eagle3.engines.vllm.client import VLLMClient
from eagle3.engines.vllm.launch import VLLMServer, launch_vllm
from eagle3.engines.vllm.server_info import effective_settings
from eagle3.errors import Eagle3Error
from eagle3.features import Capture

log = logging.getLogger(__name__)


def completion_request(prompt: list[int], sampling: Any, model: str, stop_ids: list[int], seed: int) -> dict:
    """The ``/v1/completions`` body that generates one reply the way the ``hf`` engine
    does: prompt given as token ids, ``max_tokens = sampling.max_new_tokens``, the
    target's end-of-turn ids as ``stop_token_ids``, ``temperature``/``top_p`` from
    ``sampling`` and, when sampling (T > 0), a per-request ``seed``."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": int(sampling.max_new_tokens),
            "temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
            "stop_token_ids": list(stop_ids), "skip_special_tokens": False}
    if float(sampling.temperature) > 0:
        body["seed"] = int(seed)
    return body


def reply_ids(output_ids: list[int], finish_reason: Optional[str], stop_ids: list[int], max_new: int) -> list[int]:
    """A reply in :meth:`Engine.generate`'s contract: ends with its stop token when the
    model stopped (vLLM includes it in ``token_ids``; appended when a server left it
    out), else ``max_new`` ids long.

    Raises:
        Eagle3Error: a reply longer than ``max_new``, or stopped without a known stop token
            when it is shorter than ``max_new`` and ``finish_reason`` is not ``stop``.
    """
    ids = list(output_ids)
    if len(ids) > max_new:
        raise Eagle3Error(f"the vLLM server returned {len(ids)} tokens for max_tokens={max_new}")
    if ids and ids[-1] in stop_ids:
        return ids
    if finish_reason == "stop":
        return ids + [stop_ids[0]]
    if len(ids) < max_new:
        raise Eagle3Error(f"a vLLM reply ended after {len(ids)} of {max_new} tokens with finish_reason "
                          f"{finish_reason!r} and no stop token; check the server's max_model_len")
    return ids


class VLLMEngine(Engine):
    """Generation by a vLLM OpenAI server, capture by an in-process :class:`HFEngine`.

    Args:
        client: the generation server's client.
        settings: its effective settings (:func:`eagle3.engines.vllm.effective_settings`).
        engine_cfg: :class:`eagle3.config.VLLMEngineConfig` (``concurrency``: requests in flight).
        capture: the in-process engine that captures features on the generated ids.
        launched: the server started here (stopped by :meth:`close`), or None when connected.
        launch_command: its argv (recorded in :meth:`info` without host and port).
    """

    def __init__(self, client: VLLMClient, settings: dict, engine_cfg: Any, capture: Optional[Engine],
                 launched: Optional[VLLMServer] = None, launch_command: Optional[list[str]] = None,
                 stop_ids: Optional[list[int]] = None, target_dims: Optional[tuple[list[int], int]] = None):
        self.client = client
        self.settings = settings
        self.engine_cfg = engine_cfg
        self.capture_engine = capture  # None: capture on the server
        self.launched = launched
        self.launch_command = launch_command
        self.stop_ids = list(stop_ids if stop_ids is not None else getattr(capture, "stop_ids", []))
        self.target_dims = target_dims  # (aux layer ids, hidden size) for server capture
        if not self.stop_ids:
            raise Eagle3Error("no end-of-turn token ids are known for this target's tokenizer")

    @classmethod
    def from_config(cls, model_cfg: Any, engine_cfg: Any, cache_dir: str | os.PathLike,
                    run_dir: str | os.PathLike) -> "VLLMEngine":
        """Connect to ``engine.url`` or launch ``<engine.python> -m vllm.entrypoints.openai.api_server``
        on the target's built folder (no drafter; log ``<run_dir>/vllm-generate.log``). With
        ``engine.capture=server`` the launched server is a capture server
        (:func:`_capture_launch`; a connected one must be); with ``hf`` the target is also
        loaded in this process (``engine.capture_device``).

        Raises:
            Eagle3Error: an unknown ``engine.capture``; the server not reachable, not serving
                ``engine.served_model_name`` or (``capture=server``) not capturing; a launch
                that fails (the log's last lines), or what the hf engine raises.
        """
        from eagle3.config import HFEngineConfig
        from eagle3.engines.hf.engine import HFEngine
        from eagle3.target import end_of_turn_ids, load_tokenizer, resolve_target

        if str(engine_cfg.capture) not in ("hf", "server"):
            raise Eagle3Error(f"engine.capture={engine_cfg.capture} is unknown; use engine.capture=server (vLLM's "
                              "extract_hidden_states: the serving numerics) or engine.capture=hf (in this process)")
        on_server = str(engine_cfg.capture) == "server"
        launched, cmd = None, None
        target = resolve_target(model_cfg, cache_dir)
        if engine_cfg.baseline_url or engine_cfg.speculative_url:
            raise Eagle3Error("extraction uses one generation server: pass engine.url=http://HOST:PORT (a vLLM server "
                              "without a drafter), not engine.baseline_url / engine.speculative_url")
        if engine_cfg.url:
            client = VLLMClient(str(engine_cfg.url).rstrip("/"), engine_cfg.request_timeout_s, engine_cfg.max_retries,
                                engine_cfg.backoff_s)
            if not client.health(timeout_s=float(engine_cfg.connect_timeout_s)):
                raise Eagle3Error(f"no vLLM server answers /health at {engine_cfg.url}; start one (python -m "
                                  "vllm.entrypoints.openai.api_server --model TARGET ...) or leave engine.url unset "
                                  "to launch one here with engine.python")
        else:
            launched, cmd, waited = launch_vllm(engine_cfg, model_path=str(target.path), dtype=str(model_cfg.dtype),
                                                seed=0, port=int(engine_cfg.port), run_dir=run_dir, name="generate",
                                                **(_capture_launch(engine_cfg, target, run_dir) if on_server else {}))
            log.info("vLLM generation server up after %.0f s", waited)
            client = VLLMClient(launched.url, engine_cfg.request_timeout_s, engine_cfg.max_retries, engine_cfg.backoff_s)
        try:
            settings = effective_settings(client, launched.log_path if launched else None)
            served = settings.get("served_model_names") or []
            if engine_cfg.served_model_name not in served:
                raise Eagle3Error(f"the vLLM server at {client.url} serves {served}, not engine.served_model_name="
                                  f"{engine_cfg.served_model_name!r}; pass engine.served_model_name={served[0] if served else '...'}")
            if (settings.get("speculative_config") or {}).get("method", "extract_hidden_states") != "extract_hidden_states":
                log.warning("the vLLM generation server at %s serves a drafter; greedy replies are the same, but "
                            "sampled ones (T > 0) may not be: use a server without one", client.url)
            if on_server:
                if not (settings.get("speculative_config") or {}).get("method", "extract_hidden_states") == \
                        "extract_hidden_states":
                    raise Eagle3Error(f"the vLLM server at {client.url} is not a capture server (its speculative method "
                                      "is not extract_hidden_states); launch it as docs/sglang.md says or leave "
                                      "engine.url unset")
                tok = load_tokenizer(model_cfg, cache_dir, target)
                return cls(client, settings, engine_cfg, None, launched, cmd, stop_ids=end_of_turn_ids(tok),
                           target_dims=(list(target.aux_layer_ids), int(target.hidden_size)))
            capture = HFEngine.from_config(model_cfg, HFEngineConfig(device=str(engine_cfg.capture_device)), cache_dir)
        except BaseException:
            if launched is not None:
                launched.stop()
            raise
        return cls(client, settings, engine_cfg, capture, launched, cmd)

    def info(self) -> dict[str, Any]:
        """See :meth:`Engine.info`: ``{"name": "vllm", "generation": {server settings that
        fix the numerics: dtype, quantization, max_model_len, launch flags without
        host/port}, "capture": <the hf engine's info>}``."""
        flags, argv = [], list(self.launch_command or [])
        i = argv.index("--model") if "--model" in argv else len(argv)  # after the python and the module
        while i < len(argv):
            if argv[i] in ("--model", "--host", "--port"):  # this machine's path and address, not numerics
                i += 2
                continue
            flags.append(argv[i])
            i += 1
        flags = [f for f in flags if "shared_storage_path" not in f] + (
            ["--kv-transfer-config <hidden-states connector>"] if any("shared_storage_path" in f for f in flags) else [])
        gen = {k: self.settings.get(k) for k in ("dtype", "quantization", "max_model_len", "seed")}
        gen["launch_flags"] = flags
        capture = (self.capture_engine.info() if self.capture_engine is not None else
                   {"name": "vllm", "method": "extract_hidden_states", "aux_layer_ids": self.target_dims[0]})
        return {"name": "vllm", "generation": gen, "capture": capture}

    def generate(self, prompts: list[list[int]], sampling: Any) -> list[list[int]]:
        """Rendered prompt ids -> generated ids in order (stop token included), with at most
        ``engine.concurrency`` requests in flight; request ``i`` is seeded ``sampling.seed + i``
        when sampling.

        Raises:
            Eagle3Error / VLLMUnavailable: a request that keeps failing, or a reply outside the contract.
        """
        from tqdm.auto import tqdm

        n = int(sampling.max_new_tokens)
        seed = int(getattr(sampling, "seed", 0) or 0)

        from eagle3.engines.vllm.capture import discard_hidden_states

        def one(i: int) -> list[int]:
            body = completion_request(prompts[i], sampling, self.engine_cfg.served_model_name, self.stop_ids, seed + i)
            c = self.client.complete(body, stream=False)
            if self.capture_engine is None:  # a capture server also wrote this request's prompt states: not needed
                discard_hidden_states(c.raw)
            return reply_ids(c.output_ids, c.finish_reason, self.stop_ids, n)

        out: list[Optional[list[int]]] = [None] * len(prompts)
        with ThreadPoolExecutor(max_workers=max(1, int(self.engine_cfg.concurrency))) as pool, \
                tqdm(total=len(prompts), desc="generate (vllm)", leave=False) as bar:
            futures = {pool.submit(one, i): i for i in range(len(prompts))}
            for f in futures:
                out[futures[f]] = f.result()
                bar.update(1)
        return out  # type: ignore[return-value]

    def capture(self, sequences: list[list[int]], top_k: int) -> list[Capture]:
        """Per sequence a :class:`Capture` (aux ``[T, 3, H]`` bf16, top-k ids ``[T, k]``
        int32, log-probs ``[T, k]`` float32): from the server's ``extract_hidden_states``
        (``engine.capture=server``, ``engine.concurrency`` requests in flight) or
        teacher-forced in process (``hf``).

        Raises:
            Eagle3Error: an answer without a hidden-states file or log-probs, or a file of
                another shape (:func:`eagle3.engines.vllm.capture.parse_capture`).
        """
        if self.capture_engine is not None:
            return self.capture_engine.capture(sequences, top_k)
        from eagle3.engines.vllm.capture import capture_request, parse_capture, read_hidden_states

        aux, hidden = self.target_dims

        def one(seq: list[int]) -> Capture:
            if not seq:
                raise Eagle3Error("cannot capture an empty sequence")
            body = capture_request(self.engine_cfg.served_model_name, seq, top_k)
            answer = self.client.request("POST", "/v1/completions", body)
            return parse_capture(answer, seq, read_hidden_states(answer), top_k, len(aux), hidden)

        with ThreadPoolExecutor(max_workers=max(1, int(self.engine_cfg.concurrency))) as pool:
            return list(pool.map(one, sequences))

    def close(self) -> None:
        """Stop the server launched here (a connected one keeps running) and free the capture model."""
        if self.launched is not None:
            self.launched.stop()
            self.launched = None
        if self.capture_engine is not None:
            self.capture_engine.close()


def _capture_launch(engine_cfg: Any, target: Any, run_dir: str | os.PathLike) -> dict:
    """``launch_vllm`` keywords of a capture server: ``extract_hidden_states`` for the
    target's aux layer ids, the hidden-states connector writing under
    ``<run_dir>/hidden_states`` (the CPU one, on ``PYTHONPATH``, on a CPU build) and
    ``--max-logprobs 64`` (top-k up to 64)."""
    import json
    from pathlib import Path

    from eagle3.engines.vllm.capture import PLUGIN_DIR, capture_speculative_config, kv_transfer_config
    from eagle3.engines.vllm.launch import vllm_device

    storage = (Path(run_dir) / "hidden_states").resolve()
    storage.mkdir(parents=True, exist_ok=True)
    device = vllm_device(str(engine_cfg.python), str(engine_cfg.device))
    return {"speculative": capture_speculative_config(list(target.aux_layer_ids)),
            "extra_args": ["--max-logprobs", "64", "--kv-transfer-config", json.dumps(kv_transfer_config(storage, device))],
            "extra_env": {"PYTHONPATH": str(PLUGIN_DIR)} if device == "cpu" else None}
