"""Online training (``train.py features=online``): the capture engine computes the features while the drafter trains.

The training split is read as kept replies (``input_ids``, ``loss_mask``: a replies-only
folder of ``extract.py features=none``, or the ids of a features folder), in the run's
global batch plan (:class:`eagle3.train.data.BatchPlan`). A producer thread walks this
process's micro-batches in that order: it captures each micro-batch's aux hidden states and
target top-k with the engine (``engine=hf``: the target in this process, on the trainer's
device; or a capture server), collates it (:class:`eagle3.train.ttt.TTTCollator`) and puts
it in a bounded queue of ``features.queue_depth`` micro-batches; the training loop takes
them in order. On CUDA the producer runs on its own stream, so the target's forward overlaps
the drafter's step. This is how SpecForge, speculators and ModelOpt train at scale: no
features store (Kimi-K2.5's aux states are 3 x 7168 x 2 B = 43 KB a token).

Exactness: one micro-batch is one ``engine.capture`` call over the same sequences in the
same order whatever happened before, so a resumed run (which starts at the micro-batch after
its checkpoint) captures exactly what an uninterrupted run captured there, and the same ids
captured offline with the same engine, dtype and batching give the same tensors
(``tests/test_online.py``). A capture server that fails is retried on the same micro-batch
(training waits) for up to ``features.retry_timeout_s`` seconds: no batch is skipped or
repeated. With ``features.cache_gb`` the captured features are kept on disk up to that budget
and read back in later epochs (:mod:`eagle3.train.feature_cache`).

Measured and reported (:class:`OnlineStats`, ``metrics.json``'s ``features`` block and the
``features/*`` tracker scalars): the trainer's idle fraction (time waiting on the queue over
training time), the capture rate (tokens/s while capturing) and the trainer's rate.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from eagle3.engines.http import RequestRefused
from eagle3.errors import Eagle3Error
from eagle3.train.feature_cache import FeatureCache

log = logging.getLogger("eagle3")

# micro-batches collated (TTTCollator, pinning) at once while the next is captured: on one H100 the collation
# of a 16K-token micro-batch took about as long as the drafter's step, and done in line it held the
# in-process capture to 0.35x offline training (docs/performance.md, online training)
COLLATE_THREADS = 2
# engine.compile_layers=null (auto) for the in-process capture engine of online training: on
# (CUDA only; eagle3.spec.compiled.wants_compile). One H100, 2,000 replies, 3 rounds: online
# training ran at 0.642x offline compiled against 0.554x eager (docs/performance.md); the
# compilation costs about 15 s once.
ONLINE_COMPILE_LAYERS = True
SLOW_PRODUCER_IDLE = 0.10  # the trainer idle more than this fraction: the capture engine is reported as too slow


@dataclass
class OnlineStats:
    """What online capture did in this launch (seconds are wall clock, ``time.perf_counter``).

    ``captured_*``: samples and tokens the engine captured, ``capture_s`` the time inside its
    ``capture`` calls (retries included); ``cached_*``: samples and tokens read back from the
    hybrid cache; ``retries``: failed capture calls retried; ``wait_s``: time the training loop
    waited for a micro-batch (``first_wait_s`` of it for the first one: the pipeline filling);
    ``batches``: training micro-batches handed over.
    """

    captured_samples: int = 0
    captured_tokens: int = 0
    capture_s: float = 0.0
    cached_samples: int = 0
    cached_tokens: int = 0
    retries: int = 0
    wait_s: float = 0.0
    first_wait_s: float = 0.0
    batches: int = 0

    def report(self, train_time_s: float, train_tokens: int) -> dict:
        """The counters plus ``idle_fraction`` (``wait_s / train_time_s``),
        ``capture_tokens_per_s`` (captured tokens over ``capture_s``) and
        ``trainer_tokens_per_s`` (``train_tokens`` over the time not spent waiting)."""
        busy = max(train_time_s - self.wait_s, 1e-9)
        return {
            **asdict(self),
            "idle_fraction": self.wait_s / train_time_s if train_time_s > 0 else None,
            "capture_tokens_per_s": self.captured_tokens / self.capture_s if self.capture_s > 0 else None,
            "trainer_tokens_per_s": train_tokens / busy if train_tokens else None,
        }


@dataclass
class _Failed:
    """A producer's exception, handed to the consumer to raise."""

    error: BaseException


