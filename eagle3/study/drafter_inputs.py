"""A trained drafter, its target's embedding table and a features folder, loaded for the CPU
diagnostics in ``benchmarks/`` (``fp8_features.py``, ``agreement_by_confidence.py``) and checked
against each other before any work, so a mismatched set is an error and not a table of numbers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from eagle3.errors import Eagle3Error


def check_features_match(export_meta: dict, features_meta: dict, export_dir, features_dir) -> None:
    """Refuse features of another target or other aux layers than the drafter was trained on.

    Args:
        export_meta: the export's ``eagle3_meta.json`` (``target.content_hash``, ``aux_layer_ids``).
        features_meta: the features manifest's ``metadata`` (the same keys).

    Raises:
        Eagle3Error: naming the field and both values (a field either side lacks is not compared).
    """
    pairs = (("target content hash", (export_meta.get("target") or {}).get("content_hash"),
              (features_meta.get("target") or {}).get("content_hash")),
             ("aux layer ids", export_meta.get("aux_layer_ids"), features_meta.get("aux_layer_ids")))
    for what, a, b in pairs:
        if a is not None and b is not None and a != b:
            raise Eagle3Error(f"the drafter in {export_dir} was trained with {what} {a}, the features in {features_dir} "
                              f"have {b}; pass features extracted from the drafter's own target and aux layers")


def trained_on(export_meta: dict, manifest_sha256: str) -> bool:
    """Whether the drafter was trained on the features whose ``manifest.json`` has this sha256
    (``features_manifest_sha256`` of ``eagle3_meta.json``: one hash, or one per folder)."""
    recorded = export_meta.get("features_manifest_sha256")
    recorded = recorded if isinstance(recorded, list) else [recorded]
    return manifest_sha256 in recorded


def load_drafter(export_dir, target, dtype: torch.dtype = torch.float32):
    """The SGLang-format export in ``export_dir`` with its embedding table read from ``target``
    (a model folder, or a ``.safetensors`` file in one), as
    :func:`eagle3.export.sglang.load_sglang_export` returns it: ``(drafter, meta)``.

    Raises:
        Eagle3Error: as :func:`eagle3.target.load.embeddings_in_folder` and
            ``load_sglang_export``; an embedding table whose shape is not the drafter's
            ``[vocab_size, target_hidden_size]``.
    """
    from eagle3.export.sglang import load_sglang_export
    from eagle3.export.validate import read_sglang_export
    from eagle3.target.load import embeddings_in_folder

    target = Path(target)
    folder = target.parent if target.suffix == ".safetensors" else target
    files = read_sglang_export(export_dir)
    embed, _ = embeddings_in_folder(folder)
    arch = files.arch
    want = (arch.vocab_size, arch.target_hidden_size)
    if tuple(embed.shape) != want:
        raise Eagle3Error(f"{folder} has a {list(embed.shape)} embedding table; the drafter in {export_dir} expects "
                          f"{list(want)}: pass the target the drafter was trained for")
    return load_sglang_export(export_dir, embed_tokens=embed.float(), dtype=dtype)


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    import argparse

    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return v


def writable_json(path) -> Path | None:
    """Check before any work that ``path`` (``--json``) can be written: its folder is created and
    must be writable, and the path must not be a folder. None stays None.

    Raises:
        Eagle3Error: naming the path and what to pass instead.
    """
    if path is None:
        return None
    path = Path(path)
    try:
        if path.is_dir():
            raise OSError("it is a folder")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as e:
        raise Eagle3Error(f"cannot write {path} ({e}); pass --json a writable file path") from e
    return path


def open_features(features_dir, export_dir, max_tokens: int):
    """The features in ``features_dir`` (every split), checked against the export's
    ``eagle3_meta.json`` (:func:`check_features_match`) and against ``max_tokens``.

    Raises:
        Eagle3Error: as :class:`eagle3.features.FeatureDataset`; no samples; features of
            another target, other aux layers or another width than the drafter's; a sample
            longer than ``max_tokens`` (it would be cut).
    """
    from eagle3.export.validate import read_sglang_export
    from eagle3.features import FeatureDataset

    ds = FeatureDataset([features_dir], splits=("train", "validation", "test"))
    if len(ds) == 0:
        raise Eagle3Error(f"{features_dir} holds no samples; pass --features a folder extract.py filled")
    if export_dir is not None:
        export = read_sglang_export(export_dir)
        check_features_match(export.meta, ds.metadata, export_dir, features_dir)
        from eagle3.io import sha256_file

        if trained_on(export.meta, sha256_file(Path(features_dir) / "manifest.json")):
            print(f"note: the drafter in {export_dir} was trained on {features_dir} (its training split inflates "
                  "these figures); held-out features measure what serving will see", file=sys.stderr)
        hidden = (ds.metadata.get("target") or {}).get("hidden_size")
        if hidden is not None and int(hidden) != export.arch.target_hidden_size:
            raise Eagle3Error(f"the features in {features_dir} hold aux states of width {hidden}, the drafter in "
                              f"{export_dir} reads {export.arch.target_hidden_size}; pass features of its own target")
    if max(ds.lengths) > max_tokens:
        raise Eagle3Error(f"the longest sample in {features_dir} has {max(ds.lengths)} tokens, more than "
                          f"--max-tokens {max_tokens} (it would be cut); pass --max-tokens {max(ds.lengths)} or more")
    return ds
