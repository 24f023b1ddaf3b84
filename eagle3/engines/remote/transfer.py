"""One capture as one Mooncake object: the packed layout, publish and fetch.

The layout is hs-connectors' (``packed_layout``: tensors at 64-byte-aligned offsets of one
raw object, described by a versioned transfer manifest that travels separately); the store
is its ``MooncakeHiddenStatesStore`` (Mooncake's ``MooncakeDistributedStore`` underneath:
a put becomes visible whole, so a present object is a complete sample).
"""

from __future__ import annotations

from typing import Any

from eagle3.errors import Eagle3Error
from eagle3.features import Capture

NAMES = ("aux_hidden_states", "topk_ids", "topk_logprobs")


def open_store(master: str, local_hostname: str = "127.0.0.1", protocol: str = "tcp",
               segment_mb: int = 1024, buffer_mb: int = 512, device_name: str = ""):
    """A set-up ``hs_connectors.mooncake_store.MooncakeHiddenStatesStore``.

    Args:
        master: the Mooncake master's ``host:port`` (``mooncake_master --port 50051``).
        local_hostname: the address other hosts reach this process at.
        protocol: ``tcp``, or ``rdma`` (with ``device_name``, e.g. ``mlx5_0``).
        segment_mb: memory this process contributes to the store, MiB.
        buffer_mb: this process's local transfer buffer, MiB.

    Raises:
        Eagle3Error: hs-connectors or Mooncake is not installed (with the install line), or
            the store cannot be set up (the master is not reachable).
    """
    try:
        from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
    except ImportError as e:
        raise Eagle3Error(f"engine=remote needs hs-connectors ({e}): pip install --no-deps hs-connectors==0.9.0") from None
    cfg = MooncakeStoreConfig(local_hostname=local_hostname, master_server_address=master, protocol=protocol,
                              global_segment_size=int(segment_mb) << 20, local_buffer_size=int(buffer_mb) << 20,
                              device_name=device_name)
    try:
        return MooncakeHiddenStatesStore(cfg).setup()
    except ImportError as e:
        raise Eagle3Error(f"engine=remote needs Mooncake ({e}): pip install mooncake-transfer-engine-non-cuda"
                          "==0.3.13.post1 (CPU) or mooncake-transfer-engine (CUDA)") from None
    except RuntimeError as e:
        raise Eagle3Error(f"the Mooncake store at master {master} could not be set up ({e}); start the master "
                          "(mooncake_master --port PORT) and pass engine.master=HOST:PORT") from None


def manifest(handle: str, cap: Capture) -> dict[str, Any]:
    """The transfer manifest of ``cap`` stored under ``handle`` (hs-connectors' version-1 layout):
    ``{"version", "handle", "tensors": {name: {shape, dtype, nbytes, offset}}, "metadata":
    {"total_aligned_bytes"}}``."""
    from hs_connectors.mooncake_store import VERSION, packed_layout

    tensors = {n: getattr(cap, n) for n in NAMES}
    spec, total = packed_layout({n: (tuple(t.shape), t.dtype) for n, t in tensors.items()})
    return {"version": VERSION, "handle": handle, "tensors": spec, "metadata": {"total_aligned_bytes": total}}


def publish(store, handle: str, cap: Capture) -> dict[str, Any]:
    """Put ``cap`` (``[T, 3, H]`` bf16, ``[T, k]`` int32, ``[T, k]`` float32, on any device) into
    ``store`` as one object under ``handle``; returns its manifest (:func:`manifest`)."""
    m = manifest(handle, cap)
    store.put_sample(m, {n: getattr(cap, n).contiguous() for n in NAMES})
    return m


def fetch(store, m: dict[str, Any], timeout_s: float = 120.0) -> Capture:
    """Wait up to ``timeout_s`` for the object of manifest ``m``, read it into CPU tensors and
    remove it from the store.

    Raises:
        Eagle3Error: the object did not appear in time, or failed the manifest's checks
            (size, bounds, dtype; hs-connectors' ``MooncakeIntegrityError``).
    """
    from hs_connectors.mooncake_store import MooncakeIntegrityError

    try:
        got = store.get_sample(m, timeout=float(timeout_s))
    except (MooncakeIntegrityError, TimeoutError, RuntimeError) as e:
        raise Eagle3Error(f"capture {m.get('handle')} could not be read from the Mooncake store: {e}") from None
    finally:
        try:
            store.delete_sample(m["handle"])
        except RuntimeError:
            pass  # already gone; the store evicts what is left
    missing = [n for n in NAMES if n not in got]
    if missing:
        raise Eagle3Error(f"capture {m.get('handle')} lacks {missing}")
    return Capture(*(got[n] for n in NAMES))
