"""Reading a features folder: the manifest, the compatibility of several folders, the samples.

:class:`FeatureDataset` serves the records of :mod:`eagle3.features.format` lazily from
the shards, checking each shard's sha256 against the manifest first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from eagle3.errors import Eagle3Error
from eagle3.features.format import COMPATIBILITY_KEYS, FORMAT, MANIFEST, TENSOR_KEYS, VERSION
from eagle3.io import sha256_file


def load_manifest(features_dir: str | os.PathLike, require_complete: bool = True, name: str = MANIFEST) -> dict:
    """Read and check ``<features_dir>/manifest.json`` (or the manifest file ``name``).

    Raises:
        Eagle3Error: the folder or manifest is missing, unreadable, of another format,
            or (with ``require_complete``) the extraction did not finish.
    """
    d = Path(features_dir)
    if not d.is_dir():
        raise Eagle3Error(f"features folder {d} does not exist; run extract.py first or pass features_dir=PATH")
    path = d / name
    if not path.exists():
        raise Eagle3Error(f"{d} has no {name}; it is not a features folder (run extract.py with output_dir={d})")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise Eagle3Error(f"{path} is not valid JSON ({e}); re-run extract.py into a new output_dir") from None
    if manifest.get("format") != FORMAT:
        raise Eagle3Error(f"{path} is not an eagle3 features manifest")
    if manifest.get("version") != VERSION:
        raise Eagle3Error(f"{path} has format version {manifest.get('version')}, this eagle3 reads {VERSION}")
    if require_complete and not manifest.get("complete"):
        raise Eagle3Error(
            f"the extraction in {d} did not finish; run the same extract.py command again to resume it"
        )
    return manifest


def check_compatible(manifests: Sequence[dict], names: Sequence[str] | None = None) -> None:
    """Refuse feature folders whose targets, aux layers or templates disagree.

    Raises:
        Eagle3Error: naming the first differing metadata key and the two values.
    """
    names = list(names or [f"#{i}" for i in range(len(manifests))])
    ref = manifests[0]["metadata"]
    for name, m in zip(names[1:], manifests[1:]):
        for path in COMPATIBILITY_KEYS:
            a, b = ref, m["metadata"]
            for k in path:
                a = a.get(k) if isinstance(a, dict) else None
                b = b.get(k) if isinstance(b, dict) else None
            if a != b:
                raise Eagle3Error(
                    f"features {names[0]} and {name} disagree on {'.'.join(path)} ({a!r} vs {b!r}); "
                    "train only on features extracted from the same target with the same settings"
                )


class FeatureDataset(Dataset):
    """Samples of one or more features folders, read lazily from their shards.

    ``ds[i]`` is a dict with the record tensors (see module docstring) plus
    ``sample_id`` (str) and ``split`` (str).

    Args:
        features_dirs: a folder or a list of folders (their manifests must agree).
        splits: which splits to serve (``train``, ``validation``).
        verify: check every shard's sha256 before use (a corrupt shard is an error,
            never read).

    Raises:
        Eagle3Error: missing/empty folder, unfinished extraction, incompatible
            manifests, a shard missing or failing its checksum.
    """

    def __init__(self, features_dirs: str | os.PathLike | Iterable, splits: Sequence[str] = ("train",), verify: bool = True):
        dirs = [Path(features_dirs)] if isinstance(features_dirs, (str, os.PathLike)) else [Path(d) for d in features_dirs]
        if not dirs:
            raise Eagle3Error("no features folder given; pass features_dir=PATH")
        self.manifests = [load_manifest(d) for d in dirs]
        check_compatible(self.manifests, [str(d) for d in dirs])
        self.manifest = self.manifests[0]
        self.metadata = self.manifest["metadata"]
        self.splits = tuple(splits)
        self._index: list[tuple[Path, int, str, str]] = []  # (shard path, row in shard, id, split)
        self.lengths: list[int] = []
        for d, m in zip(dirs, self.manifests):
            files = [s for s in m["shards"] if s["file"]]
            if not files:
                raise Eagle3Error(f"{d} holds no captured samples; re-run extract.py with more data")
            for sh in files:
                f = d / sh["file"]
                if not f.exists():
                    raise Eagle3Error(f"shard {f} is missing; re-run the same extract.py command to re-extract it")
                if verify and sha256_file(f) != sh["sha256"]:
                    raise Eagle3Error(
                        f"shard {f} fails its sha256 check (corrupt); re-run the same extract.py command "
                        "to re-extract it"
                    )
                for row, s in enumerate(sh["samples"]):
                    if s["split"] in self.splits:
                        self._index.append((f, row, s["id"], s["split"]))
                        self.lengths.append(int(s["length"]))
        self._handles: dict[Path, Any] = {}
        self._offsets: dict[Path, torch.Tensor] = {}

    @property
    def sample_ids(self) -> list[str]:
        """Sample ids served, in index order (``ds[i]`` is ``sample_ids[i]``)."""
        return [i for _, _, i, _ in self._index]

    @property
    def num_tokens(self) -> int:
        """Tokens over all served samples (the sum of ``lengths``)."""
        return sum(self.lengths)

    def __len__(self) -> int:
        return len(self._index)

    def _handle(self, f: Path):
        h = self._handles.get(f)
        if h is None:
            h = safe_open(str(f), framework="pt")
            self._handles[f] = h
            self._offsets[f] = h.get_tensor("offsets")
        return h

    def __getitem__(self, i: int) -> dict[str, Any]:
        f, row, sid, split = self._index[i]
        h = self._handle(f)
        off = self._offsets[f]
        a, b = int(off[row]), int(off[row + 1])
        out: dict[str, Any] = {k: h.get_slice(k)[a:b] for k in TENSOR_KEYS}
        out["sample_id"] = sid
        out["split"] = split
        return out

    def __getstate__(self):  # DataLoader workers reopen their own handles
        st = self.__dict__.copy()
        st["_handles"] = {}
        st["_offsets"] = {}
        return st

