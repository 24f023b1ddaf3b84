"""Spreading requests over data-parallel SGLang servers.

:func:`run_parallel` runs ``concurrency`` threads per server; all of them take item
indices from one shared queue, so each item is processed exactly once, and results are
stored at their item's index. A server that keeps failing is dropped and its item goes
back on the queue for the others.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Sequence, TypeVar

from eagle3.engines.sglang.client import ServerUnavailable, SGLangClient
from eagle3.errors import Eagle3Error

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


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
    if n == 0:
        return []
    bar = tqdm(total=n, desc=desc, disable=not progress, leave=False)
    pool = _Pool(clients, items, fn, bar)
    threads = [
        threading.Thread(target=pool.worker, args=(ci,), daemon=True, name=f"sglang-{ci}-{k}")
        for ci in range(len(clients))
        for k in range(max(1, int(concurrency)))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    if pool.state["error"] is not None:
        raise pool.state["error"]
    if pool.state["done"] != n:  # pragma: no cover - defensive
        raise Eagle3Error(f"only {pool.state['done']} of {n} {desc} finished")
    return pool.results


class _Pool:
    """The state the worker threads of one :func:`run_parallel` call share.

    ``todo`` holds the indices of the items not taken yet, ``results[i]`` the result of
    item ``i``; ``state`` counts the finished items and the servers still in use and
    keeps the first error, ``dead`` the indices of dropped servers. ``lock`` guards
    ``state`` and ``dead``; ``stop`` ends every worker.
    """

    def __init__(self, clients: Sequence[SGLangClient], items: Sequence[Any], fn: Callable, bar: Any):
        self.clients, self.items, self.fn, self.bar = clients, items, fn, bar
        self.n = len(items)
        self.results: list[Any] = [None] * self.n
        self.todo: queue.Queue[int] = queue.Queue()
        for i in range(self.n):
            self.todo.put(i)
        self.lock = threading.Lock()
        self.state = {"done": 0, "alive": len(clients), "error": None, "unavailable": []}
        self.stop = threading.Event()
        self.dead: set[int] = set()

    def worker(self, ci: int) -> None:
        """Send items to server ``ci`` until all are done, the server is dropped or the
        run stops."""
        client = self.clients[ci]
        while not self.stop.is_set():
            if ci in self.dead:
                return
            try:
                i = self.todo.get(timeout=0.05)
            except queue.Empty:
                with self.lock:
                    if self.state["done"] >= self.n:
                        return
                continue
            try:
                r = self.fn(client, self.items[i])
            except ServerUnavailable as e:
                self.todo.put(i)
                self._drop(ci, client, e)
                return
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                with self.lock:
                    if self.state["error"] is None:
                        self.state["error"] = e
                self.stop.set()
                return
            self._finish(i, r)

    def _drop(self, ci: int, client: SGLangClient, e: ServerUnavailable) -> None:
        """Take server ``ci`` out of the pool (once); with none left the run fails with ``e``."""
        with self.lock:
            if ci not in self.dead:
                self.dead.add(ci)
                self.state["alive"] -= 1
                self.state["unavailable"].append(str(e))
                log.warning("dropping %s from the pool: %s", client.url, e)
                if self.state["alive"] == 0:
                    self.state["error"] = e
                    self.stop.set()

    def _finish(self, i: int, r: Any) -> None:
        """Store the result of item ``i``; the last one stops the run."""
        self.results[i] = r
        with self.lock:
            self.state["done"] += 1
            if self.state["done"] >= self.n:
                self.stop.set()
        self.bar.update(1)
