"""The ``python -m sglang.launch_server`` command line: rendering it, checking it, reading it back.

Server flags, read from the SGLang sources (``python/sglang/`` of the 0.5.14 and 0.5.23
wheels; paths relative to it): ``srt/server_args.py`` and, from 0.5.14 on, the
dataclass fields in ``srt/arg_groups/fields/*.py`` whose names become
``--field-name``: ``--model-path``, ``--tp-size`` (``--tp`` is argparse's unique-prefix
abbreviation of it, the spelling of Kimi's own deployment guide),
``--trust-remote-code``, ``--tool-call-parser``, ``--reasoning-parser``, ``--host``,
``--port``, ``--max-running-requests``, ``--chunked-prefill-size``,
``--disable-radix-cache``, ``--enable-return-hidden-states``, ``--context-length``,
``--mem-fraction-static``, ``--language-only``, ``--tokenizer-path``, ``--revision``,
``--speculative-algorithm``, ``--speculative-draft-model-path``,
``--speculative-num-steps``, ``--speculative-eagle-topk``,
``--speculative-num-draft-tokens``. The CUDA-graph batch cap is ``--cuda-graph-max-bs``
up to 0.5.14 (where it is already a deprecated alias of ``--cuda-graph-max-bs-decode``)
and only ``--cuda-graph-max-bs-decode`` in 0.5.23; the launcher asks the installed
server's ``--help`` which one it has (:func:`probe_server_flags`). A CPU server (the CPU
build of 0.5.23, checked against its ``--help`` and a live start) also gets ``--device
cpu``, ``--disable-overlap-schedule`` and ``--max-total-tokens``
(``srt/server_args.py`` of that build: ``device``, ``disable_overlap_schedule``,
``max_total_tokens``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from typing import Any, Sequence

from eagle3.errors import Eagle3Error

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
    "--device": "srt/server_args.py (ServerArgs.device), CPU build of 0.5.23",
    "--disable-overlap-schedule": "srt/server_args.py (ServerArgs.disable_overlap_schedule), CPU build of 0.5.23",
    "--max-total-tokens": "srt/server_args.py (ServerArgs.max_total_tokens), CPU build of 0.5.23",
}
#: KV-cache tokens of a CPU server when ``engine.max_total_tokens`` is unset (what the CPU
#: build was seen to start and serve with on a 24 GiB machine).
CPU_MAX_TOTAL_TOKENS = 8192
#: ``--mem-fraction-static`` of a CPU server when ``model.serve.mem_fraction_static`` is
#: unset. The CPU build derives its default from the host's free memory and, on a host
#: whose memory other processes use, arrives at a negative fraction and refuses to start
#: ("Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=-0.049").
CPU_MEM_FRACTION_STATIC = 0.5


#: answers of :func:`sglang_available` / :func:`probe_server_flags` per (interpreter,
#: environment): each costs a Python start that imports SGLang (20-30 s on a loaded
#: 2-core CPU machine), and an evaluation launches two servers.
_PROBED: dict[tuple, Any] = {}


def _probe_key(what: str, python: str, env: dict | None) -> tuple:
    return (what, python, tuple(sorted((os.environ if env is None else env).items())))


def sglang_available(python: str, env: dict | None = None) -> bool:
    """Whether ``python`` (on ``PATH`` or a path) can import ``sglang.launch_server``;
    asked in a subprocess with environment ``env`` (None: this process's) so the answer
    is about that interpreter and environment (the CPU build imports only with its
    ``env.sh`` applied: see :func:`eagle3.engines.sglang.launch.server_env`)."""
    key = _probe_key("available", python, env)
    if _PROBED.get(key):
        return True
    code = f"import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('{LAUNCH_MODULE}') else 1)"
    try:
        ok = subprocess.run([python, "-c", code], capture_output=True, timeout=120, env=env).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
    _PROBED[key] = ok
    return ok


def probe_server_flags(python: str, timeout_s: float = 180.0, env: dict | None = None) -> set[str] | None:
    """The long flags ``python -m sglang.launch_server --help`` lists (None if it fails),
    run with environment ``env`` (None: this process's)."""
    key = _probe_key("flags", python, env)
    if key in _PROBED:
        return set(_PROBED[key])
    try:
        r = subprocess.run([python, "-m", LAUNCH_MODULE, "--help"], capture_output=True, text=True,
                           timeout=timeout_s, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    _PROBED[key] = flags = set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", r.stdout))
    return set(flags)


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
    device: str = "cuda",
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
        device: ``cuda`` (SGLang's default, no flag) or ``cpu`` (``--device cpu
            --disable-overlap-schedule --max-total-tokens N``, ``--mem-fraction-static``
            :data:`CPU_MEM_FRACTION_STATIC` unless the model sets one, no CUDA-graph flag);
            :func:`server_device` resolves ``engine.device``.

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
    cmd += ["--host", str(engine_cfg.host), "--port", str(int(port))]
    mrr = getattr(engine_cfg, "max_running_requests", None)
    if mrr is not None:
        cmd += ["--max-running-requests", str(int(mrr))]
    if device == "cpu":
        mtt = getattr(engine_cfg, "max_total_tokens", None) or CPU_MAX_TOTAL_TOKENS
        cmd += ["--device", "cpu", "--disable-overlap-schedule", "--max-total-tokens", str(int(mtt))]
        if not serve.mem_fraction_static:
            cmd += ["--mem-fraction-static", str(CPU_MEM_FRACTION_STATIC)]
    else:
        cmd += [cuda_graph_flag_name, str(int(engine_cfg.cuda_graph_max_bs))]
        if getattr(engine_cfg, "max_total_tokens", None):
            cmd += ["--max-total-tokens", str(int(engine_cfg.max_total_tokens))]
    cmd += ["--chunked-prefill-size", str(int(engine_cfg.chunked_prefill_size))]
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


def server_device(engine_cfg: Any) -> str:
    """``engine.device`` resolved: ``cpu`` or ``cuda`` as given, ``auto`` -> ``cuda``
    when torch sees a CUDA device on this machine (where a launched server runs), else
    ``cpu``.

    Raises:
        Eagle3Error: any other value.
    """
    dev = str(getattr(engine_cfg, "device", "auto") or "auto").lower()
    if dev == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if dev not in ("cpu", "cuda"):
        raise Eagle3Error(f"engine.device={dev} is not a device an SGLang server runs on; use auto, cuda or cpu")
    return dev


def resolve_model_path(model_cfg: Any, dims: dict) -> str:
    """What ``--model-path`` gets: the local folder ``eagle3.target`` resolved or built
    for the target (``package:`` sources, quantised builds), else the hub id."""
    return str(dims.get("path") or model_cfg.source)


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
