"""Describe the served target: its local folder (built on first use), sizes, aux layers, content hash.

:func:`target_folder` builds what the config asks for (the dense folder of
:mod:`eagle3.target.source`, or a ``builtin:`` test target of :mod:`eagle3.target.kimi_mini`,
then the W4A16 build of :mod:`eagle3.target.quantize`, then, for ``w4a16-dequant``, its dense
dequantisation);
:func:`resolve_target` reads the sizes from the folder's ``config.json`` (or the config
fields, for a hub-only target) into a :class:`TargetInfo`. The content hash (sha256
over the weight files) is cached in ``<folder>.content-hash.json`` next to the folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from eagle3.errors import Eagle3Error
from eagle3.target.build_record import read_build_record
from eagle3.target.kimi_mini import builtin_folder, is_builtin_source
from eagle3.target.layers import resolve_aux_layer_ids
from eagle3.target.quantize import _build_dequant, _build_w4a16
from eagle3.target.source import (
    _atomic_build,
    _dense_folder,
    _is_package_source,
    _torch_dtype,
    dense_folder_name,
    dequant_folder_name,
    quantized_folder_name,
)

QUANTIZATION_METHODS = ("none", "w4a16", "w4a16-dequant")
QUANTIZATION_ALGORITHMS = ("rtn", "gptq")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass
class TargetInfo:
    """What the rest of the pipeline needs to know about the served target.

    ``aux_layer_ids`` are HF ``output_hidden_states`` indices (see :mod:`eagle3.target.layers`),
    already validated against ``num_layers``. ``path`` is the local HF folder that the
    hf engine loads (``None`` for a hub-only target served remotely). ``content_hash``
    is ``sha256:<hex>`` over the weight files of ``path``, or ``hub:<id>@<revision>``
    for a hub-only target. ``quantization`` is the model config's quantization block
    as a dict. ``dtype`` is the activation/compute dtype name (``bfloat16``).
    """

    name: str
    source: str
    path: Optional[str]
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layer_ids: list[int]
    content_hash: str
    quantization: dict
    dtype: str
    rms_norm_eps: Optional[float] = None
    rope_theta: Optional[float] = None
    max_position_embeddings: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    intermediate_size: Optional[int] = None
    build: Optional[dict] = None  # the folder's eagle3_build.json (eagle3.target.build_record), None if not built here

    def to_dict(self) -> dict:
        """The fields as a JSON-able dict (``dataclasses.asdict``)."""
        return dataclasses.asdict(self)


def _quant_dict(model_cfg) -> dict:
    q = model_cfg.quantization
    if dataclasses.is_dataclass(q):
        return dataclasses.asdict(q)
    return dict(q)


# ------------------------------------------------------------------- content hash
def _weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def content_hash(folder: Path, cache_dir: Optional[Path] = None) -> str:
    """``sha256:<hex>`` over the weight files of ``folder`` (names and bytes, sorted).

    The result is cached in ``<cache_dir or folder.parent>/<folder name>.content-hash.json``
    keyed by the files' sizes and mtimes, so it is recomputed only when they change.
    """
    files = _weight_files(folder)
    if not files:
        raise Eagle3Error(f"{folder} has no weight files (*.safetensors / *.bin); fix model.source")
    stamp = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}
    cache_root = Path(cache_dir) if cache_dir is not None else folder.parent
    cache_file = cache_root / f"{folder.name}.content-hash.json"
    try:
        cached = json.loads(cache_file.read_text())
        if cached.get("folder") == str(folder.resolve()) and cached.get("files") == stamp:
            return cached["content_hash"]
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    digest = f"sha256:{h.hexdigest()}"
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(cache_file.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"folder": str(folder.resolve()), "files": stamp, "content_hash": digest}))
        os.replace(tmp, cache_file)
    except OSError:
        pass  # the hash is still correct, only not cached
    return digest


# ----------------------------------------------------------------------- resolve
def target_folder(model_cfg, cache_dir) -> Optional[Path]:
    """The local HF folder that serves the target (building it on first use), or None.

    ``None`` means a hub-only target (served by a remote engine such as SGLang).
    ``w4a16`` builds the W4A16 folder from the dense one (unless ``prequantized``);
    ``w4a16-dequant`` builds that same W4A16 folder (or takes the prequantized source)
    and then its dense dequantisation ``<w4a16 folder>-dequant-<dtype>`` next to it.

    Raises:
        Eagle3Error: an unknown method, ``bits`` other than 4, or a source that is no
            W4A16 checkpoint where one is needed.
    """
    cache_dir = Path(cache_dir)
    q = _quant_dict(model_cfg)
    if q["method"] not in QUANTIZATION_METHODS:
        raise Eagle3Error(
            f"model.quantization.method '{q['method']}' is unknown; use one of {', '.join(QUANTIZATION_METHODS)}"
        )
    q.setdefault("algorithm", "rtn")
    if q["algorithm"] not in QUANTIZATION_ALGORITHMS:
        raise Eagle3Error(f"model.quantization.algorithm '{q['algorithm']}' is unknown; "
                          f"use one of {', '.join(QUANTIZATION_ALGORITHMS)}")
    built = _built_package_target(model_cfg, q, cache_dir)
    if built is not None:
        return built
    if is_builtin_source(model_cfg.source):  # a test target built here (eagle3.target.kimi_mini)
        dense = builtin_folder(model_cfg, cache_dir)
    else:
        dense = _dense_folder(model_cfg, cache_dir)
    if dense is None or q["method"] == "none" or (q["prequantized"] and q["method"] == "w4a16"):
        return dense
    if q["bits"] != 4:
        raise Eagle3Error(f"model.quantization.method={q['method']} needs quantization.bits=4")
    dtype = _torch_dtype(model_cfg.dtype)
    packed = dense
    if not q["prequantized"]:
        what = f"W4A16 build ({q['algorithm']}) of {dense.name}"
        packed = _atomic_build(cache_dir / quantized_folder_name(dense.name, q),
                               lambda tmp: _build_w4a16(dense, q, dtype, tmp), what)
    if q["method"] == "w4a16":
        return packed
    target = cache_dir / dequant_folder_name(packed.name, model_cfg.dtype)
    return _atomic_build(target, lambda tmp: _build_dequant(packed, dtype, tmp), f"dequantised build of {packed.name}")


def _built_package_target(model_cfg, q: dict, cache_dir: Path) -> Optional[Path]:
    """The finished build of a package-GGUF target already in ``cache_dir``, or None.

    Builds are renamed into place only when complete (:func:`_atomic_build`), so an
    existing folder is whole; taking it by name lets a machine that received the built
    folder (but not the package that ships the GGUF) serve the same bytes.
    """
    if not _is_package_source(model_cfg.source):
        return None
    name = dense_folder_name(model_cfg)
    if q["method"] in ("w4a16", "w4a16-dequant") and not q["prequantized"]:
        name = quantized_folder_name(name, q)
        if q["method"] == "w4a16-dequant":
            name = dequant_folder_name(name, model_cfg.dtype)
    folder = cache_dir / name
    return folder if (folder / "config.json").is_file() else None


def _check_field(model_cfg, name: str, actual: Optional[int]) -> int:
    want = getattr(model_cfg, name)
    if want is not None and actual is not None and int(want) != int(actual):
        raise Eagle3Error(
            f"model.{name}={want} but the target's config says {actual}; remove model.{name} or fix it"
        )
    value = actual if actual is not None else want
    if value is None:
        raise Eagle3Error(f"model.{name} is needed for the remote target '{model_cfg.name}'; set model.{name}=...")
    return int(value)


def resolve_target(model_cfg, cache_dir) -> TargetInfo:
    """Describe the served target, building its local folder on first use.

    For a local target the sizes are read from its ``config.json`` (and checked
    against any set in ``model_cfg``); for a hub-only target they come from
    ``model_cfg`` alone (``num_layers``, ``hidden_size``, ``vocab_size`` required).
    Aux layer ids are validated against the layer count.

    Raises:
        Eagle3Error: missing package/folder, sizes that disagree, bad aux layer ids.
    """
    folder = target_folder(model_cfg, cache_dir)
    q = _quant_dict(model_cfg)
    extra: dict[str, Any] = {}
    if folder is None:
        num_layers = _check_field(model_cfg, "num_layers", None)
        hidden = _check_field(model_cfg, "hidden_size", None)
        vocab = _check_field(model_cfg, "vocab_size", None)
        chash = f"hub:{model_cfg.source}@{model_cfg.revision or 'main'}"
    else:
        cfg = json.loads((folder / "config.json").read_text())
        cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
        num_layers = _check_field(model_cfg, "num_layers", cfg.get("num_hidden_layers"))
        hidden = _check_field(model_cfg, "hidden_size", cfg.get("hidden_size"))
        vocab = _check_field(model_cfg, "vocab_size", cfg.get("vocab_size"))
        chash = content_hash(folder, Path(cache_dir))
        rope = cfg.get("rope_parameters") or {}
        heads = cfg.get("num_attention_heads")
        extra = dict(
            rms_norm_eps=cfg.get("rms_norm_eps"),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta")),
            max_position_embeddings=cfg.get("max_position_embeddings"),
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or (hidden // heads if heads else None),
            intermediate_size=cfg.get("intermediate_size"),
            build=read_build_record(folder),
        )
    aux = resolve_aux_layer_ids(
        list(model_cfg.aux_layer_ids) if model_cfg.aux_layer_ids is not None else None, num_layers
    )
    return TargetInfo(
        name=model_cfg.name,
        source=model_cfg.source,
        path=str(folder) if folder is not None else None,
        architecture=model_cfg.architecture,
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        aux_layer_ids=aux,
        content_hash=chash,
        quantization=q,
        dtype=model_cfg.dtype,
        **extra,
    )
