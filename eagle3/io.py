"""Small file primitives every stage uses: atomic JSON, folder replacement, sha256, stale temporary files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    """Hex sha256 of a file, read in 16 MiB chunks.

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON (indent 1) to ``path`` through a temporary file, ``fsync`` and ``os.replace``:
    a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """``json.loads`` of a file, or ``default`` when it is missing or not valid JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished folder ``tmp`` to ``out``, replacing an older ``out``.

    The old folder is renamed to ``<out>.old`` before the swap and removed after it, so
    an interruption leaves either the old or the new folder complete.
    """
    old = out.with_name(out.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    if old.exists():
        shutil.rmtree(old)


def remove_stale_temp_files(folder: str | os.PathLike) -> list[Path]:
    """Remove the files an interrupted atomic write left in ``folder`` (not in its subfolders).

    Those are ``*.tmp`` (this package's temporary names) and ``.tmpXXXXXX`` (safetensors 0.8 writes
    a file through a temporary file of that name in the same folder and renames it when done, so a
    process killed in the middle of ``save_file`` leaves it behind, as large as the file it was
    writing). Call it only while no process writes into ``folder``.

    Returns:
        The removed files.
    """
    folder = Path(folder)
    stale = [p for p in (*folder.glob("*.tmp"), *folder.glob(".tmp??????")) if p.is_file()]
    for p in stale:
        p.unlink()
    return stale
