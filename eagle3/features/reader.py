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
from eagle3.features.format import (COMPATIBILITY_KEYS, FEATURES_NONE, FORMAT, MANIFEST, REPLY_KEYS, TENSOR_KEYS, VERSION,
                                    dequantize_aux, stored_features)
from eagle3.io import sha256_file


def _damaged(path: Path, what: str) -> Eagle3Error:
    """The one-sentence error for a damaged manifest ``path``: what is wrong and the two ways out."""
    return Eagle3Error(
        f"the features manifest {path} is damaged ({what}); re-run extract.py into a fresh output_dir, "
        f"or delete {path} to extract that folder again"
    )


# top-level keys every manifest holds (written by FeatureWriter.open) and their JSON types
_MANIFEST_KEYS = {"complete": bool, "metadata": dict, "samples_per_shard": int, "plan": list, "splits": dict, "shards": list}
# keys of every shard entry (FeatureWriter.write_shard)
_SHARD_KEYS = {"index": int, "file": (str, type(None)), "sha256": (str, type(None)), "bytes": int, "tokens": int,
               "masked_tokens": int, "samples": list, "dropped": dict}


def _check_manifest(path: Path, manifest: Any) -> None:
    """Refuse a manifest that lacks a key the writer, the reader or training use (Eagle3Error via :func:`_damaged`)."""
    for key, kind in _MANIFEST_KEYS.items():
        if key not in manifest:
            raise _damaged(path, f"it has no '{key}' entry")
        if not isinstance(manifest[key], kind) or (kind is int and isinstance(manifest[key], bool)):
            raise _damaged(path, f"its '{key}' entry is not a JSON {_json_type(kind)}")
    if manifest["samples_per_shard"] < 1:
        raise _damaged(path, f"its samples_per_shard is {manifest['samples_per_shard']}")
    for k, p in enumerate(manifest["plan"]):
        if not (isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)):
            raise _damaged(path, f"plan entry {k} is not a [sample_id, split] pair")
    for k, sh in enumerate(manifest["shards"]):
        if not isinstance(sh, dict):
            raise _damaged(path, f"shards entry {k} is not a JSON object")
        for key, kind in _SHARD_KEYS.items():
            if key not in sh:
                raise _damaged(path, f"shards entry {k} has no '{key}'")
            if not isinstance(sh[key], kind) or (kind is int and isinstance(sh[key], bool)):
                raise _damaged(path, f"the '{key}' of shards entry {k} is not a JSON {_json_type(kind)}")
        for s in sh["samples"]:
            if not (isinstance(s, dict) and isinstance(s.get("id"), str) and isinstance(s.get("split"), str)
                    and isinstance(s.get("length"), int)):
                raise _damaged(path, f"a sample of shards entry {k} lacks its id, split or length")
        if sh["file"] is not None and not sh["sha256"]:
            raise _damaged(path, f"shards entry {k} names {sh['file']} without its sha256")


def _json_type(kind: Any) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {bool: "boolean", dict: "object", int: "integer", list: "list", str: "string", type(None): "null"}
    return " or ".join(names[k] for k in kinds)


