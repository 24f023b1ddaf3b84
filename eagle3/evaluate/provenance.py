"""Is this drafter for this target? The provenance checks of the evaluate stage.

An SGLang drafter export records in ``eagle3_meta.json`` the target whose features it
was trained on (name, content hash, quantization), the chat template hash of the
training prompts, its aux layer ids and the features folder(s). These functions read
that record and compare it with the configured target: a different content hash or
quantization gives a loud warning (a drafter trained on BF16 features meeting an INT4
deployment accepts little); a different chat template, or a drafter whose vocabulary,
hidden size or aux layers do not fit the target, is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from eagle3.errors import Eagle3Error

META_FILE = "eagle3_meta.json"


def read_export_meta(drafter_dir: Path) -> dict:
    """``eagle3_meta.json`` of an export (without loading weights).

    Raises:
        Eagle3Error: the folder is not an SGLang drafter export.
    """
    if not (drafter_dir / "config.json").is_file():
        raise Eagle3Error(
            f"no drafter export at {drafter_dir} (config.json missing); run train.py first or set "
            "drafter_dir=<train output_dir>/export/sglang"
        )
    p = drafter_dir / META_FILE
    if not p.is_file():
        return {}
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise Eagle3Error(f"{p} is not valid JSON ({e}); re-export the drafter") from None


def _norm_quant(q: Any) -> dict:
    """Quantization dicts compared on what changes numerics (method, bits, group, symmetry)."""
    if not isinstance(q, dict):
        return {}
    method = q.get("method", "none")
    if method in (None, "none"):
        return {"method": "none"}
    return {k: q.get(k) for k in ("method", "bits", "group_size", "symmetric")}


def check_export(meta: dict, target_info, template_hash: Optional[str]) -> list[str]:
    """Compare an export's provenance with the configured target; return warnings.

    Args:
        meta: the export's ``eagle3_meta.json``.
        target_info: :class:`eagle3.target.TargetInfo` of the configured target (or
            anything with ``name``, ``content_hash``, ``quantization``).
        template_hash: :func:`eagle3.target.chat.chat_template_hash` of the tokenizer that
            renders the benchmark prompts (None: not checked).

    Raises:
        Eagle3Error: the chat template differs from the one the drafter was trained on.
    """
    warnings = []
    if not meta:
        return ["the drafter export has no eagle3_meta.json: its target, quantization and chat template cannot be checked"]
    t = meta.get("target") or {}
    hash_differs = bool(t.get("content_hash")) and t.get("content_hash") != getattr(target_info, "content_hash", None)
    qa, qb = _norm_quant(t.get("quantization")), _norm_quant(getattr(target_info, "quantization", None))
    quant_differs = bool(qa) and qa != qb
    if hash_differs or quant_differs:
        warnings.append(
            "drafter trained on features of a different target/quantization: the export records "
            f"{t.get('name')} (content hash {str(t.get('content_hash'))[:16]}, quantization {qa or '?'}) but the "
            f"configured target is {getattr(target_info, 'name', '?')} (content hash "
            f"{str(getattr(target_info, 'content_hash', '?'))[:16]}, quantization {qb or '?'}); expect a low "
            "acceptance length: extract features from the served target and retrain"
        )
    want = meta.get("chat_template_hash")
    if want and template_hash and want != template_hash:
        raise Eagle3Error(
            f"the drafter was trained on prompts rendered with chat template {want[:23]}… but the configured "
            f"target's tokenizer renders with {template_hash[:23]}…; evaluate with the training template "
            "(set model.chat_template or model.tokenizer to what extraction used)"
        )
    if not want:
        warnings.append("the drafter export records no chat template hash; the prompt template is not checked")
    return warnings


def load_train_manifest(meta: dict) -> tuple[Optional[dict], list[str]]:
    """The training features manifest(s) named in the export meta, merged.

    Returns ``(manifest or None, warnings)``; the manifest carries ``plan`` and
    ``splits`` (sample ids), which :func:`eagle3.prompts.load_benchmark` uses to refuse
    held-out prompts that were trained on.
    """
    from eagle3.features import load_manifest

    dirs = meta.get("features_dir")
    if not dirs:
        return None, ["the export names no features folder: held-out ShareGPT prompts cannot be checked against training"]
    dirs = dirs if isinstance(dirs, list) else [dirs]
    merged: dict[str, Any] = {"plan": [], "splits": {}}
    for d in dirs:
        try:
            m = load_manifest(d, require_complete=False)
        except Eagle3Error as e:
            return None, [f"cannot read the training manifest ({e}); held-out ShareGPT prompts are not checked against training"]
        merged["plan"] += list(m.get("plan") or [])
        for k, ids in (m.get("splits") or {}).items():
            merged["splits"].setdefault(k, []).extend(ids)
        merged.setdefault("metadata", m.get("metadata"))
    return merged, []


def feature_dtype_warning(manifest: Optional[dict], dtype: str) -> Optional[str]:
    """A warning when the training features were extracted in another compute dtype.

    Args:
        manifest: from :func:`load_train_manifest` (its ``metadata.target.dtype``), or None.
        dtype: the dtype the target is evaluated in (``model.dtype``, e.g. ``bfloat16``).

    Returns:
        The warning, or None when the dtypes agree or the manifest does not say.
    """
    feat_dtype = (((manifest or {}).get("metadata") or {}).get("target") or {}).get("dtype")
    if feat_dtype and feat_dtype != dtype:
        return (
            f"the drafter's features were extracted with the target computing in {feat_dtype}, but it is evaluated "
            f"in {dtype}; set model.dtype={feat_dtype} to serve the numerics it was trained on"
        )
    return None


def check_drafter_fits(arch, export_meta: dict, info, drafter_dir: Path) -> list[int]:
    """Refuse a loaded drafter that cannot read this target; return its aux layer ids.

    Args:
        arch: the drafter's :class:`eagle3.train.drafter.DrafterArch` (``vocab_size``,
            ``target_hidden_size``).
        export_meta: the meta returned by :func:`eagle3.export.load_sglang_export`
            (``aux_layer_ids``: HF-convention layer ids the drafter reads).
        info: :class:`eagle3.target.TargetInfo` of the configured target.
        drafter_dir: the export folder, named in errors.

    Raises:
        Eagle3Error: a different vocabulary or hidden size, or no aux layer ids.
    """
    if arch.vocab_size != info.vocab_size or arch.target_hidden_size != info.hidden_size:
        raise Eagle3Error(
            f"the drafter at {drafter_dir} was built for a target with vocabulary {arch.vocab_size} and hidden size "
            f"{arch.target_hidden_size}, but {info.name} has {info.vocab_size} and {info.hidden_size}; "
            "evaluate it against the target it was trained for"
        )
    aux = export_meta.get("aux_layer_ids")
    if not aux:
        raise Eagle3Error(f"the export at {drafter_dir} does not say which aux layers it reads; re-export it")
    return aux
