"""The doctor's provenance rows: were the drafter's training features made by the target
(content hash, quantization), chat template and compute dtype that are being served?

The comparisons are the evaluate stage's (:func:`eagle3.export.provenance.check_export`,
:func:`eagle3.export.provenance.feature_dtype_warning`); where evaluation only warns
(a different target build or quantization), the doctor fails the row, since a drafter
trained on BF16 features meeting an INT4 deployment is a classic cause of an acceptance
length near 1.
"""

from __future__ import annotations

from typing import Optional

from eagle3.doctor.checks import failed, row
from eagle3.errors import Eagle3Error

TEMPLATE, TARGET, DTYPE = "chat template", "target and quantization", "compute dtype"
NO_META = "the export has no eagle3_meta.json, so this cannot be checked"
_DIFFERENT_TARGET = "drafter trained on features of a different target"  # check_export's warning


def _quant_text(q) -> str:
    """A quantization dict in a few words (``none``, ``w4a16 4-bit g32``)."""
    if not isinstance(q, dict) or q.get("method") in (None, "none"):
        return "none (dense)" if isinstance(q, dict) else "unknown"
    algo = q.get("algorithm") or "rtn"
    return f"{q.get('method')} {q.get('bits')}-bit g{q.get('group_size')}" + (f" {algo}" if algo != "rtn" else "")


def template_row(meta: dict, template_hash: Optional[str]) -> dict:
    """The ``chat template`` row: the template hash of the training prompts against the
    served tokenizer's (:func:`eagle3.target.chat_template_hash`)."""
    from eagle3.export.provenance import check_export

    if not meta:
        return row(TEMPLATE, "warn", NO_META, "re-export the drafter from its training run")
    if template_hash is None:
        return row(TEMPLATE, "skip", "the served tokenizer could not be loaded (see target)")
    try:
        warnings = check_export({**meta, "target": {}}, None, template_hash)
    except Eagle3Error as e:
        return failed(TEMPLATE, e)
    if warnings:
        return row(TEMPLATE, "warn", warnings[0], "re-export the drafter from its training run (it records the hash)")
    return row(TEMPLATE, "pass", f"the served tokenizer renders with the training template {template_hash[:23]}…")


def target_row(meta: dict, info, model_name: str) -> dict:
    """The ``target and quantization`` row: the content hash and quantization recorded for the
    training features against the served target (``model=``)."""
    from eagle3.export.provenance import check_export

    if not meta:
        return row(TARGET, "warn", NO_META, "re-export the drafter from its training run")
    if info is None:
        return row(TARGET, "skip", "the served target could not be resolved (see target)")
    t = meta.get("target") or {}
    recorded = (f"{t.get('name')} (content hash {str(t.get('content_hash'))[:16]}, quantization "
                f"{_quant_text(t.get('quantization'))})")
    served = f"{info.name} (content hash {str(info.content_hash)[:16]}, quantization {_quant_text(info.quantization)})"
    warnings = [w for w in check_export({**meta, "chat_template_hash": "-"}, info, None) if w.startswith(_DIFFERENT_TARGET)]
    if warnings:
        fix = (f"serve the target the features came from (model={t.get('name')}), or extract features from "
               f"model={model_name} and retrain")
        if _quant_text(t.get("quantization")) == _quant_text(info.quantization):  # same recipe, other bytes
            from eagle3.target.build_record import hash_mismatch_advice

            fix += "; " + hash_mismatch_advice(t.get("build"), getattr(info, "build", None),
                                               getattr(info, "path", None), subject="the drafter's training target")
        return row(TARGET, "fail", f"the features were extracted from {recorded} but model={model_name} serves "
                   f"{served}", fix)
    if not t.get("content_hash"):
        return row(TARGET, "warn", f"the export records no content hash for its target {recorded}; served: {served}",
                   "re-export the drafter from its training run (it records the target's content hash)")
    return row(TARGET, "pass", f"features from {served}, the target being served")


def dtype_row(manifest: Optional[dict], dtype: str) -> dict:
    """The ``compute dtype`` row: the target's compute dtype at extraction against ``model.dtype``."""
    from eagle3.export.provenance import feature_dtype_warning

    feat = (((manifest or {}).get("metadata") or {}).get("target") or {}).get("dtype")
    if feat is None:
        return row(DTYPE, "skip", "the training manifest does not say (or could not be read)")
    w = feature_dtype_warning(manifest, dtype)
    if w:
        what, fix = w.rsplit("; ", 1)
        return row(DTYPE, "warn", what, fix)
    return row(DTYPE, "pass", f"{dtype}, as at extraction")


def provenance_rows(meta: dict, info, template_hash: Optional[str], manifest: Optional[dict],
                    model_name: str, dtype: str) -> list[dict]:
    """The three provenance rows (:func:`template_row`, :func:`target_row`, :func:`dtype_row`)."""
    return [template_row(meta, template_hash), target_row(meta, info, model_name), dtype_row(manifest, dtype)]