class OnlineFeatures:
    """The capture side of online training: features for micro-batches of kept replies.

    Args:
        engine: an :class:`eagle3.engines.Engine` serving the target (its ``capture``:
            sequences -> ``Capture(aux [T, 3, H] bf16, topk_ids [T, k] int32, topk_logprobs
            [T, k] float32)`` CPU tensors).
        top_k: the target distribution's size (the replies folder's ``capture.top_k``).
        max_length: tokens of a sample captured (the micro-batch budget; the collator cuts
            to it too).
        queue_depth: captured micro-batches that may wait for the trainer.
        cache: the hybrid cache, or None.
        remote: the engine is a server: a failing capture is retried for ``retry_timeout_s``.
        pin_memory: pin the collated host tensors (CUDA).
    """

    def __init__(self, engine: Any, top_k: int, max_length: int, queue_depth: int = 4,
                 cache: Optional[FeatureCache] = None, remote: bool = False, retry_timeout_s: float = 600.0,
                 pin_memory: bool = False):
        if queue_depth < 1:
            raise Eagle3Error(f"features.queue_depth={queue_depth} must be >= 1 (micro-batches captured ahead)")
        self.engine, self.top_k, self.max_length = engine, int(top_k), int(max_length)
        self.queue_depth, self.cache, self.remote = int(queue_depth), cache, bool(remote)
        self.retry_timeout_s, self.pin_memory = float(retry_timeout_s), bool(pin_memory)
        self.stats = OnlineStats()
        self._lock = threading.Lock()  # one capture at a time (training and validation producers share the engine)
        device = getattr(engine, "device", None)
        self._cuda = isinstance(device, torch.device) and device.type == "cuda"

    # ------------------------------------------------------------------ capture
    def features_of(self, samples: Sequence[dict]) -> list[dict]:
        """``samples`` (kept-reply items: ``input_ids [T]``, ``loss_mask [T]``, ``sample_id``) with
        their features added (``aux_hidden_states [T', 3, H]`` bf16, ``topk_ids [T', k]`` int32,
        ``topk_logprobs [T', k]`` float32, ``T' = min(T, max_length)``): read from the cache where
        it holds them, the rest captured in one ``engine.capture`` call (and cached while the
        budget lasts).

        Raises:
            Eagle3Error: the engine's (after ``retry_timeout_s`` of retries for a server), or a
                capture of the wrong length.
        """
        with self._lock:
            out = [dict(s) for s in samples]
            need = []
            for s in out:
                hit = self.cache.get(s["sample_id"]) if self.cache is not None else None
                if hit is None:
                    need.append(s)
                    continue
                s.update(hit)
                self.stats.cached_samples += 1
                self.stats.cached_tokens += int(hit["aux_hidden_states"].shape[0])
            if not need:
                return out
            seqs = [s["input_ids"][: self.max_length].tolist() for s in need]
            t0 = time.perf_counter()
            caps = self._capture(seqs)
            self.stats.capture_s += time.perf_counter() - t0
            feats = []
            for s, seq, cap in zip(need, seqs, caps):
                if cap.aux_hidden_states.shape[0] != len(seq):
                    raise Eagle3Error(f"the capture engine returned {cap.aux_hidden_states.shape[0]} positions for the "
                                      f"{len(seq)} tokens of sample {s['sample_id']}")
                f = {"aux_hidden_states": cap.aux_hidden_states, "topk_ids": cap.topk_ids,
                     "topk_logprobs": cap.topk_logprobs}
                s.update(f)
                feats.append(f)
                self.stats.captured_tokens += len(seq)
            self.stats.captured_samples += len(need)
            if self.cache is not None:
                self.cache.put([s["sample_id"] for s in need], feats)
            return out

    def _capture(self, seqs: list[list[int]]) -> list:
        """``engine.capture(seqs, top_k)``; for a server, retried (backing off up to 30 s) until it
        answers or ``retry_timeout_s`` has passed."""
        if not self.remote:
            return self.engine.capture(seqs, self.top_k)
        deadline, wait = time.monotonic() + self.retry_timeout_s, 1.0
        while True:
            try:
                return self.engine.capture(seqs, self.top_k)
            except RequestRefused:
                raise  # a 4xx: the same request fails again; the server's sentence says what to change
            except (Eagle3Error, OSError) as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Eagle3Error(f"the capture server failed on one micro-batch for {self.retry_timeout_s:.0f} s "
                                      f"({e}); restart it and run the same train.py command again to resume, or raise "
                                      "features.retry_timeout_s") from None
                self.stats.retries += 1
                log.warning("capture failed (%s); the same micro-batch is tried again in %.0f s (training waits)", e,
                            min(wait, left))
                time.sleep(min(wait, left))
                wait = min(2 * wait, 30.0)

    # ------------------------------------------------------------------ loading
    def loader(self, ds: Any, batch_lists: list[list[int]], collate_fn: Callable, train: bool = True) -> "Prefetch":
        """An iterable of the collated micro-batches of ``batch_lists`` (indices into ``ds``, a
        ``FeatureDataset(features=False)``), captured ``queue_depth`` ahead by a producer thread.
        ``train``: count the consumer's waits in :attr:`stats` (validation's are not)."""
        return Prefetch(self, ds, batch_lists, collate_fn, train)

    def close(self) -> None:
        """Close the engine (idempotent)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None


class Prefetch:
    """A bounded producer/consumer pipeline over one list of micro-batches (see :meth:`OnlineFeatures.loader`).

    Iterating starts the producer thread; leaving the loop early (a break, an exception)
    stops it after its current capture. A producer's exception is raised in the consumer.
    """

    def __init__(self, online: OnlineFeatures, ds: Any, batch_lists: list[list[int]], collate_fn: Callable,
                 train: bool):
        self.online, self.ds, self.batch_lists, self.collate_fn, self.train = online, ds, batch_lists, collate_fn, train

    def __len__(self) -> int:
        return len(self.batch_lists)

    def _collate(self, samples: list[dict]) -> dict:
        batch = self.collate_fn(samples)
        if self.online.pin_memory:
            batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return batch

    def _produce(self, q: "queue.Queue", stop: threading.Event) -> None:
        """Capture the micro-batches in order; each one's collation (and pinning) runs on a pool
        of :data:`COLLATE_THREADS` while the next is captured. The queue holds their futures, in
        order, so the consumer gets the batches in the plan's order."""
        stream = torch.cuda.Stream() if self.online._cuda else None
        pool = ThreadPoolExecutor(max_workers=COLLATE_THREADS, thread_name_prefix="eagle3-collate")
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for b in self.batch_lists:
                    if stop.is_set():
                        return
                    feats = self.online.features_of([self.ds[i] for i in b])
                    if not _put(q, pool.submit(self._collate, feats), stop):
                        return
        except BaseException as e:  # noqa: BLE001  (raised again in the consumer)
            _put(q, _Failed(e), stop)
        finally:
            pool.shutdown(wait=True, cancel_futures=stop.is_set())  # queued collations are still to be taken

    def __iter__(self) -> Iterator[dict]:
        q: queue.Queue = queue.Queue(maxsize=self.online.queue_depth)
        stop = threading.Event()
        worker = threading.Thread(target=self._produce, args=(q, stop), name="eagle3-capture", daemon=True)
        worker.start()
        stats = self.online.stats
        try:
            for n in range(len(self.batch_lists)):
                t0 = time.perf_counter()
                while True:
                    try:
                        item = q.get(timeout=1.0)
                        break
                    except queue.Empty:
                        if not worker.is_alive() and q.empty():
                            raise Eagle3Error("the capture thread of features=online ended without its micro-batches")
                if isinstance(item, Future):
                    item = item.result()  # the collation's error, if any, is raised here
                waited = time.perf_counter() - t0
                if self.train:
                    stats.wait_s += waited
                    stats.first_wait_s += waited if stats.batches == 0 else 0.0
                    stats.batches += 1
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:
            stop.set()
            while worker.is_alive():
                try:
                    left = q.get(timeout=0.1)
                    if isinstance(left, Future):
                        left.cancel()
                except queue.Empty:
                    pass
            worker.join()


