"""Mooncake's non-CUDA build on a machine without RDMA libraries: the packages that
``scripts/install-mooncake-cpu.sh`` unpacked under ``.mooncake-libs/root`` (libibverbs, libnl),
preloaded into this process or put on a child process's ``LD_LIBRARY_PATH``."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIB_ROOT = ROOT / ".mooncake-libs" / "root"
PRELOAD = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")  # in dependency order


def lib_dirs() -> list[str]:
    """The folders under ``.mooncake-libs/root`` holding the unpacked libraries ([] if none)."""
    return sorted({str(p.parent) for name in PRELOAD for p in LIB_ROOT.rglob(name)}) if LIB_ROOT.is_dir() else []


def import_mooncake() -> None:
    """Import ``mooncake.store``, preloading the unpacked libraries when the system has none.

    Raises:
        ImportError: Mooncake is not installed, or its libraries are missing and not unpacked.
    """
    try:
        import mooncake.store  # noqa: F401
        return
    except ImportError:
        dirs = lib_dirs()
        if not dirs:
            raise
    for name in PRELOAD:
        path = next((Path(d) / name for d in dirs if (Path(d) / name).exists()), None)
        if path is not None:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    import mooncake.store  # noqa: F401,F811


def child_env() -> dict:
    """This process's environment for a child that imports Mooncake (the repository on
    ``PYTHONPATH``, the unpacked libraries on ``LD_LIBRARY_PATH``, one OpenMP thread)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    dirs = lib_dirs()
    if dirs:
        env["LD_LIBRARY_PATH"] = ":".join(dirs + [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    return env


def wait_for_port(port: int, proc=None, timeout_s: float = 30.0, host: str = "127.0.0.1") -> None:
    """Return once ``host:port`` accepts a TCP connection (a Mooncake master that is up).

    Raises:
        RuntimeError: ``proc`` (a ``Popen``) ended first, or ``timeout_s`` passed.
    """
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the process for port {port} ended with {proc.returncode}")
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {host}:{port} after {timeout_s:.0f} s")


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_master(log=None):
    """A Mooncake master on free ports of 127.0.0.1 (its RPC port and its metrics port: the
    default metrics port, 9003, is taken by any other master on the machine).

    Returns:
        ``(Popen, "127.0.0.1:PORT")`` once the RPC port accepts connections.
    """
    import subprocess

    import mooncake

    port = free_port()
    binary = Path(mooncake.__file__).parent / "mooncake_master"
    out = open(log, "w") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen([str(binary), f"--port={port}", f"--metrics_port={free_port()}"], env=child_env(),
                            stdout=out, stderr=subprocess.STDOUT)
    wait_for_port(port, proc)
    return proc, f"127.0.0.1:{port}"