def load_manifest(features_dir: str | os.PathLike, require_complete: bool = True, name: str = MANIFEST) -> dict:
    """Read and check ``<features_dir>/manifest.json`` (or the manifest file ``name``).

    The manifest must hold every key the writer records (``format``, ``version``,
    ``complete``, ``metadata``, ``samples_per_shard``, ``plan``, ``splits``,
    ``shards`` with their entries' keys); a manifest that is not valid UTF-8 JSON or
    lacks one of them is reported as damaged.

    Raises:
        Eagle3Error: the folder or manifest is missing, unreadable, damaged (names the
            file, what is missing, and says to re-extract into a fresh ``output_dir`` or
            to delete the manifest), of another format, or (with ``require_complete``)
            the extraction did not finish.
    """
    d = Path(features_dir)
    if not d.is_dir():
        # neutral about the option: callers name it (train.py features_dir=, evaluate.py
        # train_features_dir=, the diagnostics' --features)
        raise Eagle3Error(f"features folder {d} does not exist; run extract.py first or name an existing one")
    path = d / name
    if not path.exists():
        raise Eagle3Error(f"{d} has no {name}; it is not a features folder (run extract.py with output_dir={d})")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise Eagle3Error(f"cannot read {path} ({e.strerror or e}); make it a readable file or delete it") from None
    except UnicodeDecodeError as e:
        raise _damaged(path, f"byte {e.start} is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise _damaged(path, f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(manifest, dict):
        raise _damaged(path, "it is not a JSON object")
    for key in ("format", "version"):
        if key not in manifest:
            raise _damaged(path, f"it has no '{key}' entry")
    if manifest["format"] != FORMAT:
        raise Eagle3Error(f"{path} is not an eagle3 features manifest (format {manifest['format']!r}); "
                          "point at a folder that extract.py wrote")
    if manifest["version"] != VERSION:
        raise Eagle3Error(f"{path} has format version {manifest['version']}, this eagle3 reads {VERSION}; "
                          "re-run extract.py into a fresh output_dir")
    _check_manifest(path, manifest)
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
        features: serve the captured features; ``False`` serves ``input_ids`` and
            ``loss_mask`` alone (the kept replies), from a features folder or a replies-only
            one (``extract.py features=none``), for online training (:mod:`eagle3.train.online`).

    Raises:
        Eagle3Error: missing/empty folder, unfinished extraction, incompatible
            manifests, a shard missing or failing its checksum, a replies-only folder
            asked for features.
    """

    def __init__(self, features_dirs: str | os.PathLike | Iterable, splits: Sequence[str] = ("train",), verify: bool = True,
                 features: bool = True):
        dirs = [Path(features_dirs)] if isinstance(features_dirs, (str, os.PathLike)) else [Path(d) for d in features_dirs]
        if not dirs:
            raise Eagle3Error("no features folder given; name one (train.py: features_dir=PATH)")
        self.manifests = [load_manifest(d) for d in dirs]
        if features:
            for d, m in zip(dirs, self.manifests):
                if stored_features(m["metadata"]) == FEATURES_NONE:
                    raise Eagle3Error(f"{d} holds the kept replies alone (extract.py features=none), no features; "
                                      "train on it with features=online, or extract it with features=offline")
        check_compatible(self.manifests, [str(d) for d in dirs])
        self.features = bool(features)
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
        self._fp8: dict[Path, bool] = {}

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

    def shard_rows(self, indices: Iterable[int]) -> dict[Path, set[int]]:
        """``{shard file: rows in it}`` of the dataset indices ``indices`` (``ds[i]`` is row
        ``r`` of shard ``f``), for readers that go shard by shard."""
        out: dict[Path, set[int]] = {}
        for i in indices:
            f, row, _, _ = self._index[i]
            out.setdefault(f, set()).add(row)
        return out

    def _handle(self, f: Path):
        h = self._handles.get(f)
        if h is None:
            h = safe_open(str(f), framework="pt")
            self._handles[f] = h
            self._offsets[f] = h.get_tensor("offsets")
            self._fp8[f] = "aux_scales" in h.keys()
            if not self.features:
                return h
            stored = h.get_slice("aux_hidden_states").get_dtype()
            if stored != ("F8_E4M3" if self._fp8[f] else "BF16"):
                raise Eagle3Error(f"the features shard {f} stores aux_hidden_states as {stored}"
                                  f"{' with' if self._fp8[f] else ' without'} aux_scales (eagle3.features.format wants "
                                  "BF16 alone or F8_E4M3 with scales); extract that folder again into a fresh output_dir")
        return h

    def __getitem__(self, i: int) -> dict[str, Any]:
        f, row, sid, split = self._index[i]
        h = self._handle(f)
        off = self._offsets[f]
        a, b = int(off[row]), int(off[row + 1])
        out: dict[str, Any] = {k: h.get_slice(k)[a:b] for k in (TENSOR_KEYS if self.features else REPLY_KEYS)}
        if self.features and self._fp8[f]:  # float8_e4m3fn aux states and their scales (eagle3.features.format)
            out["aux_hidden_states"] = dequantize_aux(out["aux_hidden_states"], h.get_slice("aux_scales")[a:b])
        out["sample_id"] = sid
        out["split"] = split
        return out

    def __getstate__(self):  # DataLoader workers reopen their own handles
        st = self.__dict__.copy()
        st["_handles"] = {}
        st["_offsets"] = {}
        st["_fp8"] = {}
        return st

