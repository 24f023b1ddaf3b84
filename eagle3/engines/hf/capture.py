"""Capture's work per batch after the forward pass: ranking, log-probs, copies to the host.

The capture contract (:class:`eagle3.features.Capture`) stores, for every position, the
target's top-k next-token ids (ties by the lower id, :func:`eagle3.features.format.rank_top_k`)
and their float32 log-probabilities under the full vocabulary. A full ``topk`` over a
49,152-wide float32 row, a second pass for ties and a float32 ``log_softmax`` of every chunk
made capture cost 3-4 bare forward passes on one H200 (docs/performance.md). Here:

- :func:`rank_top_k_blocks` ranks the bf16 logits as given, in two stages: the maximum of each
  block of 128 ids, the ``k`` best blocks, then :func:`rank_top_k` over those ``k x 128``
  candidates only. The result is identical to :func:`rank_top_k` on the whole row (proof in
  the docstring).
- :func:`block_max_and_logsumexp` computes the first stage's block maxima and the float32
  log-normaliser of each row together, compiled on CUDA (``torch.compile``), so no float32 copy
  of a chunk is built; the log-probs are ``logit - logsumexp``, which is ``log_softmax``
  gathered at the ids.
- :class:`HostCopies` moves each batch's results into pinned host memory on a side stream and
  hands them out once copied, so the device-to-host copies overlap the next batches' forward.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Optional

import torch

from eagle3.features import rank_top_k

log = logging.getLogger("eagle3")

BLOCK = 128  # ids per block of the first ranking stage (V = 49,152 is 384 blocks)
LOGITS_CHUNK_BYTES = 1 << 29  # logits of one ranking chunk, in the model dtype: 512 MiB


def rank_top_k_blocks(logits: torch.Tensor, k: int, block: int = BLOCK,
                      block_max: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rank_top_k` in two stages: ``k`` blocks of ``block`` ids first, then their ids.

    Why it is exact. Order ids by (logit descending, id ascending) and blocks by (block
    maximum descending, block index ascending). Take an id ``e`` of the true top-k whose block
    ``B`` is not among the first ``k`` blocks. Each of those ``k`` blocks has a maximum above
    ``max(B) >= logit(e)``, or equal to it at a lower block index, i.e. at lower ids than
    ``e``; so each holds an id that ranks before ``e``: ``k`` ids before ``e``, which then is
    not in the top-k. Hence the top-k lies in the first ``k`` blocks, and ranking their ids
    (kept in id order) with :func:`rank_top_k` gives the same ids, ties by the lower id.

    Args:
        logits: ``[n, V]`` float logits of any float dtype (bf16 as the model computes them;
            compared as given).
        k: ``1 <= k <= V``.
        block: ids per block; a row whose ``V`` is not a multiple is padded with ``-inf``
            at its end (higher ids, so they never displace a real id).
        block_max: ``[n, ceil(V / block)]``, each block's maximum, if already computed
            (:func:`block_max_and_logsumexp`).

    Returns:
        ``(ids [n, k] int64, values [n, k])`` equal to ``rank_top_k(logits, k)``; values in
        the dtype of ``logits``. With ``k * block >= V`` it is ``rank_top_k`` itself.
    """
    n, V = logits.shape
    nb = -(-V // block)
    if k * block >= V:
        return rank_top_k(logits, k)
    x = logits
    if nb * block != V:
        x = torch.nn.functional.pad(logits, (0, nb * block - V), value=float("-inf"))
    xb = x.view(n, nb, block)
    maxima = xb.amax(-1) if block_max is None else block_max  # [n, nb]
    best = maxima.sort(dim=-1, descending=True, stable=True).indices[:, :k]  # [n, k] blocks
    blocks = best.sort(dim=-1).values  # in id order, so "lower candidate" means "lower id"
    cand = xb.gather(1, blocks.unsqueeze(-1).expand(n, k, block)).reshape(n, k * block)
    cand_ids = (blocks.unsqueeze(-1) * block + torch.arange(block, device=logits.device)).reshape(n, k * block)
    j, vals = rank_top_k(cand, k)
    return cand_ids.gather(-1, j), vals


def _logsumexp_float(x: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(x.float(), dim=-1)


def _block_max_and_lse(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, V = x.shape
    return x.view(n, V // BLOCK, BLOCK).amax(-1), torch.logsumexp(x.float(), dim=-1)


_COMPILED: dict[str, Callable] = {}  # name -> the compiled function, or the eager one after a failure


def _run_compiled(name: str, fn: Callable, x: torch.Tensor):
    """``fn(x)`` through ``torch.compile(fn, dynamic=True)``, compiled once per process (inductor
    caches it on disk across processes). If compiling or running the compiled code fails for any
    reason but out-of-memory, that is logged once and ``fn`` runs eagerly from then on; a
    ``torch.OutOfMemoryError`` propagates (the capture's batch back-off handles it)."""
    run = _COMPILED.get(name)
    if run is None:
        run = _COMPILED[name] = torch.compile(fn, dynamic=True)
    try:
        return run(x)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a compiler failure must not stop an extraction
        why = (str(e).splitlines() or [type(e).__name__])[0]
        log.warning("capture: the compiled %s failed (%s); running it eagerly", name, why)
        _COMPILED[name] = fn
        return fn(x)


def block_max_and_logsumexp(logits: torch.Tensor) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """The first ranking stage and the log-normaliser, compiled together.

    ``logits [n, V]`` (on CUDA, ``V`` a multiple of :data:`BLOCK`) -> ``(block maxima [n,
    V / BLOCK]`` in the logits' dtype, ``logsumexp [n]`` float32), compiled by inductor
    (:func:`_run_compiled`): the float32 cast is fused into the reduction, so no float32 copy of
    the chunk is built. Elsewhere ``(None, row_logsumexp(logits))``, and
    :func:`rank_top_k_blocks` takes the maxima itself.
    """
    if not logits.is_cuda or logits.shape[1] % BLOCK:
        return None, row_logsumexp(logits)
    return _run_compiled("first ranking stage", _block_max_and_lse, logits)


def row_logsumexp(logits: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """``logsumexp`` of each row in float32: ``[n, V]`` (any float dtype) -> ``[n]`` float32.

    On CUDA with ``fused`` the float32 cast is fused into the reduction (:func:`_run_compiled`);
    elsewhere the eager ``torch.logsumexp(logits.float())``. ``logits[i, j] -
    row_logsumexp(logits)[i]`` is float32 ``log_softmax(logits.float())[i, j]`` up to float32
    rounding.
    """
    if not (fused and logits.is_cuda):
        return _logsumexp_float(logits)
    return _run_compiled("logsumexp", _logsumexp_float, logits)


def top_k_logprobs(hidden: torch.Tensor, lm_head: torch.nn.Module, k: int, fast: bool = True,
                   softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k next tokens and their log-probs at each of ``N`` positions.

    ``lm_head`` runs on chunks of rows (at most ``LOGITS_CHUNK_BYTES`` of logits in the model
    dtype), so no ``[N, V]`` tensor is built.

    Args:
        hidden: ``[N, H]`` final-norm hidden states (model dtype), on the model's device.
        lm_head: the target's output projection ``H -> V``.
        k: ``1 <= k <= V``.
        fast: rank with :func:`rank_top_k_blocks` on the model-dtype logits and take log-probs
            as ``logit - row_logsumexp``; ``False`` is the reference path (float32 copy,
            :func:`rank_top_k` over the whole row, ``log_softmax``), kept for tests and the
            benchmark. Both give the same ids and log-probs to float32 rounding.
        softcap: the model's ``final_logit_softcapping`` (Gemma 2 and 3), applied as its forward
            does: ``softcap * tanh(logits / softcap)`` in the model dtype; ``None``: none.

    Returns:
        ``(ids [N, k] int32, logprobs [N, k] float32)`` on ``hidden``'s device.
    """
    N = hidden.shape[0]
    V = lm_head.weight.shape[0]
    ids = torch.empty((N, k), dtype=torch.int32, device=hidden.device)
    lps = torch.empty((N, k), dtype=torch.float32, device=hidden.device)
    rows = max(1, LOGITS_CHUNK_BYTES // (hidden.element_size() * V))
    for a in range(0, N, rows):
        logits = lm_head(hidden[a : a + rows])  # [n, V], model dtype
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        if fast:
            bmax, lse = block_max_and_logsumexp(logits)
            i_, v = rank_top_k_blocks(logits, k, block_max=bmax)
            lp = v.float() - lse.unsqueeze(-1)
        else:
            logits = logits.float()
            i_, _ = rank_top_k(logits, k)
            lp = torch.log_softmax(logits, dim=-1).gather(-1, i_)
        ids[a : a + rows] = i_.to(torch.int32)
        lps[a : a + rows] = lp
    return ids, lps


class HostCopies:
    """Device-to-host copies of each batch's results that overlap the next batches' work.

    :meth:`submit` queues the copies of one batch's tensors into fresh pinned host tensors on
    a side stream and returns at once; a batch is handed to its ``done`` callback, in order,
    once its copy has finished (checked at each :meth:`submit`, waited for at
    :meth:`finish`). The callback gets the pinned tensors themselves: a copy into pageable
    memory cost the host more than the GPU's whole capture on one H100 (docs/performance.md).
    Pinned blocks come from PyTorch's caching host allocator, so once a caller drops the
    results of one call (extraction writes one shard, 256 MB by default), the next call
    reuses them. The device tensors are marked as used by the side stream
    (``record_stream``), so their memory returns to the allocator once their copy is done, while
    the next batch runs. On a CPU device the tensors are handed over at once (nothing to copy).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._pending: list[tuple] = []

    def submit(self, tensors: tuple[torch.Tensor, ...], done: Callable[..., None]) -> None:
        """Queue ``tensors`` (on the device) for the host; ``done(*host_tensors)`` is called later."""
        if not self.cuda:
            done(*tensors)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            hosts = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in tensors)
            for t in tensors:  # their memory is reused only once the copy is done, not kept until then
                t.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        while self._pending and self._pending[0][0].query():  # earlier batches first
            self._hand_over(self._pending.pop(0))
        self._pending.append((event, hosts, done))

    def _hand_over(self, item: tuple) -> None:
        event, hosts, done = item
        event.synchronize()
        done(*hosts)

    def finish(self) -> None:
        """Wait for every queued copy and hand each batch to its callback, in order."""
        while self._pending:
            self._hand_over(self._pending.pop(0))

    def drop(self) -> None:
        """Forget the batches in flight (after an error, their results are not wanted)."""
        for event, *_ in self._pending:
            event.synchronize()
        self._pending.clear()


@contextlib.contextmanager
def aux_hooks(layers, norm, aux_layer_ids: list[int], store: dict[int, torch.Tensor]):
    """Forward pre-hooks storing the residual stream entering each aux layer id in ``store``.

    Id ``k < L`` is the input of decoder layer ``k``, id ``L`` the input of the final ``norm``
    (HF ``output_hidden_states[k]``; :mod:`eagle3.target.layers`).
    """
    handles = []
    for k in aux_layer_ids:
        module = layers[k] if k < len(layers) else norm

        def hook(mod, args, kwargs, k=k):
            store[k] = args[0] if args else kwargs["hidden_states"]

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
