"""Capture from a vLLM server's own numerics: its ``extract_hidden_states`` method.

The server is launched with (vLLM 0.32; ``vllm/v1/spec_decode/extract_hidden_states.py``)::

    --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": AUX}}}'
    --kv-transfer-config '{"kv_connector": ..., "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": DIR}}'

``AUX`` are HF ``output_hidden_states`` indices, which vLLM uses as given (id ``k`` is
the residual stream after decoder layer ``k - 1``, ``_maybe_add_hidden_state(aux, idx + 1,
...)`` in ``vllm/model_executor/models/llama.py``): the ids of this project's manifests.
The connector writes, per request, ``DIR/<request id>.safetensors`` with
``hidden_states [T, len(AUX), H]`` and ``token_ids [T]`` for the prompt tokens, and the
answer carries its path in ``kv_transfer_params.hidden_states_path``; a ``.lock`` file
beside it is held until the write ends. On a CPU build the reference connector's CUDA
streams do not exist: ``server_plugins/eagle3_cpu_hidden_states.py`` does the same copy on
the CPU and is put on the server's ``PYTHONPATH``.

One capture is one ``/v1/completions`` request over the sequence with ``max_tokens=1``,
``prompt_logprobs=k`` (the next-token top-k at every position but the last) and
``logprobs=k`` with ``return_tokens_as_token_ids`` (the last position's, from the one
generated token). Position ``t`` of a :class:`~eagle3.features.Capture` holds the state at
token ``t`` and the distribution of token ``t + 1`` (:class:`eagle3.engines.base.Engine`).
"""

from __future__ import annotations

import fcntl
import math
import os
from pathlib import Path
from typing import Any, Optional

import torch

from eagle3.errors import Eagle3Error
from eagle3.features import Capture

PLUGIN_DIR = Path(__file__).resolve().parent / "server_plugins"
CPU_CONNECTOR = ("CPUHiddenStatesConnector", "eagle3_cpu_hidden_states")
GPU_CONNECTOR = "ExampleHiddenStatesConnector"


def capture_speculative_config(aux_layer_ids: list[int]) -> dict:
    """``--speculative-config`` of a capture server for ``aux_layer_ids`` (HF indices)."""
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layer_ids]}}}


