"""The hybrid cache of online training (``features.cache_gb``): captured features kept on disk, read back.

Online training (:mod:`eagle3.train.online`) captures a micro-batch's features while the
drafter trains. With a cache budget, the features of each captured sample are also written
here, micro-batch by micro-batch, until the budget is spent; a later epoch (or validation)
reads a cached sample back instead of capturing it again. This is speculators' hybrid mode
(the first epoch online, then cached) with a size limit, so a cache that cannot hold every
sample still saves what it holds.

Layout: ``part-NNNNNN.safetensors`` files (the samples' tensors concatenated along the token
axis with ``offsets [n+1]`` int64, as :mod:`eagle3.features.format`'s shards) and
``index.json`` (per file its sha256, bytes and sample ids), each written to a temporary
name and renamed, the index after its file. A file is checked against its sha256 before its
first read in a process; one that fails (or is missing) is dropped from the index and its
samples are captured again, never read. What is cached is exactly what was captured
(bf16 aux states, int32 ids, float32 log-probs), so a read gives the same tensors bit for
bit; and the cache fills in the run's own deterministic batch order, so a resumed run finds
the cache an uninterrupted run would have.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.io import read_json, sha256_file, write_json_atomic

log = logging.getLogger("eagle3")

INDEX = "index.json"
FEATURE_KEYS = ("aux_hidden_states", "topk_ids", "topk_logprobs")


class FeatureCache:
    """Captured features of samples, on disk up to ``budget_bytes``.

    Args:
        folder: the cache folder (created; ``*.tmp`` left by a killed run are removed).
        budget_bytes: the most bytes of cache files kept (decimal; the index is not counted).

    Attributes:
        bytes: bytes of the cache files listed in the index.
        full: a ``put`` was refused for the budget (nothing more is cached).
    """

    def __init__(self, folder: Path, budget_bytes: int):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob("*.tmp"):
            stale.unlink()
        self.budget = int(budget_bytes)
        index = read_json(self.folder / INDEX, {"files": {}})
        files = index.get("files", {}) if isinstance(index, dict) else {}
        self.files: dict[str, dict] = {f: e for f, e in sorted(files.items()) if (self.folder / f).is_file()}
        self.where: dict[str, tuple[str, int]] = {}
        for f, e in self.files.items():
            for row, sid in enumerate(e["ids"]):
                self.where[sid] = (f, row)
        self.bytes = sum(int(e["bytes"]) for e in self.files.values())
        self.full = False
        self._verified: set[str] = set()

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.where

    def get(self, sample_id: str) -> Optional[dict[str, torch.Tensor]]:
        """The cached ``{aux_hidden_states [T, 3, H] bf16, topk_ids [T, k] int32, topk_logprobs
        [T, k] float32}`` of ``sample_id``; None when it is not cached or its file fails its sha256
        (the file is then dropped, its samples captured again)."""
        hit = self.where.get(sample_id)
        if hit is None:
            return None
        f, row = hit
        path = self.folder / f
        if f not in self._verified:
            if not path.is_file() or sha256_file(path) != self.files[f]["sha256"]:
                log.warning("feature cache file %s is missing or fails its sha256 check; its %d samples are captured "
                            "again", path, len(self.files[f]["ids"]))
                self._drop(f)
                return None
            self._verified.add(f)
        with safe_open(str(path), framework="pt") as h:
            off = h.get_tensor("offsets")
            a, b = int(off[row]), int(off[row + 1])
            return {k: h.get_slice(k)[a:b] for k in FEATURE_KEYS}

    def put(self, sample_ids: list[str], feats: list[dict[str, torch.Tensor]]) -> bool:
        """Cache the features of ``sample_ids`` (one file) unless they would pass the budget.

        Returns:
            True when written; False when the budget is spent (``full`` is set).
        """
        if not sample_ids or self.full:
            return False
        nbytes = sum(t.numel() * t.element_size() for x in feats for t in (x[k] for k in FEATURE_KEYS))
        if self.bytes + nbytes > self.budget:
            self.full = True
            log.info("feature cache full at %.2f GB (features.cache_gb): later samples are captured every epoch",
                     self.bytes / 1e9)
            return False
        lengths = [int(x["aux_hidden_states"].shape[0]) for x in feats]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
        flat = {k: torch.cat([x[k].contiguous() for x in feats]) for k in FEATURE_KEYS}
        flat["offsets"] = offsets
        name = f"part-{len(self.files) and max(int(f[5:11]) for f in self.files) + 1:06d}.safetensors"
        tmp = self.folder / (name + ".tmp")
        save_file(flat, str(tmp))
        digest = sha256_file(tmp)
        os.replace(tmp, self.folder / name)
        size = (self.folder / name).stat().st_size
        self.files[name] = {"sha256": digest, "bytes": size, "ids": list(sample_ids)}
        for row, sid in enumerate(sample_ids):
            self.where[sid] = (name, row)
        self.bytes += size
        self._verified.add(name)
        write_json_atomic(self.folder / INDEX, {"files": self.files})
        return True

    def _drop(self, f: str) -> None:
        e = self.files.pop(f)
        for sid in e["ids"]:
            if self.where.get(sid, (None,))[0] == f:
                del self.where[sid]
        self.bytes -= int(e["bytes"])
        (self.folder / f).unlink(missing_ok=True)
        write_json_atomic(self.folder / INDEX, {"files": self.files})
