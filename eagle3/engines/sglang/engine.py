"""SGLang engine: regenerate and capture through a live SGLang deployment.

The engine either connects to running servers (``engine.url`` / ``engine.urls``) or
launches one (``python -m sglang.launch_server``) with every setting rendered as an
explicit flag. It never patches SGLang: aux hidden states come out of a stock server
started in EAGLE3 mode with a randomly initialised *bootstrap drafter* for this target,
because only in that mode does the target capture the three aux layers and return them
through ``return_hidden_states``.

The package's modules, in the order a capture goes through them: ``bootstrap`` (the
drafter a capture server needs), ``command`` and ``launch`` (starting a server),
``client`` (HTTP with retries), ``server_info`` (what a server runs with),
``protocol`` (request bodies, answers parsed into captures) and ``scheduler``
(requests spread over several servers); ``cli`` prints a launch command for starting
a server by hand.
"""

from __future__ import annotations

import os
import time
from typing import Any

from eagle3.engines.base import Engine
from eagle3.engines.sglang.bootstrap import CAPTURE_SPEC, _target_dims, ensure_bootstrap_drafter, read_draft_aux_ids
from eagle3.engines.sglang.client import SGLangClient
from eagle3.engines.sglang.command import launch_flags, resolve_model_path, sglang_available
from eagle3.engines.sglang.launch import LaunchedServer, launch_server, server_env
from eagle3.engines.sglang.protocol import capture_request, generate_request, output_ids_from_response, parse_capture
from eagle3.engines.sglang.scheduler import run_parallel
from eagle3.engines.sglang.server_info import (
    _check_same_deployment,
    _warn_if_other_model,
    capture_setting_problems,
    server_version,
    static_settings,
)
from eagle3.errors import Eagle3Error
from eagle3.features import Capture


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


def connect(url: str, engine_cfg: Any, wait_s: float | None = None,
            setting: str = "engine.url / engine.urls") -> tuple[SGLangClient, dict]:
    """Check ``/health`` (waiting up to ``wait_s``, default ``engine.connect_timeout_s``),
    then read ``/server_info``.

    Args:
        setting: the config field(s) ``url`` came from, named in the error (served
            evaluation passes ``engine.baseline_url`` or ``engine.speculative_url``).

    Raises:
        Eagle3Error: nothing healthy answers at ``url``.
    """
    client = SGLangClient(url, engine_cfg.request_timeout_s, engine_cfg.max_retries, engine_cfg.backoff_s)
    wait_s = float(getattr(engine_cfg, "connect_timeout_s", 30.0) if wait_s is None else wait_s)
    t0 = time.monotonic()
    while not client.health(timeout_s=10.0):
        if time.monotonic() - t0 > wait_s:
            raise Eagle3Error(
                f"no healthy SGLang server answers at {url}/health; start one (docs/sglang.md) or fix {setting}"
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
        """The base URL of each server this engine talks to (one per client)."""
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
        if not urls and not sglang_available(engine_cfg.python, server_env(engine_cfg)):
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
