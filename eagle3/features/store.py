"""The capture contract: per-sample records, sharded safetensors, manifest, resume.

A features folder holds ``manifest.json`` and ``shard-NNNNN.safetensors`` files.

Record (one sample; see docs/design.md):

============================  ===========  ==========================================
key                           shape        dtype
============================  ===========  ==========================================
``input_ids``                 ``[T]``      int32
``loss_mask``                 ``[T]``      uint8, 1 = assistant token (trainable label)
``aux_hidden_states``         ``[T, 3, H]`` bfloat16, HF ``output_hidden_states`` ids
``topk_ids``                  ``[T, k]``   int32, target's top-k next-token ids at t
``topk_logprobs``             ``[T, k]``   float32, their log-probs (full-vocab softmax)
============================  ===========  ==========================================

A shard concatenates its samples along the token axis and adds ``offsets [n+1]``
(int64): sample ``i`` is rows ``offsets[i]:offsets[i+1]``.

Resume: the sample order (the *plan*) is fixed when a folder is first opened and cut
into shards of ``samples_per_shard`` samples. Each shard is written under a temporary
name, checksummed and renamed, then the manifest is rewritten atomically. Running
again with the same settings skips shards whose sha256 matches and re-extracts any
that are missing or corrupt, so the result equals an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset

from eagle3.errors import Eagle3Error
from eagle3.io import sha256_file, write_json_atomic

log = logging.getLogger(__name__)

FORMAT = "eagle3-features"
VERSION = 1
MANIFEST = "manifest.json"
TENSOR_KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "topk_ids", "topk_logprobs")
DTYPES = {
    "input_ids": torch.int32,
    "loss_mask": torch.uint8,
    "aux_hidden_states": torch.bfloat16,
    "topk_ids": torch.int32,
    "topk_logprobs": torch.float32,
}
# Metadata keys that must agree between feature folders trained on together.
COMPATIBILITY_KEYS = (
    ("target", "content_hash"),
    ("target", "hidden_size"),
    ("target", "vocab_size"),
    ("target", "quantization"),
    ("aux_layer_ids",),
    ("chat_template_hash",),
    ("capture", "top_k"),
)


@dataclass
class Capture:
    """What an engine returns for one token sequence of length T.

    Attributes:
        aux_hidden_states: ``[T, 3, H]`` bfloat16, the residual stream entering the
            three aux layers (HF ``output_hidden_states`` ids) at every position.
        topk_ids: ``[T, k]`` int32, the target's top-k next-token ids at position t
            (the distribution of token t+1), most likely first.
        topk_logprobs: ``[T, k]`` float32, their log-probabilities under the full
            target vocabulary (log-softmax of the target's logits).
    """

    aux_hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor


@dataclass
class Record:
    """One captured sample: ids ``[T]`` int32, loss mask ``[T]`` uint8, and its capture."""

    sample_id: str
    split: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    capture: Capture

    def tensors(self) -> dict[str, torch.Tensor]:
        """The five stored tensors, cast to the stored dtypes and checked for shape.

        Raises:
            Eagle3Error: lengths disagree, or the aux states are not ``[T, 3, H]``.
        """
        out = {
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "aux_hidden_states": self.capture.aux_hidden_states,
            "topk_ids": self.capture.topk_ids,
            "topk_logprobs": self.capture.topk_logprobs,
        }
        out = {k: v.detach().to("cpu", DTYPES[k]).contiguous() for k, v in out.items()}
        T = out["input_ids"].shape[0]
        aux = out["aux_hidden_states"]
        if aux.dim() != 3 or aux.shape[:2] != (T, 3):
            raise Eagle3Error(
                f"sample {self.sample_id}: aux_hidden_states has shape {tuple(aux.shape)}, "
                f"expected [{T}, 3, H]; the engine must capture exactly three aux layers"
            )
        for k in ("loss_mask", "topk_ids", "topk_logprobs"):
            if out[k].shape[0] != T:
                raise Eagle3Error(
                    f"sample {self.sample_id}: {k} has {out[k].shape[0]} rows for {T} tokens"
                )
        return out


def bytes_per_token(hidden_size: int, top_k: int) -> int:
    """Stored bytes per token: aux ``3H`` bf16 + top-k ids and log-probs + id + mask."""
    return 3 * hidden_size * 2 + top_k * (4 + 4) + 4 + 1


def estimate_bytes(num_tokens: int, hidden_size: int, top_k: int) -> int:
    """Bytes a capture of ``num_tokens`` tokens will take on disk (within a few %)."""
    return int(num_tokens) * bytes_per_token(hidden_size, top_k)


def samples_per_shard(shard_size_mb: float, hidden_size: int, top_k: int, tokens_per_sample: float) -> int:
    """How many samples of ``tokens_per_sample`` tokens fill a shard of ``shard_size_mb`` MB."""
    per_sample = max(1.0, tokens_per_sample) * bytes_per_token(hidden_size, top_k)
    return max(1, int(shard_size_mb * 1e6 // per_sample))


def _normalise(obj: Any) -> Any:
    """JSON round trip, so tuples/lists and int/float keys compare like the stored manifest."""
    return json.loads(json.dumps(obj, sort_keys=True))


def _first_difference(a: Any, b: Any, prefix: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = _first_difference(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{prefix}{k}.")
            if d:
                return d
        return None
    if a != b:
        return f"{prefix.rstrip('.')} ({a!r} vs {b!r})"
    return None


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


class FeatureWriter:
    """Writes a features folder shard by shard; reopening the same folder resumes.

    Use :meth:`open`, loop over :meth:`pending`, call :meth:`write_shard` for each, then
    :meth:`finalize`.
    """

    def __init__(self, out_dir: Path, manifest: dict, manifest_name: str = MANIFEST):
        self.out_dir = out_dir
        self.manifest = manifest
        self.manifest_name = manifest_name

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(
        cls,
        out_dir: str | os.PathLike,
        metadata: dict,
        plan: Sequence[tuple[str, str]],
        samples_per_shard: int,
        splits: dict[str, list[str]] | None = None,
        part: tuple[int, int] | None = None,
    ) -> "FeatureWriter":
        """Create ``out_dir`` or resume the extraction already in it.

        Args:
            metadata: everything that must be equal for a resume to be valid (target,
                its content hash and quantization, aux layer ids, chat template hash,
                engine, sampling, capture settings, data, library versions).
            plan: ``(sample_id, split)`` in extraction order.
            samples_per_shard: shard size in samples (ignored when resuming: the stored
                value is kept so shards line up).
            splits: sample ids of every split (train/validation/test), recorded so later
                stages can keep evaluation prompts out of training.
            part: ``(worker, workers)`` for one worker of a data-parallel extraction:
                its shards are listed in ``manifest.part-W-of-N.json`` (never the shared
                ``manifest.json``, which :meth:`merge_parts` writes) and stale temporary
                files are left to the orchestrator.

        Raises:
            Eagle3Error: the folder holds an extraction with other settings or another
                plan (the message names the first difference).
        """
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if part is None:
            for stale in out_dir.glob("*.tmp"):
                stale.unlink()
        name = MANIFEST if part is None else part_manifest_name(*part)
        plan = [(str(i), str(s)) for i, s in plan]
        ids = [i for i, _ in plan]
        if len(set(ids)) != len(ids):
            raise Eagle3Error("the extraction plan lists a sample id twice; sample ids must be unique")
        metadata = _normalise(metadata)
        path = out_dir / name
        if path.exists():
            manifest = load_manifest(out_dir, require_complete=False, name=name)
            diff = _first_difference(manifest["metadata"], metadata)
            if diff:
                raise Eagle3Error(
                    f"{out_dir} already holds an extraction with other settings: {diff}; "
                    "pass a new output_dir=, or delete that folder to start over"
                )
            if [list(p) for p in manifest["plan"]] != [list(p) for p in plan]:
                raise Eagle3Error(
                    f"{out_dir} already holds an extraction of other prompts "
                    f"({len(manifest['plan'])} planned, {len(plan)} now; did data.limit change?); "
                    "pass a new output_dir=, or delete that folder to start over"
                )
            writer = cls(out_dir, manifest, name)
            writer._drop_bad_shards()
            return writer
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "complete": False,
            "metadata": metadata,
            "samples_per_shard": int(samples_per_shard),
            "plan": [list(p) for p in plan],
            "splits": {k: list(v) for k, v in (splits or {}).items()},
            "shards": [],
        }
        writer = cls(out_dir, manifest, name)
        writer._save()
        return writer

    @classmethod
    def merge_parts(cls, out_dir: str | os.PathLike, workers: int) -> "FeatureWriter":
        """Join the part manifests of a ``workers``-way extraction into ``manifest.json``.

        Every part must hold the same metadata, plan and shard size; every planned shard
        must be listed by exactly one part and pass its sha256 check. The returned
        writer lists all shards; call :meth:`finalize` on it.

        Raises:
            Eagle3Error: a part is missing or differs, a shard is listed twice or by no
                part, or a shard file is missing or corrupt (run the extraction again:
                the workers redo what is missing).
        """
        out_dir = Path(out_dir)
        parts = []
        for w in range(workers):
            name = part_manifest_name(w, workers)
            if not (out_dir / name).exists():
                raise Eagle3Error(f"{out_dir / name} is missing: worker {w} of {workers} never started; run again")
            parts.append(load_manifest(out_dir, require_complete=False, name=name))
        first = parts[0]
        for w, m in enumerate(parts[1:], 1):
            for key in ("metadata", "plan", "samples_per_shard", "splits"):
                if _normalise(m[key]) != _normalise(first[key]):
                    raise Eagle3Error(f"worker {w} of {workers} extracted with other {key} than worker 0; "
                                      "delete the folder and extract again")
        owner: dict[int, int] = {}
        shards = []
        for w, m in enumerate(parts):
            for sh in m["shards"]:
                if sh["index"] in owner:
                    raise Eagle3Error(f"shard {sh['index']} is listed by workers {owner[sh['index']]} and {w}")
                owner[sh["index"]] = w
                if sh["file"] is not None:
                    f = out_dir / sh["file"]
                    if not f.exists() or sha256_file(f) != sh["sha256"]:
                        raise Eagle3Error(f"shard {sh['file']} of worker {w} is missing or fails its sha256 check; "
                                          "run the extraction again to redo it")
                shards.append(sh)
        manifest = {k: v for k, v in first.items() if k not in ("shards", "complete", "counts", "summary")}
        manifest.update(complete=False, shards=sorted(shards, key=lambda s: s["index"]))
        writer = cls(out_dir, manifest)
        missing = [i for i, _ in writer.pending()]
        if missing:
            raise Eagle3Error(f"shards {missing[:8]} were extracted by no worker; run the extraction again")
        writer._save()
        return writer

    def _drop_bad_shards(self) -> None:
        kept = []
        for sh in self.manifest["shards"]:
            if sh["file"] is None:
                kept.append(sh)
                continue
            f = self.out_dir / sh["file"]
            if not f.exists():
                log.warning("shard %s is missing; it will be extracted again", sh["file"])
            elif sha256_file(f) != sh["sha256"]:
                log.warning("shard %s failed its sha256 check; it will be extracted again", sh["file"])
                f.unlink()
            else:
                kept.append(sh)
        if len(kept) != len(self.manifest["shards"]):
            self.manifest["shards"] = kept
            self.manifest["complete"] = False
            self._save()

    # ------------------------------------------------------------------ writing
    def _chunks(self) -> list[list[tuple[str, str]]]:
        plan = [tuple(p) for p in self.manifest["plan"]]
        n = self.manifest["samples_per_shard"]
        return [plan[i : i + n] for i in range(0, len(plan), n)]

    def pending(self) -> list[tuple[int, list[tuple[str, str]]]]:
        """Shards still to extract: ``(shard index, [(sample_id, split), ...])``."""
        done = {sh["index"] for sh in self.manifest["shards"]}
        return [(i, c) for i, c in enumerate(self._chunks()) if i not in done]

    def write_shard(self, index: int, records: list[Record], dropped: dict[str, str] | None = None) -> dict:
        """Store the records of shard ``index`` atomically and record it in the manifest.

        Args:
            records: the shard's samples in planned order (dropped ones omitted).
            dropped: ``sample_id -> reason`` for planned samples that were not captured.

        Returns:
            The shard's manifest entry.

        Raises:
            Eagle3Error: a record is not part of this shard's plan, or a planned sample
                is neither recorded nor dropped.
        """
        dropped = dict(dropped or {})
        chunk = self._chunks()[index]
        planned = [i for i, _ in chunk]
        got = [r.sample_id for r in records]
        expected = [i for i in planned if i not in dropped]
        if got != expected:
            raise Eagle3Error(
                f"shard {index}: records {got[:3]}... do not match the planned samples {expected[:3]}... "
                "(every planned sample must be recorded in order or listed as dropped)"
            )
        tensors_per = [r.tensors() for r in records]
        entry: dict[str, Any] = {
            "index": index,
            "file": None,
            "sha256": None,
            "bytes": 0,
            "tokens": 0,
            "masked_tokens": 0,
            "samples": [],
            "dropped": dropped,
        }
        if records:
            lengths = [t["input_ids"].shape[0] for t in tensors_per]
            offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
            offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
            flat = {k: torch.cat([t[k] for t in tensors_per]) for k in TENSOR_KEYS}
            flat["offsets"] = offsets
            name = shard_name(index)
            tmp = self.out_dir / (name + ".tmp")
            # one metadata key: safetensors writes a header map in arbitrary order, and shards must be
            # byte-identical between an interrupted and an uninterrupted run
            save_file(flat, str(tmp), metadata={"format": f"{FORMAT}/{VERSION}"})
            digest = sha256_file(tmp)
            os.replace(tmp, self.out_dir / name)
            entry.update(
                file=name,
                sha256=digest,
                bytes=(self.out_dir / name).stat().st_size,
                tokens=int(offsets[-1]),
                masked_tokens=int(flat["loss_mask"].sum()),
                samples=[
                    {"id": r.sample_id, "split": r.split, "length": n} for r, n in zip(records, lengths)
                ],
            )
        self.manifest["shards"] = sorted(
            [s for s in self.manifest["shards"] if s["index"] != index] + [entry], key=lambda s: s["index"]
        )
        self._save()
        return entry

    def finalize(self, summary: dict | None = None) -> dict:
        """Mark the extraction complete, add counts and ``summary``; returns the manifest.

        Raises:
            Eagle3Error: shards are still pending.
        """
        if self.pending():
            raise Eagle3Error(f"{len(self.pending())} shards are still pending; run extraction again to finish")
        shards = self.manifest["shards"]
        tokens = sum(s["tokens"] for s in shards)
        nbytes = sum(s["bytes"] for s in shards)
        self.manifest["counts"] = {
            "samples": sum(len(s["samples"]) for s in shards),
            "tokens": tokens,
            "masked_tokens": sum(s["masked_tokens"] for s in shards),
            "dropped": sum(len(s["dropped"]) for s in shards),
            "bytes": nbytes,
        }
        self.manifest["bytes_per_token"] = nbytes / tokens if tokens else 0.0
        self.manifest["summary"] = _normalise(summary or {})
        self.manifest["complete"] = True
        self._save()
        return self.manifest

    def _save(self) -> None:
        write_json_atomic(self.out_dir / self.manifest_name, self.manifest)


def part_manifest_name(worker: int, workers: int) -> str:
    """``manifest.part-W-of-N.json``: the shards extracted by one data-parallel worker."""
    return f"manifest.part-{worker}-of-{workers}.json"


# ---------------------------------------------------------------------- reading
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
        return [i for _, _, i, _ in self._index]

    @property
    def num_tokens(self) -> int:
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

