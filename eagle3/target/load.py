"""Load the served target in-process: its tokenizer, the model, its embedding and head matrices.

Everything here reads the local folder that :func:`eagle3.target.resolve.resolve_target`
resolves (built on first use); nothing contacts the hub.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from eagle3.errors import Eagle3Error
from eagle3.target.resolve import TargetInfo, resolve_target
from eagle3.target.source import _torch_dtype


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
    info = resolve_target(model_cfg, cache_dir)
    if info.path is None:
        raise Eagle3Error(
            f"target '{model_cfg.name}' has no local weights to read embeddings from; "
            "set model.source to a local HF folder"
        )
    embed, head = embeddings_in_folder(info.path)
    if dtype is not None:
        embed, head = embed.to(dtype), head.to(dtype)
    return embed, head


def embeddings_in_folder(folder) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embed [V, H], lm_head [V, H])`` read from every ``*.safetensors`` of a local HF
    folder (``lm_head`` is ``embed`` when tied), on CPU in the stored dtype.

    Raises:
        Eagle3Error: not a folder, no safetensors in it, an unreadable file, or no
            ``embed_tokens.weight`` (not a causal LM folder).
    """
    from safetensors import safe_open

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        raise Eagle3Error(f"{folder} is not a model folder with *.safetensors files; pass the target's folder")
    found: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    if key.endswith("embed_tokens.weight") and "embed" not in found:
                        found["embed"] = fh.get_tensor(key)
                    elif key.endswith("lm_head.weight") and "lm_head" not in found:
                        found["lm_head"] = fh.get_tensor(key)
        except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
            raise Eagle3Error(f"cannot read {f}: {e}") from e
    if "embed" not in found:
        raise Eagle3Error(f"no embed_tokens.weight in {folder}; is this a causal LM folder?")
    return found["embed"], found.get("lm_head", found["embed"])  # tied embeddings: the same tensor
