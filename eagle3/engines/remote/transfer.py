"""One capture as one Mooncake object: the packed layout, publish and fetch.

The layout is hs-connectors' (``packed_layout``: tensors at 64-byte-aligned offsets of one
raw object, described by a versioned transfer manifest that travels separately); the store
is its ``MooncakeHiddenStatesStore`` (Mooncake's ``MooncakeDistributedStore`` underneath:
a put becomes visible whole, so a present object is a complete sample).

A capture node puts each object into its own segment (:class:`LocalPuts`): the trainer reads
from the node, the node never writes into the trainer's memory, so the trainer's own address
(``engine.local_hostname``) does not decide whether a put succeeds, and a node that stops takes
its unread captures with it instead of leaving some readable. A put replaces an object of the
same name (Mooncake keeps the first one otherwise, and a reused request id would read the old
capture).
"""

from __future__ import annotations

import re
import socket
from typing import Any

from eagle3.errors import Eagle3Error
from eagle3.features import Capture

NAMES = ("aux_hidden_states", "topk_ids", "topk_logprobs")

#: Mooncake's status codes (its ``types.h`` ``ErrorCode``) that a user can act on, and what they mean here.
STATUS = {
    -200: "NO_AVAILABLE_HANDLE: the store is full (raise the node's --segment-mb, or read captures faster)",
    -704: "OBJECT_NOT_FOUND: the object is gone (removed, evicted, or its node stopped)",
    -707: "LEASE_EXPIRED: the object was evicted while being read",
    -800: "TRANSFER_FAIL: the segment holding it could not be reached (its node stopped, or advertises an "
          "address this host cannot reach: the node's --local-hostname)",
    -900: "RPC_FAIL: the Mooncake master did not answer (stopped or unreachable: start it again at the same "
          "address; its clients reconnect by themselves)",
    -901: "RPC_TIMEOUT: the Mooncake master did not answer in time (overloaded or unreachable)",
}


class StoreError(Eagle3Error):
    """A Mooncake store operation failed (the master or a segment is unreachable, the store is
    full); often transient: the node answers it as HTTP 503 and the trainer retries."""


def describe_status(err: Exception) -> str:
    """``err``'s text with the meaning of the Mooncake status code it carries (``status=-900``,
    ``returned -800``), where :data:`STATUS` knows it."""
    text = str(err).split("Transfer manifest:")[0].strip()[:300]  # hs-connectors appends the whole manifest
    m = re.search(r"(?:status=|returned )(-\d+)", text)
    meaning = STATUS.get(int(m.group(1))) if m else None
    return f"{text}; {meaning}" if meaning else text


