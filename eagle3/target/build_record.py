"""Where a built target folder was built: the machine record that travels with its content hash.

Every folder the project builds (the dense folder from a GGUF, the W4A16 build, its
dequantised copy: :func:`eagle3.target.source._atomic_build`) gets ``eagle3_build.json``:
what was built, when, on which CPU (its model name and the instruction set PyTorch's kernels
dispatch to, ``torch.backends.cpu.get_cpu_capability()``: ``AVX2``, ``AVX512``, ...), on
which GPU if one was visible, and the library versions. It is not a weight file, so it does
not enter the content hash (:func:`eagle3.target.resolve.content_hash`).

Why: the GPTQ build is not reproducible across machines. The same command gave one content
hash on an AVX2 CPU and on an H200, and another on an AVX-512 CPU, with 10.5% of the int4
weights one quantization step apart (GPTQ calibrates each layer on the outputs of the
layers already quantized, so float-rounding differences of the first layers compound;
docs/notebook/results.md). The round-to-nearest build and the dense folders hash the same
everywhere. So a content hash that differs is reported with both records and the fix:
copy the built folder from the machine the features were extracted on, do not rebuild it.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform
from pathlib import Path
from typing import Optional

BUILD_RECORD = "eagle3_build.json"
_VERSIONS = ("torch", "transformers", "compressed-tensors", "llmcompressor", "gguf")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_record(what: str) -> dict:
    """The record of a build of ``what`` made now, on this machine.

    Returns a JSON-able dict: ``what``, ``built_utc`` (ISO 8601), ``cpu`` (model name),
    ``cpu_capability`` (PyTorch's kernel dispatch level), ``gpu`` (the first CUDA device's
    name, or None), and ``versions`` of the libraries a build uses (installed ones only).
    """
    import torch

    versions = {}
    for name in _VERSIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "what": what,
        "built_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "versions": versions,
    }


def write_build_record(folder: Path, what: str) -> None:
    """Write :func:`machine_record` of ``what`` as ``folder/eagle3_build.json`` (the folder is
    a build's temporary folder, renamed into place whole, so the write needs no rename)."""
    (Path(folder) / BUILD_RECORD).write_text(json.dumps(machine_record(what), indent=1) + "\n")


def read_build_record(folder: Optional[str | Path]) -> Optional[dict]:
    """``folder/eagle3_build.json`` as a dict, or None (no folder, a folder not built here, or
    a record that does not parse: it is information, never a reason to stop)."""
    if folder is None:
        return None
    try:
        record = json.loads((Path(folder) / BUILD_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def describe(record: Optional[dict]) -> str:
    """One line for a build record: ``built <date> on an AVX512 CPU (model), GPU H200``.

    ``<date>`` is the first 10 characters of the record's ``built_utc`` (the UTC day).
    """
    if not record:
        return "built where no record was kept"
    gpu = f", GPU {record['gpu']}" if record.get("gpu") else ", no GPU"
    day = str(record.get("built_utc", "?"))[:10]
    return f"built {day} on an {record.get('cpu_capability', '?')} CPU ({record.get('cpu', '?')}){gpu}"


def hash_mismatch_advice(recorded: Optional[dict], here: Optional[dict], folder: Optional[str | Path],
                         subject: str = "the features' target") -> str:
    """What to say when the content hash recorded with features or a drafter differs from the
    target's: both builds described, and the fix.

    Args:
        recorded: the build record stored with the features or the export (``target.build``).
        here: the build record of the configured target's folder.
        folder: that folder (its name is what to copy).
        subject: what ``recorded`` describes, as the sentence's subject.
    """
    name = Path(folder).name if folder else "the target folder"
    same_machine = bool(recorded and here) and all(
        recorded.get(k) == here.get(k) for k in ("cpu", "cpu_capability", "gpu"))
    why = ("the same machine built different bytes: the source or the build settings changed"
           if same_machine else
           "a GPTQ build differs between machines (CPU instruction set, GPU; docs/notebook/results.md), so rebuilding "
           "elsewhere does not reproduce it")
    return (f"{subject} was {describe(recorded)}; this one was {describe(here)}: {why}. Copy the "
            f"folder {name} (and its eagle3_build.json) from the machine that extracted the features into this "
            "machine's cache_dir (data/models/), or extract again against this build")
