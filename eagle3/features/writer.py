"""Writing a features folder: shards stored atomically with their checksums, the manifest, resume.

Resume: the sample order (the *plan*) is fixed when a folder is first opened and cut
into shards of ``samples_per_shard`` samples. Each shard is written under a temporary
name, checksummed and renamed, then the manifest is rewritten atomically. Running
again with the same settings skips shards whose sha256 matches and re-extracts any
that are missing or corrupt, so the result equals an uninterrupted run. A
data-parallel extraction writes one part manifest per worker, joined by
:meth:`FeatureWriter.merge_parts`. The layout is :mod:`eagle3.features.format`'s.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import save_file

from eagle3.errors import Eagle3Error
from eagle3.features.format import (AUX_BF16, FEATURES_NONE, FORMAT, MANIFEST, VERSION, Record, part_manifest_name,
                                    sample_layout, shard_name, stored_features)
from eagle3.features.reader import load_manifest
from eagle3.io import remove_stale_temp_files, sha256_file, write_json_atomic

log = logging.getLogger(__name__)


def _normalise(obj: Any) -> Any:
    """JSON round trip, so tuples/lists and int/float keys compare like the stored manifest."""
    return json.loads(json.dumps(obj, sort_keys=True))


def _with_aux_dtype(metadata: dict) -> dict:
    """``metadata`` with ``capture.aux_dtype`` spelled out where it is absent (= bfloat16), so that
    a difference names both storages."""
    if not isinstance(metadata.get("capture"), dict) or "aux_dtype" in metadata["capture"]:
        return metadata
    return {**metadata, "capture": {**metadata["capture"], "aux_dtype": AUX_BF16}}


def _first_difference(a: Any, b: Any, prefix: str = "") -> str | None:
    """The first dotted key where ``a`` and ``b`` differ, with both values; None when equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = _first_difference(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{prefix}{k}.")
            if d:
                return d
        return None
    if a != b:
        return f"{prefix.rstrip('.')} ({a!r} vs {b!r})"
    return None


def _adopt_sample_layout(out_dir: Path, old: dict, new: dict) -> None:
    """Give a manifest written before ``metadata.sample_layout`` existed the layout it holds.

    A folder of kept (dataset) replies holds the layout of today (``template_text``) and
    resumes; one of regenerated replies holds the re-tokenized layout, which a resume
    would mix with the target's own ids, so it is refused.

    Raises:
        Eagle3Error: the old folder's layout is not the one this run writes.
    """
    if "sample_layout" in old or "sample_layout" not in new:
        return
    layout = sample_layout(old)
    if layout != new["sample_layout"]:
        raise Eagle3Error(
            f"{out_dir} holds features of an earlier eagle3 that stored the target's replies decoded and "
            f"tokenized again (sample layout {layout}), not the target's own ids ({new['sample_layout']}); "
            "pass a new output_dir=, or delete that folder to extract it again"
        )
    old["sample_layout"] = layout


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
        if part is None:  # a shard or manifest half-written by a killed run
            remove_stale_temp_files(out_dir)
        name = MANIFEST if part is None else part_manifest_name(*part)
        plan = [(str(i), str(s)) for i, s in plan]
        ids = [i for i, _ in plan]
        if len(set(ids)) != len(ids):
            raise Eagle3Error("the extraction plan lists a sample id twice; sample ids must be unique")
        metadata = _normalise(metadata)
        path = out_dir / name
        if path.exists():
            manifest = load_manifest(out_dir, require_complete=False, name=name)
            _adopt_sample_layout(out_dir, manifest["metadata"], metadata)
            diff = _first_difference(_with_aux_dtype(manifest["metadata"]), _with_aux_dtype(metadata))
            if diff:
                stored = (manifest["metadata"].get("capture") or {}).get("plan_order", "source")
                hint = (f"; that folder was planned in {stored} order: resume it with capture.plan_order={stored}"
                        if diff.startswith("capture.plan_order") else "")
                raise Eagle3Error(
                    f"{out_dir} already holds an extraction with other settings: {diff}{hint}; "
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
        replies_only = stored_features(self.manifest.get("metadata") or {}) == FEATURES_NONE
        if any((r.capture is None) != replies_only for r in records):
            raise Eagle3Error(f"shard {index}: this folder stores {'replies only' if replies_only else 'features'}, "
                              f"but a record {'holds' if replies_only else 'lacks'} a capture")
        aux_dtype = (self.manifest.get("metadata") or {}).get("capture", {}).get("aux_dtype", AUX_BF16)
        tensors_per = [r.tensors(aux_dtype) for r in records]
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
            flat = {k: torch.cat([t[k] for t in tensors_per]) for k in tensors_per[0]}
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
