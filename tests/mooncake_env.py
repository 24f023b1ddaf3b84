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
