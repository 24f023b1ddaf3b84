"""Export a trained drafter in SGLang's EAGLE-3 format; read it back.

SGLang format (``<output_dir>/export/sglang/``), as read by SGLang's
``LlamaForCausalLMEagle3`` (``python/sglang/srt/models/llama_eagle3.py``):

* ``config.json``: ``"architectures": ["LlamaForCausalLMEagle3"]``, the Llama fields
  of the drafter, ``vocab_size`` (the target's), ``draft_vocab_size``,
  ``target_hidden_size``, ``tie_word_embeddings: false`` (else SGLang ties
  ``lm_head`` to the embeddings) and ``eagle_config.eagle_aux_hidden_state_layer_ids``
  in SGLang's convention for the target's architecture
  (:func:`eagle3.target.layers.to_sglang_ids`), so that the server captures exactly the aux
  hidden states the drafter was trained on.
* ``model.safetensors``: ``fc.weight [H, 3*Ht]``, ``midlayer.{input_layernorm,
  hidden_norm, post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v,o}_proj
  .weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``,
  ``lm_head.weight [Vd, H]``, ``d2t [Vd]`` int64 offsets, ``t2d [V]`` bool; and
  ``embed_tokens.weight`` only when ``H != Ht`` (SGLang then keeps the drafter's own
  table instead of sharing the target's).
* ``eagle3_meta.json``: provenance (target name, content hash, quantization,
  architecture, chat template hash, aux ids in HF convention, the features folder and
  its manifest sha256, draft vocabulary size, TTT steps), which evaluation compares
  with the target it serves.

Drafters of more than one layer: layer 0 stays ``midlayer.*`` and layer ``i >= 1`` is
``layers.{i}.*``. Both engines run layers after the first as pre-norm Llama layers with the
residual stream carried across layers, but read their pre-attention norm from different
names: SGLang from ``layers.{i}.hidden_norm.weight`` (its ``LlamaDecoderLayer.forward``,
non-input layers), vLLM from ``layers.{i}.input_layernorm.weight``
(``vllm/model_executor/models/llama_eagle3.py``); each loads the other name into a module it
leaves unused. So the export writes the drafter's one norm under both names, and reading it
back refuses a file whose two copies differ. Checked against SGLang 0.5.23 (CPU) and vLLM
0.32 servers (``docs/results.md``).

Reading an export back checks every file first (:mod:`eagle3.export.validate`), so a
damaged export is refused in one sentence naming the file and the field. The vLLM
exports are :mod:`eagle3.export.vllm` (the same files with vLLM's aux ids) and
:mod:`eagle3.export.speculators`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from eagle3.model.drafter import DrafterArch, Eagle3Drafter
from eagle3.errors import Eagle3Error
from eagle3.export.files import CONVENTION_FIELD, CONVENTIONS, DTYPES, META_FILE, dtype_name, staging_dir, write_json
from eagle3.export.validate import SGLANG_ARCHITECTURE, WEIGHTS_FILE, SGLangExport, engine_norm_alias, read_sglang_export
from eagle3.io import replace_dir
from eagle3.target import to_engine_ids


def sglang_config(arch: DrafterArch, sglang_aux_ids: list[int], dtype: torch.dtype) -> dict:
    """The ``config.json`` SGLang reads for an EAGLE-3 drafter of these sizes.

    Args:
        arch: the drafter's sizes.
        sglang_aux_ids: the 3 aux layer ids in the serving engine's convention: SGLang's
            for the target's architecture (:func:`eagle3.target.layers.to_sglang_ids`),
            or vLLM's (HF ids, :func:`eagle3.target.layers.to_vllm_ids`).
        dtype: weight dtype on disk, written as ``torch_dtype``.

    Raises:
        KeyError: ``dtype`` is not one of :data:`~eagle3.export.files.DTYPES`.
    """
    return {
        "architectures": [SGLANG_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "num_hidden_layers": arch.num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": arch.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": arch.vocab_size,
        "draft_vocab_size": arch.draft_vocab_size,
        "target_hidden_size": arch.target_hidden_size,
        "torch_dtype": dtype_name(dtype),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(sglang_aux_ids),
            "use_aux_hidden_state": True,
        },
    }


def sglang_state_dict(drafter: Eagle3Drafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors of the SGLang checkpoint, named as SGLang's loader expects.

    ``layers.0.*`` becomes ``midlayer.*``; ``rotary_emb.*`` is left out, and so is
    ``embed_tokens.weight`` when the drafter shares the target's table. Floating tensors
    are cast to ``dtype``; ``d2t [Vd]`` int64 and ``t2d [V]`` bool keep theirs. All are
    contiguous CPU tensors.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in drafter.state_dict().items():
        if name.startswith("rotary_emb."):
            continue
        if name == "embed_tokens.weight" and drafter.arch.shares_target_embeddings:
            continue  # SGLang shares the target's table
        if name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0.") :]
        t = t.detach()
        t = t if t.is_meta else t.cpu()  # a drafter on the meta device: the names and shapes alone
        out[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
        alias = engine_norm_alias(name)
        if alias is not None:
            out[alias] = out[name].clone()
    return out


def _engine_state_dict(drafter: Eagle3Drafter, dtype: torch.dtype, convention: str) -> dict[str, torch.Tensor]:
    """:func:`sglang_state_dict`; for vLLM without ``d2t`` / ``t2d`` when the draft vocabulary is the
    whole target vocabulary: vLLM's ``Eagle3LlamaForCausalLM`` then has no ``draft_id_to_target_id``
    parameter and refuses a file that carries one (``llama_eagle3.py``, ``load_weights``)."""
    sd = sglang_state_dict(drafter, dtype)
    if convention != "vllm" or drafter.arch.draft_vocab_size != drafter.arch.vocab_size:
        return sd
    if bool(sd["d2t"].any()):
        raise Eagle3Error("vLLM reads a drafter whose draft vocabulary is the whole target vocabulary in the target's "
                          "order, but this one's d2t permutes it; retrain with a smaller drafter.draft_vocab_size")
    return {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}


def write_eagle3_export(drafter: Eagle3Drafter, out_dir: str | os.PathLike, meta: dict, convention: str,
                        dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``drafter`` as an EAGLE-3 checkpoint for ``convention``'s engine (atomically).

    SGLang and vLLM both load the ``LlamaForCausalLMEagle3`` layout above (vLLM's
    ``vllm/model_executor/models/llama_eagle3.py`` reads the same flat names and
    ``d2t``); the files are identical except for ``eagle_aux_hidden_state_layer_ids``
    in ``config.json``, written with :func:`eagle3.target.layers.to_engine_ids`, and the
    ``eagle3_meta.json`` fields ``aux_id_convention`` and ``<convention>_aux_layer_ids``
    (and, for vLLM, no ``d2t`` / ``t2d`` when the draft vocabulary is the target's whole one).

    Args:
        drafter: an :class:`~eagle3.model.drafter.Eagle3Drafter` (any number of layers;
            see the module docstring for how layers after the first are named).
        meta: provenance (see :data:`META_FILE`); must hold ``aux_layer_ids`` (HF
            convention, 3 ids) and ``target.architecture`` (``llama`` |
            ``deepseek_v2``), which decide the ids written in ``config.json``.
        convention: ``sglang`` | ``vllm`` (:data:`~eagle3.export.files.CONVENTIONS`).
        dtype: weight dtype on disk (both engines serve drafters in bf16).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        Eagle3Error: missing aux ids/architecture, an unknown
            convention, ids that SGLang cannot express for that architecture, or (vLLM) a
            full-size draft vocabulary in another order than the target's, or a ``dtype``
            that is not one of :data:`~eagle3.export.files.DTYPES` (checked before anything
            is written).
    """
    out = Path(out_dir)
    arch = drafter.arch
    if dtype not in DTYPES.values():
        names = ", ".join(f"torch.{n}" for n in DTYPES)
        raise Eagle3Error(f"an export's weights are written as one of {names}, not {dtype}; pass one of those")
    if convention not in CONVENTIONS:
        raise Eagle3Error(f"no export is known for engine '{convention}'; use one of {list(CONVENTIONS)}")
    aux = meta.get("aux_layer_ids")
    family = (meta.get("target") or {}).get("architecture")
    if not aux or len(aux) != 3 or not family:
        raise Eagle3Error("export metadata needs aux_layer_ids (3 HF ids) and target.architecture")
    ids = to_engine_ids(list(aux), convention, family)
    tmp = staging_dir(out)
    tmp.mkdir(parents=True)
    save_file(_engine_state_dict(drafter, dtype, convention), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    write_json(tmp / "config.json", sglang_config(arch, ids, dtype))
    full_meta = dict(meta)
    full_meta.update({
        "aux_layer_ids": list(aux),
        f"{convention}_aux_layer_ids": ids,
        CONVENTION_FIELD: convention,
        "draft_vocab_size": arch.draft_vocab_size,
    })
    write_json(tmp / META_FILE, full_meta)
    replace_dir(tmp, out)
    return out


def export_sglang(drafter: Eagle3Drafter, out_dir: str | os.PathLike, meta: dict,
                  dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``drafter`` in SGLang's EAGLE-3 format to ``out_dir`` (atomically): aux ids in
    SGLang's convention (:func:`write_eagle3_export` with ``convention="sglang"``).

    Raises:
        Eagle3Error: as :func:`write_eagle3_export`.
    """
    return write_eagle3_export(drafter, out_dir, meta, "sglang", dtype)


def export_tensors(exp: SGLangExport) -> dict[str, torch.Tensor]:
    """The weights of a checked export (:func:`eagle3.export.validate.read_sglang_export`, which
    also checked that a later layer's two norm copies agree), by the drafter's state-dict names:
    no ``d2t`` / ``t2d``, no engine alias (:func:`eagle3.export.validate.engine_norm_alias`).

    Raises:
        Eagle3Error: the file cannot be read.
    """
    d = exp.dir
    try:
        with safe_open(str(d / WEIGHTS_FILE), framework="pt") as f:
            tensors = {name: f.get_tensor(key) for name, key in exp.keys.items() if name not in ("d2t", "t2d")}
    except (SafetensorError, OSError) as e:
        raise Eagle3Error(f"{d / WEIGHTS_FILE} cannot be read ({e}); copy or re-export the drafter") from None
    for name in [n for n in tensors if engine_norm_alias(n)]:
        tensors.pop(engine_norm_alias(name))  # equal to tensors[name]: read_sglang_export checked it
    return tensors


def drafter_from_export(exp: SGLangExport, embed_tokens: Optional[torch.Tensor] = None,
                        tensors: Optional[dict[str, torch.Tensor]] = None) -> Eagle3Drafter:
    """An :class:`Eagle3Drafter` (float32, on the CPU) holding the weights and draft vocabulary of a
    checked export; ``embed_tokens`` (the target's ``[V, H]`` table) fills a shared embedding
    table, left at zero when None. ``tensors``: :func:`export_tensors` of ``exp``, when read already.

    Raises:
        Eagle3Error: the weights file cannot be read.
    """
    drafter = Eagle3Drafter(exp.arch)
    with torch.no_grad():
        drafter.load_state_dict(export_tensors(exp) if tensors is None else tensors, strict=False)
        drafter.set_draft_vocab(exp.d2t, exp.t2d)
        if exp.arch.shares_target_embeddings:
            if embed_tokens is not None:
                drafter.embed_tokens.weight.copy_(embed_tokens)
            else:
                drafter.embed_tokens.weight.zero_()
    return drafter


def load_sglang_export(export_dir: str | os.PathLike, embed_tokens: Optional[torch.Tensor] = None,
                       device: str | torch.device = "cpu",
                       dtype: Optional[torch.dtype] = None) -> tuple[Eagle3Drafter, dict]:
    """Load an SGLang-format drafter the way the server reads it.

    The files are checked first (:func:`eagle3.export.validate.read_sglang_export`):
    sizes come from ``config.json``; every tensor of ``model.safetensors`` (names with
    or without a ``model.`` prefix; ``midlayer.`` is layer 0) must have the shape those
    sizes imply; ``d2t`` gives the draft vocabulary as offsets (``target_id = i +
    d2t[i]``, SGLang's and vLLM's convention) and ``t2d`` is rebuilt from it, as SGLang
    ignores the stored one (which must agree when present). The aux layer ids the server
    will capture are ``from_sglang_ids(config ids, target.architecture)`` and must equal
    the HF ids in ``eagle3_meta.json``. An export written for vLLM (``aux_id_convention:
    vllm`` in ``eagle3_meta.json``) is refused: SGLang would read its ids as other layers.

    Args:
        embed_tokens: the target's ``[V, H]`` embedding table (SGLang's ``set_embed``);
            when None and the export carries none, the table is left at zero.
        device: where to put the drafter.
        dtype: compute dtype; None = the stored one (bf16, as a server runs it). On
            CPUs without AMX, float32 is several times faster than bf16.

    Returns:
        ``(drafter in eval mode, meta)``; ``meta`` is ``eagle3_meta.json`` with
        ``aux_layer_ids`` set to what the server will capture.

    Raises:
        Eagle3Error: missing or damaged files (JSON that does not parse, missing or
            non-numeric sizes, missing/extra/misshapen tensors, an unreadable safetensors
            file), a config that is not EAGLE-3, a ``d2t`` that is not a valid offset map,
            aux ids that do not round-trip, an export for vLLM, a later layer's two
            copies of its norm that differ, or a weight holding NaN or infinity (an
            engine would serve it without a word); one sentence naming the file and the
            field (or the right export folder).
    """
    exp = read_sglang_export(export_dir)
    d, meta = exp.dir, exp.meta
    tensors = export_tensors(exp)
    with safe_open(str(d / WEIGHTS_FILE), framework="pt") as f:  # named as in the file
        bad = [k for k in f.keys() if (t := f.get_tensor(k)).is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise Eagle3Error(f"{d / WEIGHTS_FILE}: {', '.join(sorted(bad)[:8])} hold NaN or infinity; "
                          "re-export the drafter from a checkpoint whose weights are finite")
    drafter = drafter_from_export(exp, embed_tokens, tensors)
    family = (meta.get("target") or {}).get("architecture")
    sg_ids = exp.sglang_aux_ids
    if family and sg_ids is not None:
        captured = exp.captured_aux_ids("sglang", family)
        if meta.get("aux_layer_ids") is not None and list(meta["aux_layer_ids"]) != captured:
            raise Eagle3Error(
                f"{d}: config.json aux ids {sg_ids} make a {family} server capture HF layers {captured}, "
                f"but the drafter was trained on {meta['aux_layer_ids']}; re-export it"
            )
        meta["aux_layer_ids"] = captured
    return drafter.to(device=device, dtype=dtype or exp.dtype).eval(), meta
