"""Is this drafter for this target? The provenance checks of the evaluate stage.

An SGLang drafter export records in ``eagle3_meta.json`` the target whose features it
was trained on (name, content hash, quantization), the chat template hash of the
training prompts, its aux layer ids and the features folder(s). These functions read
that record and compare it with the configured target: a different content hash or
quantization gives a loud warning (a drafter trained on BF16 features meeting an INT4
deployment accepts little); a different chat template, or a drafter whose vocabulary,
hidden size or aux layers do not fit the target, is refused. Before that the export's
files are checked (:func:`read_export`), and its aux layer ids are compared across
``config.json`` (SGLang's convention), ``eagle3_meta.json`` (HF's) and the manifest of
the features it was trained on (:func:`check_aux_ids`): a server must capture the
layers the features had.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from eagle3.errors import Eagle3Error
from eagle3.target import engine_captured_ids, to_engine_ids

META_FILE = "eagle3_meta.json"


def read_export(drafter_dir: Path):
    """Open and check an SGLang drafter export without loading its weights.

    Returns:
        :class:`eagle3.export.SGLangExport` (``config``, ``meta`` = ``eagle3_meta.json``
        or {} when absent, ``arch``, ``d2t [Vd]`` int64, ``t2d [V]`` bool).

    Raises:
        Eagle3Error: the folder is not an SGLang drafter export, or one of its files is
            damaged (:func:`eagle3.export.read_sglang_export`: JSON, sizes, tensor
            shapes, a readable safetensors file, ``d2t`` offsets).
    """
    from eagle3.export import read_sglang_export

    if not (Path(drafter_dir) / "config.json").is_file():
        raise Eagle3Error(
            f"no drafter export at {drafter_dir} (config.json missing); run train.py first or set "
            "drafter_dir=<train output_dir>/export/sglang"
        )
    return read_sglang_export(drafter_dir)


def read_export_meta(drafter_dir: Path) -> dict:
    """``eagle3_meta.json`` of an export ({} when absent), after :func:`read_export` checked its files.

    Raises:
        Eagle3Error: as :func:`read_export`.
    """
    return read_export(drafter_dir).meta


def _norm_quant(q: Any) -> dict:
    """Quantization dicts compared on what changes numerics (method, bits, group, symmetry,
    algorithm: a dict without ``algorithm`` was written before GPTQ builds existed and is ``rtn``)."""
    if not isinstance(q, dict):
        return {}
    method = q.get("method", "none")
    if method in (None, "none"):
        return {"method": "none"}
    return {**{k: q.get(k) for k in ("method", "bits", "group_size", "symmetric")},
            "algorithm": q.get("algorithm") or "rtn"}


def _build_advice(recorded: dict, target_info) -> str:
    """The same quantization, other bytes: where each build was made and what to copy."""
    from eagle3.target.build_record import hash_mismatch_advice

    return ", or serve the exact build: " + hash_mismatch_advice(
        recorded.get("build"), getattr(target_info, "build", None), getattr(target_info, "path", None),
        subject="the drafter's training target")


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
        return ["the drafter export has no eagle3_meta.json: its target, quantization, chat template and aux layer "
                "ids cannot be checked"]
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
            + (_build_advice(t, target_info) if hash_differs and not quant_differs else "")
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


def load_train_manifest(meta: dict, features_dir: Optional[str] = None) -> tuple[Optional[dict], list[str]]:
    """The training features manifest(s) named in the export meta (or in ``features_dir``), merged.

    ``features_dir`` (``evaluate.py train_features_dir=...``: one folder, or several
    comma-separated) replaces the folders the export meta records, for an export copied
    from the machine it was trained on: copy each features folder's ``manifest.json``
    along (only the manifest is read, not the shards).

    Returns ``(manifest or None, warnings)``; the manifest carries ``plan`` and
    ``splits`` (sample ids), which :func:`eagle3.prompts.load_benchmark` uses to refuse
    held-out prompts that were trained on, ``metadata`` (the first folder's) and
    ``features``: per folder ``{dir, aux_layer_ids, manifest_sha256}`` (HF ids as
    extraction captured them; the hex sha256 of its ``manifest.json`` now), which
    :func:`check_aux_ids` compares with the export.
    """
    from eagle3.features import MANIFEST, load_manifest
    from eagle3.io import sha256_file

    dirs = [d.strip() for d in str(features_dir).split(",") if d.strip()] if features_dir else meta.get("features_dir")
    if not dirs:
        return None, ["the export names no features folder: held-out ShareGPT prompts cannot be checked against training"]
    dirs = dirs if isinstance(dirs, list) else [dirs]
    merged: dict[str, Any] = {"plan": [], "splits": {}, "features": []}
    for d in dirs:
        try:
            m = load_manifest(d, require_complete=False)
        except Eagle3Error as e:
            hint = "" if features_dir else (" (an export copied from another machine: copy each features folder's "
                                            "manifest.json along and pass train_features_dir=<folder>[,<folder>...])")
            return None, [f"cannot read the training manifest ({e}); held-out ShareGPT prompts are not checked "
                          f"against training{hint}"]
        merged["plan"] += list(m.get("plan") or [])
        for k, ids in (m.get("splits") or {}).items():
            merged["splits"].setdefault(k, []).extend(ids)
        merged.setdefault("metadata", m.get("metadata"))
        merged["features"].append({"dir": str(d), "aux_layer_ids": (m.get("metadata") or {}).get("aux_layer_ids"),
                                   "manifest_sha256": sha256_file(Path(d) / MANIFEST)})
    return merged, []


def check_aux_ids(export, manifest: Optional[dict], architecture: str) -> list[str]:
    """Check that a server would capture the aux layers the drafter's features had; return warnings.

    Two checks: ``config.json``'s ``eagle_config.eagle_aux_hidden_state_layer_ids``
    (in the convention of the engine the export is for, ``export.convention``: SGLang's
    +1 rule or vLLM's ids as given, :mod:`eagle3.target.layers`) must make that engine
    serving a target of ``architecture`` capture the HF ids in ``eagle3_meta.json``
    (``aux_layer_ids``); and
    those must be the ids the training features were captured with (each manifest's
    ``metadata.aux_layer_ids``, from :func:`load_train_manifest`).

    Args:
        export: :class:`eagle3.export.SGLangExport` from :func:`read_export` (an SGLang or a vLLM export).
        manifest: from :func:`load_train_manifest`, or None (then the second check cannot
            be made, which is a warning).
        architecture: the configured target's family (``model.architecture``).

    Raises:
        Eagle3Error: an id list missing, or ids that disagree (naming both lists and the fix).
    """
    meta, d = export.meta, export.dir
    if not meta:
        return []  # check_export already warns that the export's provenance cannot be checked
    engine = getattr(export, "convention", "sglang")
    shown = {"sglang": "SGLang", "vllm": "vLLM"}.get(engine, engine)
    written = getattr(export, "written_aux_ids", None)
    hf, sg = meta.get("aux_layer_ids"), (written if written is not None else export.sglang_aux_ids)
    if hf is None or sg is None:
        field = f"{META_FILE} field 'aux_layer_ids'" if hf is None else \
            "config.json field 'eagle_config.eagle_aux_hidden_state_layer_ids'"
        raise Eagle3Error(f"{d} lacks the {field}, so the layers a server captures cannot be checked; re-export the drafter")
    hf = list(hf)
    captured = engine_captured_ids(sg, engine, architecture)
    if captured != hf:
        raise Eagle3Error(
            f"{d}/config.json has the {shown} aux ids {sg}, which {shown} serving a {architecture} target captures "
            f"as HF layers {captured}, but {META_FILE} records aux_layer_ids {hf} ({shown} ids "
            f"{_engine_ids(hf, engine, architecture)}); re-export the drafter"
        )
    feats = (manifest or {}).get("features")
    if not feats:
        where = (f"the features folder {meta['features_dir']} cannot be read" if meta.get("features_dir")
                 else f"{META_FILE} names no features folder")
        return [f"the export's aux layer ids {hf} could not be checked against the layers its training features "
                f"were captured from ({where}); make sure they are the layers extraction captured"]
    warnings = []
    for f in feats:
        ids = f.get("aux_layer_ids")
        if ids is None:
            warnings.append(f"the features manifest in {f['dir']} records no aux_layer_ids, so the export's aux "
                            f"layer ids {hf} could not be checked against it")
        elif list(ids) != hf:
            raise Eagle3Error(
                f"the export at {d} makes the server capture aux layers {hf} (HF ids; {shown} ids {sg} in config.json) "
                f"but its training features in {f['dir']} were captured from layers {list(ids)}; re-export the "
                f"drafter from its training run with aux_layer_ids {list(ids)}, or retrain it on features of the "
                "layers you want"
            )
    for f in feats:
        changed = _changed_manifest(meta, f["dir"], f["manifest_sha256"])
        if changed:
            warnings.append(f"the features manifest in {f['dir']} {changed}; its aux layer and held-out checks use "
                            "the current manifest")
    return warnings


def _changed_manifest(meta: dict, folder, now: str) -> Optional[str]:
    """How the manifest of ``folder`` (sha256 ``now``) differs from those recorded at training, or None.

    ``eagle3_meta.json`` records one sha256 per training folder (``features_manifest_sha256``,
    in the order of ``features_dir``). A manifest among them is unchanged whatever order the
    folders are named in now; otherwise the recorded hash of the folder of the same name (or
    the only one recorded) is quoted.
    """
    hashes, dirs = meta.get("features_manifest_sha256"), meta.get("features_dir")
    hashes = hashes if isinstance(hashes, list) else [hashes]
    dirs = dirs if isinstance(dirs, list) else str(dirs or "").split(",")
    known = [h for h in hashes if h]
    if not known or now in known:
        return None
    by_name = {Path(str(d)).name: h for d, h in zip(dirs, hashes)} if len(dirs) == len(hashes) else {}
    want = by_name.get(Path(str(folder)).name) or (known[0] if len(known) == 1 else None)
    if want:
        return f"changed since the drafter was trained on it (sha256 {str(want)[:12]}… recorded, {now[:12]}… now)"
    return f"is none of the {len(known)} the drafter was trained on (its sha256 {now[:12]}… is not recorded)"


def _engine_ids(hf_ids: list[int], engine: str, architecture: str) -> str:
    """``to_engine_ids`` as text, or why the ids cannot be written for that engine."""
    try:
        return str(to_engine_ids(hf_ids, engine, architecture))
    except Eagle3Error:
        return "none: not expressible"


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
        arch: the drafter's :class:`eagle3.model.drafter.DrafterArch` (``vocab_size``,
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