def parse_address(address: Any, knob: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``.

    Raises:
        Eagle3Error: not ``HOST:PORT`` with a port in 1..65535 (named as ``knob``).
    """
    host, sep, port = str(address or "").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise Eagle3Error(f"{knob}={address!r} must be HOST:PORT, the Mooncake master's RPC port "
                          "(mooncake_master --port PORT, 50051 by default)")
    return host.strip("[]"), int(port)


def check_master(master: str, knob: str = "engine.master", timeout_s: float = 5.0) -> None:
    """Check that a Mooncake master listens at ``master`` before Mooncake's own setup, which
    retries an absent one for about 90 s and a silent one for 10 minutes, uninterruptibly.

    The port must accept a TCP connection, and must not answer an HTTP request (a master's RPC
    port closes the connection on it; the capture node's or the master's metrics port answer).

    Raises:
        Eagle3Error: malformed, unknown host, nothing listening, no answer in ``timeout_s``, or
            an HTTP server there; each with what to pass as ``knob``.
    """
    host, port = parse_address(master, knob)
    start = f"start one there (mooncake_master --port {port}) or pass {knob}=HOST:PORT of a running master"
    try:
        conn = socket.create_connection((host, port), timeout=timeout_s)
    except socket.gaierror as e:
        raise Eagle3Error(f"{knob}={master}: the host {host!r} is unknown ({e.strerror}); pass the master's address") from None
    except ConnectionRefusedError:
        raise Eagle3Error(f"nothing listens at the Mooncake master {knob}={master}; {start}") from None
    except OSError as e:
        raise Eagle3Error(f"the Mooncake master {knob}={master} could not be reached in {timeout_s:g} s ({e}); "
                          f"check that the host is up and the port open to this host, or {start}") from None
    with conn:
        try:
            conn.sendall(b"HEAD / HTTP/1.0\r\n\r\n")
            conn.settimeout(min(2.0, timeout_s))
            answer = conn.recv(16)
        except OSError:
            answer = b""  # closed or silent: what a master's RPC port does with it
    if answer.startswith(b"HTTP/"):
        raise Eagle3Error(f"{knob}={master} is an HTTP server, not a Mooncake master's RPC port (a capture node's "
                          f"--port, or the master's metrics port?); pass the port given to mooncake_master --port")


class LocalPuts:
    """A ``MooncakeDistributedStore`` whose ``put_from`` replaces (``upsert``) an object of the
    same name and places it in this process's own segment; every other call is the store's.

    Args:
        raw: a set-up ``mooncake.store.MooncakeDistributedStore`` with a mounted segment.
    """

    def __init__(self, raw):
        from mooncake.store import ReplicateConfig

        self._raw, self._config = raw, ReplicateConfig()
        try:
            self._config.preferred_segment = raw.get_hostname()
        except (AttributeError, RuntimeError):
            pass  # an older Mooncake: any segment

    def put_from(self, key: str, ptr: int, size: int) -> int:
        """Write ``size`` bytes at ``ptr`` as ``key`` (replacing one already there); Mooncake's status."""
        upsert = getattr(self._raw, "upsert_from", None)
        if upsert is not None:
            return upsert(key, ptr, size, self._config)
        self._raw.remove(key, True)
        return self._raw.put_from(key, ptr, size, self._config)

    def __getattr__(self, name):
        return getattr(self._raw, name)


def _import_error(e: ImportError) -> Eagle3Error:
    cause = e.__cause__ or e.__context__ or e
    return Eagle3Error(f"engine=remote needs Mooncake, which could not be imported ({cause}): pip install "
                       "mooncake-transfer-engine-non-cuda==0.3.13.post1 (CPU) or mooncake-transfer-engine (CUDA); a "
                       "missing libibverbs/libnl library needs its system package (libibverbs1, libnl-route-3-200), "
                       "or scripts/install-mooncake-cpu.sh unpacks them without root")


def open_store(master: str, local_hostname: str = "127.0.0.1", protocol: str = "tcp",
               segment_mb: int = 1024, buffer_mb: int = 512, device_name: str = "", knob: str = "engine.master",
               local_puts: bool = False):
    """A set-up ``hs_connectors.mooncake_store.MooncakeHiddenStatesStore``.

    Args:
        master: the Mooncake master's ``host:port`` (``mooncake_master --port 50051``).
        local_hostname: the address other hosts reach this process at.
        protocol: ``tcp``, or ``rdma`` (with ``device_name``, e.g. ``mlx5_0``).
        segment_mb: memory this process contributes to the store, MiB.
        buffer_mb: this process's local transfer buffer, MiB.
        knob: how the user sets ``master`` (``engine.master`` for the trainer, ``--master`` for
            the node), named in the errors.
        local_puts: a capture node's store: puts go to this process's segment and replace an
            object of the same name (:class:`LocalPuts`).

    Raises:
        Eagle3Error: hs-connectors or Mooncake is not installed (with the install line), no
            master answers at ``master`` (:func:`check_master`), or the store cannot be set up.
    """
    try:
        from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
    except ImportError as e:
        raise Eagle3Error(f"engine=remote needs hs-connectors ({e}): pip install --no-deps hs-connectors==0.9.0") from None
    if protocol not in ("tcp", "rdma"):
        raise Eagle3Error(f"the store protocol {protocol!r} is unknown; use tcp or rdma (with a device name)")
    check_master(master, knob)
    cfg = MooncakeStoreConfig(local_hostname=local_hostname, master_server_address=master, protocol=protocol,
                              global_segment_size=int(segment_mb) << 20, local_buffer_size=int(buffer_mb) << 20,
                              device_name=device_name)
    try:
        store = MooncakeHiddenStatesStore(cfg).setup()
    except ImportError as e:
        raise _import_error(e) from None
    except RuntimeError as e:
        raise Eagle3Error(f"the Mooncake store at master {master} could not be set up ({e}); check the master's log, "
                          f"and that this host's address {local_hostname!r} is one the other hosts reach") from None
    if local_puts:
        store._store = LocalPuts(store._store)
    return store


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
    ``store`` as one object under ``handle``; returns its manifest (:func:`manifest`).

    Raises:
        StoreError: the put failed (the master is unreachable, the store is full), with the
            meaning of Mooncake's status.
    """
    m = manifest(handle, cap)
    try:
        store.put_sample(m, {n: getattr(cap, n).contiguous() for n in NAMES})
    except RuntimeError as e:
        raise StoreError(f"the capture could not be put into the Mooncake store ({describe_status(e)})") from None
    return m


def check_manifest(m: Any) -> str:
    """The handle of ``m`` once it has the shape :func:`manifest` gives.

    Raises:
        Eagle3Error: ``m`` is not such a manifest (a node of another version, or not a node).
    """
    tensors = m.get("tensors") if isinstance(m, dict) else None
    handle = m.get("handle") if isinstance(m, dict) else None
    if not isinstance(handle, str) or not handle or not isinstance(tensors, dict) or set(tensors) != set(NAMES) \
            or not isinstance(m.get("metadata"), dict) or not all(isinstance(t, dict) for t in tensors.values()):
        raise Eagle3Error(f"the capture node answered a malformed transfer manifest ({str(m)[:200]}); run the same "
                          "eagle3 version on the node and the trainer")
    return handle


def discard(store, handle: str) -> None:
    """Remove ``handle`` (and its error marker) from ``store``; a failure is ignored (the store
    evicts what is left)."""
    try:
        store.delete_sample(handle)
    except (RuntimeError, AttributeError):
        pass


def fetch(store, m: dict[str, Any], timeout_s: float = 120.0) -> Capture:
    """Wait up to ``timeout_s`` for the object of manifest ``m``, read it into CPU tensors and
    remove it from the store.

    Raises:
        Eagle3Error: a malformed manifest (:func:`check_manifest`), the object did not appear in
            time, could not be read (the node holding it stopped, the master is unreachable), or
            failed the manifest's checks (size, bounds, dtype; hs-connectors' ``MooncakeIntegrityError``).
    """
    from hs_connectors.mooncake_store import MooncakeIntegrityError

    handle = check_manifest(m)
    try:
        got = store.get_sample(m, timeout=float(timeout_s))
    except TimeoutError:
        raise Eagle3Error(f"capture {handle} did not appear in the Mooncake store within engine.fetch_timeout_s="
                          f"{float(timeout_s):g} s: the node that published it stopped, or the store it wrote to is not "
                          "the one of engine.master; check both use the same master, or raise "
                          "engine.fetch_timeout_s") from None
    except (MooncakeIntegrityError, RuntimeError, KeyError, TypeError, ValueError) as e:
        raise Eagle3Error(f"capture {handle} could not be read from the Mooncake store ({describe_status(e)})") from None
    finally:
        discard(store, handle)
    missing = [n for n in NAMES if n not in got]
    if missing:
        raise Eagle3Error(f"capture {handle} lacks {missing}")
    return Capture(*(got[n] for n in NAMES))
