"""A hidden-states connector for vLLM's CPU build, loaded by the vLLM server itself.

vLLM's ``extract_hidden_states`` speculative method stores the target's aux hidden states
(``eagle_aux_hidden_state_layer_ids``, HF ``output_hidden_states`` indices) of every prompt
token in a cache-only attention layer; its reference connector
(``vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``) copies
them out with CUDA streams and events, which a CPU build does not have. This subclass does
the same copy synchronously on the CPU and keeps the rest (file per request, the ``.lock``
companion that a reader waits on, ``kv_transfer_params.hidden_states_path`` in the answer).

This file runs inside the vLLM server's own environment: it imports vLLM and torch only
(not ``eagle3``), and the server finds it through ``PYTHONPATH`` (see
``eagle3.engines.vllm.capture``). Launch with::

    --kv-transfer-config '{"kv_connector": "CPUHiddenStatesConnector",
      "kv_connector_module_path": "eagle3_cpu_hidden_states", "kv_role": "kv_producer",
      "kv_connector_extra_config": {"shared_storage_path": DIR}}'
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """A finished copy: the CPU copy below is synchronous."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """:class:`ExampleHiddenStatesConnector` with the cache read done on the CPU."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        n = pending.token_ids.shape[0]
        tensors = {"hidden_states": extract_from_kv_cache(self._kv_cache, slots, n).clone().contiguous(),
                   "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