def _put(q: "queue.Queue", item: Any, stop: threading.Event) -> bool:
    """Put ``item`` on ``q``, giving up (False) once ``stop`` is set."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def build_online(cfg: Any, target: Any, train_ds: Any, output_dir: Path, accelerator: Any, max_tokens: int,
                 engine: Optional[Any] = None) -> OnlineFeatures:
    """The capture side of a ``features=online`` run, after the replies were checked against the target.

    Args:
        cfg: the :class:`eagle3.config.TrainConfig` (``engine``, ``features``, ``model``).
        target: the ``TargetInfo`` trained for.
        train_ds: the training split as kept replies (its manifest gives ``capture.top_k`` and
            the chat template hash the replies were rendered with).
        output_dir: the run's folder (the hybrid cache's default home).
        accelerator: the run's ``Accelerator`` (an ``hf`` engine with ``device=auto`` runs on its device).
        max_tokens: the micro-batch budget (a sample is captured up to it, as the collator cuts it).
        engine: a capture engine to use instead of building ``cfg.engine`` (tests).

    Raises:
        Eagle3Error: the replies were rendered with another chat template than the target's
            tokenizer has (refused before the first step), or what building the engine raises.
    """
    from eagle3.engines import build_engine
    from eagle3.target import chat_template_hash, load_tokenizer

    meta = train_ds.metadata
    ecfg = cfg.engine
    built = engine is None
    if built:
        if getattr(ecfg, "name", None) == "hf" and getattr(ecfg, "device", "auto") == "auto":
            ecfg = dataclasses.replace(ecfg, device=str(accelerator.device))
        if getattr(ecfg, "name", None) == "hf" and getattr(ecfg, "compile_layers", False) is None:
            ecfg = dataclasses.replace(ecfg, compile_layers=ONLINE_COMPILE_LAYERS)
        engine = build_engine(cfg.model, ecfg, cfg.cache_dir, output_dir)
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None and built:
        tokenizer = load_tokenizer(cfg.model, cfg.cache_dir, target)
    want = meta.get("chat_template_hash")
    if tokenizer is not None and want and chat_template_hash(tokenizer) != want:
        engine.close()
        raise Eagle3Error(
            f"the kept replies in {cfg.features_dir} were rendered with chat template {want}, but model={target.name}'s "
            f"tokenizer has {chat_template_hash(tokenizer)}; train with the model and chat_template they were extracted "
            "with, or extract them again"
        )
    fcfg = cfg.features
    cache = None
    if float(fcfg.cache_gb) > 0:
        folder = Path(fcfg.cache_dir) if fcfg.cache_dir else output_dir / "feature_cache"
        if accelerator.num_processes > 1:
            folder = folder / f"rank-{accelerator.process_index}"
        cache = FeatureCache(folder, int(float(fcfg.cache_gb) * 1e9))
    top_k = int((meta.get("capture") or {}).get("top_k") or 20)
    remote = getattr(engine, "info", lambda: {})().get("name", "hf") != "hf"
    return OnlineFeatures(engine, top_k, max_tokens, fcfg.queue_depth, cache, remote,
                          fcfg.retry_timeout_s, pin_memory=accelerator.device.type == "cuda")
