"""CUDA graph capture and replay of fixed-shape forwards (the verify pass, decode steps, draft steps).

At batch 1 a small target's forward is bound by kernel launches and Python, not by the
GPU: on one H200 an eager forward of 1, 4 or 8 tokens of a 30-layer 135M Llama costs the
same ~24 ms. A CUDA graph records the forward's kernels once and replays them with one
launch. :class:`GraphedCall` does that per *key* (a shape signature chosen by the
caller): the first call with a key copies its inputs into static buffers, runs the
function twice on a side stream (kernel selection, allocator warm-up), captures it
(``torch.cuda.graph``), then every call copies the new inputs into the static buffers,
replays, and returns clones of the static outputs.

The function must be a pure function of its tensor inputs apart from in-place writes
to buffers that live as long as the graph (the KV cache of :mod:`eagle3.runtime.slots`):
no host syncs, no Python branching on tensor values, no tensor allocated once and
reused outside the call. Running it during warm-up repeats the same writes, so warm-up
leaves the same state as one call. Graphs of different keys use separate memory pools,
so one graph's replay never overwrites another's outputs.

With ``enabled=False`` (CPU, or a CUDA run with graphs switched off) the function is
simply called: the same code path, eager, which is what the CPU tests check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence

import torch


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


class GraphedCall:
    """``fn(*inputs) -> tuple of tensors``, replayed from a CUDA graph per key when enabled.

    Args:
        fn: the function; tensors in, a tuple of tensors out (see the module docstring
            for what it may do).
        enabled: capture and replay (needs CUDA tensors); False calls ``fn`` directly.
        warmup: eager runs on a side stream before capture.
        max_graphs: keep at most this many graphs, dropping the least recently used one
            (its memory pool with it) before capturing another; None = keep every graph.

    Attributes:
        captures: keys of the graphs held, least recently used first (a key's capture
            costs ``warmup + 1`` eager runs and the recording).
    """

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], enabled: bool, warmup: int = 2,
                 max_graphs: Optional[int] = None):
        self.fn, self.enabled, self.warmup = fn, bool(enabled), int(warmup)
        self.max_graphs = max_graphs
        self._graphs: dict[Hashable, _Graph] = {}

    @property
    def captures(self) -> list[Hashable]:
        return list(self._graphs)

    def __call__(self, key: Hashable, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run ``fn(*inputs)``; with graphs on, from the graph of ``key`` (captured on first use).

        Raises:
            ValueError: ``inputs`` do not have the shapes the graph of ``key`` was captured with.
        """
        if not self.enabled:
            return self.fn(*inputs)
        g = self._graphs.pop(key, None)
        if g is None:
            while self.max_graphs is not None and len(self._graphs) >= self.max_graphs:
                self._graphs.pop(next(iter(self._graphs)))  # the least recently used
            g = self._capture(inputs)
        self._graphs[key] = g  # most recently used last
        for static, x in zip(g.inputs, inputs):
            if static.shape != x.shape:
                raise ValueError(f"graph {key!r} was captured for input shape {tuple(static.shape)}, got {tuple(x.shape)}")
            static.copy_(x, non_blocking=True)
        g.graph.replay()
        return tuple(o.clone() for o in g.outputs)

    def _capture(self, inputs: Sequence[torch.Tensor]) -> _Graph:
        static = tuple(x.clone() for x in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.fn(*static)
        return _Graph(graph, static, tuple(outputs))
