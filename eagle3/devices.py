"""Device selection, and compiling modules in place, shared by the stages."""

from __future__ import annotations

import torch

from eagle3.errors import Eagle3Error


def resolve_device(name: str, setting: str = "engine.device") -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``; other names as given.

    Args:
        name: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        setting: the config key the value came from, named in the error.

    Raises:
        Eagle3Error: an unknown device name, or a CUDA device asked for on a machine
            without one.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise Eagle3Error(f"{setting}={name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise Eagle3Error(f"{setting}={name} but no CUDA device is visible; use {setting}=cpu or {setting}=auto")
    return dev


def cpu_has_native_bf16() -> bool | None:
    """Whether this CPU multiplies bf16 natively (``avx512_bf16`` or ``amx_bf16`` in
    ``/proc/cpuinfo``); None where that cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return None
    return "avx512_bf16" in flags or "amx_bf16" in flags


def compile_in_place(modules) -> int:
    """``nn.Module.compile(dynamic=True)`` on each module not compiled yet; returns how many.

    ``Module.compile`` wraps the module's call (inductor, one graph for all shapes), so
    parameter names and ``state_dict`` keys do not change. Idempotent.
    """
    n = 0
    for m in modules:
        if getattr(m, "_compiled_call_impl", None) is None:
            m.compile(dynamic=True)
            n += 1
    return n