def kv_transfer_config(storage_dir: str | os.PathLike, device: str) -> dict:
    """``--kv-transfer-config``: the reference connector on a GPU build, this project's
    CPU connector (:data:`CPU_CONNECTOR`, found through ``PYTHONPATH``) on a CPU build."""
    cfg: dict[str, Any] = {"kv_role": "kv_producer",
                           "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)}}
    if device == "cpu":
        cfg["kv_connector"], cfg["kv_connector_module_path"] = CPU_CONNECTOR
    else:
        cfg["kv_connector"] = GPU_CONNECTOR
    return cfg


def capture_request(model: str, sequence: list[int], top_k: int) -> dict:
    """The ``/v1/completions`` body that captures ``sequence`` (see the module docstring)."""
    return {"model": model, "prompt": list(sequence), "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": int(top_k), "logprobs": int(top_k), "return_tokens_as_token_ids": True,
            "skip_special_tokens": False}


def _token_id(key: str) -> int:
    """``"token_id:123"`` (``return_tokens_as_token_ids``) or ``"123"`` -> 123."""
    return int(str(key).rsplit(":", 1)[-1])


def _top_k_of_position(entry: dict, k: int) -> list[tuple[int, float]]:
    """One ``prompt_logprobs`` entry ``{id: {"logprob", "rank", ...}}`` -> its ``k`` best
    ``(id, logprob)`` by rank, ties by the lower id (the verifier's argmax; the entry
    also holds the actual next token when it ranks below ``k``)."""
    items = [(_token_id(t), float(v["logprob"]), int(v.get("rank") or 10**9)) for t, v in entry.items()]
    items.sort(key=lambda x: (-x[1], x[0]))
    return [(i, lp) for i, lp, _ in items[:k]]


def parse_capture(answer: dict, sequence: list[int], hidden: dict[str, torch.Tensor], top_k: int,
                  num_aux: int, hidden_size: int) -> Capture:
    """A capture answer and the tensors of its hidden-states file -> :class:`Capture`
    (``aux_hidden_states [T, num_aux, H]`` bf16, ``topk_ids [T, k]`` int32,
    ``topk_logprobs [T, k]`` float32).

    Raises:
        Eagle3Error: the file holds other tokens or another shape, or the answer lacks
            ``prompt_logprobs`` / the generated token's ``logprobs`` (the server is too
            old or was launched without ``--max-logprobs`` >= ``top_k``).
    """
    T = len(sequence)
    ids = hidden.get("token_ids")
    hs = hidden.get("hidden_states")
    if hs is None or ids is None:
        raise Eagle3Error(f"the hidden-states file has {sorted(hidden)}, not hidden_states and token_ids")
    if ids.tolist() != list(sequence):
        raise Eagle3Error(f"the hidden-states file holds {ids.numel()} other tokens than the {T} sent")
    hs = hs.reshape(hs.shape[0], -1, hs.shape[-1]) if hs.dim() != 3 else hs
    if tuple(hs.shape) != (T, num_aux, hidden_size):
        raise Eagle3Error(f"hidden states of shape {tuple(hs.shape)}; expected [{T}, {num_aux}, {hidden_size}] "
                          "(one row per aux layer id in the capture server's speculative config)")
    choice = (answer.get("choices") or [{}])[0]
    prompt_lp = choice.get("prompt_logprobs") or answer.get("prompt_logprobs")
    last = ((choice.get("logprobs") or {}).get("top_logprobs") or [None])[0]
    if prompt_lp is None or len(prompt_lp) != T or last is None:
        raise Eagle3Error("the vLLM answer lacks prompt_logprobs for every position or the generated token's "
                          f"logprobs; launch the server with --max-logprobs {top_k} or more")
    rows = [_top_k_of_position(prompt_lp[t + 1], top_k) for t in range(T - 1)]
    rows.append(_top_k_of_position({k: {"logprob": v} for k, v in last.items()}, top_k))
    if any(len(r) < top_k for r in rows):
        raise Eagle3Error(f"fewer than top_k={top_k} log-probs came back for some position")
    topk_ids = torch.tensor([[i for i, _ in r] for r in rows], dtype=torch.int32)
    topk_lp = torch.tensor([[lp if math.isfinite(lp) else -1e30 for _, lp in r] for r in rows], dtype=torch.float32)
    return Capture(hs.to(torch.bfloat16).contiguous(), topk_ids, topk_lp)


def read_hidden_states(answer: dict, storage_dir: Optional[str | os.PathLike] = None,
                       keep: bool = False) -> dict[str, torch.Tensor]:
    """Wait for the file named by ``answer["kv_transfer_params"]["hidden_states_path"]``
    (a shared lock on its ``.lock``), read it and, unless ``keep``, delete both.

    Raises:
        Eagle3Error: the answer names no file (the server was launched without the
            hidden-states connector) or the file cannot be read here (the server's
            ``shared_storage_path`` must be a folder this process sees).
    """
    from safetensors.torch import load_file

    params = answer.get("kv_transfer_params") or {}
    path = params.get("hidden_states_path")
    if not path:
        raise Eagle3Error("the vLLM answer names no hidden_states_path; launch the server with "
                          "--speculative-config method extract_hidden_states and a hidden-states kv connector")
    try:
        _wait_for_writer(path)
        data = load_file(path, device="cpu")
    except OSError as e:
        raise Eagle3Error(f"cannot read the hidden states at {path} ({e}); the server's shared_storage_path"
                          f"{'' if storage_dir is None else f' ({storage_dir})'} must be on a disk this process sees") from None
    if not keep:
        _remove(path)
    return data


def _wait_for_writer(path: str) -> None:
    """Block until the connector's writer releases ``path + ".lock"`` (a shared flock; no
    lock file means the write is done). Raises OSError when the lock cannot be opened."""
    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)


def _remove(path: str) -> None:
    """Delete a hidden-states file and its ``.lock`` (either may already be gone)."""
    for p in (path, path + ".lock"):
        try:
            os.remove(p)
        except OSError:
            pass


def discard_hidden_states(answer: Any) -> None:
    """Delete the hidden-states file a capture server wrote for a generation request (the
    connector writes one for every request; only capture requests read theirs), after its
    writer releases the ``.lock``. Answers without a file are ignored; ``answer`` is the
    response body (a dict) or a streamed response's chunks (a list)."""
    bodies = answer if isinstance(answer, list) else [answer]
    for body in bodies:
        path = ((body or {}).get("kv_transfer_params") or {}).get("hidden_states_path") if isinstance(body, dict) else None
        if not path:
            continue
        try:
            _wait_for_writer(path)
        except OSError:
            pass
        _remove(path)
