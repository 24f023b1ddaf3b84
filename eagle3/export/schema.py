"""The checks a drafter export's files must pass (SGLang's layout, also served by vLLM).

The export reader (:func:`eagle3.export.validate.read_sglang_export`) calls these on
``config.json``, ``eagle3_meta.json`` and the ``model.safetensors`` header, and the
doctor (:mod:`eagle3.doctor.checks`) calls them one by one; each refuses, in one sentence
naming the file and the field, what a server or the in-process loader would trip over
later: JSON that does not parse, a missing or non-numeric size, a tensor missing or of
another shape than ``config.json`` implies, and a ``d2t`` that is not a valid offset map
(``target_id = i + d2t[i]``, the convention of SGLang's ``LlamaForCausalLMEagle3`` and of
vLLM's EAGLE-3 loader).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch

from eagle3.errors import Eagle3Error
from eagle3.export.files import DTYPES, META_FILE
from eagle3.model.drafter import DrafterArch, Eagle3Drafter

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
AUX_IDS_FIELD = "eagle_aux_hidden_state_layer_ids"

#: which config.json sizes decide a tensor's shape (first matching name part wins; else hidden_size)
_SHAPE_FIELDS = (
    ("lm_head.", ("draft_vocab_size", "hidden_size")),
    ("d2t", ("draft_vocab_size",)),
    ("t2d", ("vocab_size",)),
    ("embed_tokens.", ("vocab_size", "hidden_size")),
    ("fc.", ("hidden_size", "target_hidden_size")),
    ("q_proj", ("num_attention_heads", "head_dim", "hidden_size")),
    ("k_proj", ("num_key_value_heads", "head_dim", "hidden_size")),
    ("v_proj", ("num_key_value_heads", "head_dim", "hidden_size")),
    ("o_proj", ("hidden_size", "num_attention_heads", "head_dim")),
    ("mlp.", ("intermediate_size", "hidden_size")),
)
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
# config.json flags one or both engines' llama_eagle3.py act on (vLLM: norm_before_residual, logit_scale;
# SGLang: use_aux_norm; both: fc_norm, norm_before_fc, norm_output)
ENGINE_ONLY_FLAGS = ("norm_before_residual", "use_aux_norm", "fc_norm", "norm_before_fc", "norm_output", "logit_scale")
_INT_DTYPES = {"I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64"}


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path``.

    Raises:
        Eagle3Error: the file cannot be read, is not valid JSON, or holds no JSON object.
    """
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Eagle3Error(f"{path} is not valid JSON ({e}); re-export the drafter") from None
    except OSError as e:
        raise Eagle3Error(f"cannot read {path} ({e.strerror or e}); check the file or re-export the drafter") from None
    if not isinstance(obj, dict):
        raise Eagle3Error(f"{path} holds a JSON {type(obj).__name__}, not an object; re-export the drafter")
    return obj


def _size(cfg: dict, key: str, path: str, default=None, kind=int):
    """``cfg[key]`` as a positive ``kind`` (``default`` when absent or null and a default exists)."""
    v = cfg.get(key)
    if v is None:
        if default is None:
            raise Eagle3Error(f"{path} lacks the field '{key}'; it is not a complete EAGLE-3 export: re-export the drafter")
        return default
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
            or (kind is int and v != int(v))):
        raise Eagle3Error(f"{path} field '{key}' is {v!r}, not a positive {kind.__name__}; re-export the drafter")
    return kind(v)


def arch_from_sglang_config(cfg: dict, path: str = CONFIG_FILE) -> DrafterArch:
    """:class:`DrafterArch` from an SGLang drafter ``config.json`` (``path`` names it in errors).

    Defaults where SGLang has one: ``num_key_value_heads`` = heads, ``head_dim`` =
    ``hidden_size // heads``, ``target_hidden_size`` = ``hidden_size``,
    ``draft_vocab_size`` = ``vocab_size``.

    Raises:
        Eagle3Error: not an ``LlamaForCausalLMEagle3`` config, a required field missing,
            a size that is not a positive number, or a draft vocabulary larger than the target's.
    """
    if cfg.get("architectures") != [SGLANG_ARCHITECTURE]:
        raise Eagle3Error(f"{path} declares {cfg.get('architectures')}, not [{SGLANG_ARCHITECTURE!r}]; "
                          "point to an SGLang EAGLE-3 drafter export")
    H, heads = _size(cfg, "hidden_size", path), _size(cfg, "num_attention_heads", path)
    V = _size(cfg, "vocab_size", path)
    arch = DrafterArch(
        hidden_size=H, num_attention_heads=heads,
        num_key_value_heads=_size(cfg, "num_key_value_heads", path, heads),
        head_dim=_size(cfg, "head_dim", path, max(H // heads, 1)),
        intermediate_size=_size(cfg, "intermediate_size", path),
        num_layers=_size(cfg, "num_hidden_layers", path),  # required: both engines' LlamaConfig default is 32
        target_hidden_size=_size(cfg, "target_hidden_size", path, H),
        vocab_size=V, draft_vocab_size=_size(cfg, "draft_vocab_size", path, V),
        rms_norm_eps=_size(cfg, "rms_norm_eps", path, 1e-6, float),
        rope_theta=_size(cfg, "rope_theta", path, 10000.0, float),
        max_position_embeddings=_size(cfg, "max_position_embeddings", path, 8192),
    )
    if arch.draft_vocab_size > V:
        raise Eagle3Error(f"{path} field 'draft_vocab_size' is {arch.draft_vocab_size}, more than its vocab_size {V}; "
                          "re-export the drafter")
    return arch


def _check_ids_field(ids, where: str) -> None:
    """Refuse aux layer ids that are not a list of 3 non-negative integers."""
    if ids is None:
        return
    if not isinstance(ids, list) or len(ids) != 3 or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                                         for i in ids):
        raise Eagle3Error(f"{where} is {ids!r}, not a list of 3 layer ids; re-export the drafter")


def check_config_and_meta(d: Path, cfg: dict, meta: dict) -> None:
    """The fields beside the sizes that readers of the export rely on."""
    eagle = cfg.get("eagle_config")
    if eagle is not None and not isinstance(eagle, dict):
        raise Eagle3Error(f"{d / CONFIG_FILE} field 'eagle_config' is {eagle!r}, not an object; re-export the drafter")
    _check_ids_field((eagle or {}).get(AUX_IDS_FIELD), f"{d / CONFIG_FILE} field 'eagle_config.{AUX_IDS_FIELD}'")
    _check_ids_field(meta.get("aux_layer_ids"), f"{d / META_FILE} field 'aux_layer_ids'")
    if meta.get("target") is not None and not isinstance(meta["target"], dict):
        raise Eagle3Error(f"{d / META_FILE} field 'target' is {meta['target']!r}, not an object; re-export the drafter")
    for key in ENGINE_ONLY_FLAGS:  # each changes the forward in one engine or both; the drafter here has none
        v = cfg.get(key, (eagle or {}).get(key))
        if v not in (None, False, 1.0 if key == "logit_scale" else False):
            raise Eagle3Error(f"{d / CONFIG_FILE} sets {key}={v!r}, which this project's drafter does not compute "
                              "(and SGLang and vLLM do not all read); remove it or re-export the drafter")
    if (cfg.get("torch_dtype") or "bfloat16") not in DTYPES:
        raise Eagle3Error(f"{d / CONFIG_FILE} field 'torch_dtype' is {cfg.get('torch_dtype')!r}, not one of "
                          f"{sorted(DTYPES)}; re-export the drafter")


def drafter_name(key: str) -> str:
    """A key of an SGLang ``model.safetensors`` -> the drafter's state-dict name
    (an optional ``model.`` prefix dropped, ``midlayer.`` read as ``layers.0.``)."""
    name = key[len("model."):] if key.startswith("model.") else key
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def engine_norm_alias(name: str) -> Optional[str]:
    """The second name SGLang reads a later layer's pre-attention norm from, or None.

    ``layers.{i}.input_layernorm.weight`` (``i >= 1``) -> ``layers.{i}.hidden_norm.weight``:
    SGLang's ``llama_eagle3.py`` normalises the input of a non-input layer with
    ``hidden_norm``, vLLM's with ``input_layernorm`` (:mod:`eagle3.export.sglang`'s docstring).
    """
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "layers" and parts[1].isascii() and parts[1].isdecimal() and int(parts[1]) >= 1 \
            and parts[2:] == ["input_layernorm", "weight"]:
        return f"layers.{parts[1]}.hidden_norm.weight"
    return None


def expected_shapes(arch: DrafterArch) -> dict[str, tuple[int, ...]]:
    """Drafter state-dict name -> shape of every tensor an SGLang export of ``arch``
    carries (``embed_tokens.weight`` only when ``H != H_target``; ``t2d`` included,
    though optional; for layers after the first, the second name of the pre-attention
    norm, :func:`engine_norm_alias`). Built on the meta device: nothing is allocated.

    Raises:
        Eagle3Error: the sizes do not make a drafter.
    """
    try:
        with torch.device("meta"):
            sd = Eagle3Drafter(arch).state_dict()
    except (ValueError, RuntimeError) as e:
        raise Eagle3Error(f"the sizes in {CONFIG_FILE} do not make an EAGLE-3 drafter ({e}); re-export the drafter") from None
    out = {k: tuple(t.shape) for k, t in sd.items() if not k.startswith("rotary_emb.")
           and not (k == "embed_tokens.weight" and arch.shares_target_embeddings)}
    out.update({engine_norm_alias(k): shape for k, shape in out.items() if engine_norm_alias(k)})
    return out

def check_weights(path: Path, header: dict[str, tuple[list[int], str]], arch: DrafterArch,
                  convention: str = "sglang") -> dict[str, str]:
    """Check every tensor of an SGLang ``model.safetensors`` against ``arch``.

    Args:
        path: the file (named in errors).
        header: file key -> (shape, safetensors dtype string such as ``BF16``).
        arch: the sizes ``config.json`` declares.

    ``t2d`` is optional, and so is ``d2t`` when the draft vocabulary is the whole target
    vocabulary (then the identity map; the vLLM export leaves both out).

    Returns:
        Drafter state-dict name -> file key.

    Args (further):
        convention: the engine it is read for; a ``model.``-prefixed key is refused for vLLM
            (whose loader adds the prefix itself) and for SGLang's ``lm_head`` (skipped silently).

    Raises:
        Eagle3Error: a tensor missing, unexpected or twice present, decoder layers other than
            ``0 .. num_hidden_layers - 1``, a ``model.`` prefix the engine does not read, of
            another shape than the config's sizes imply, or of a wrong kind (``d2t`` not
            integer, a weight not floating).
    """
    keys: dict[str, str] = {}
    for k in header:
        name = drafter_name(k)
        if name in keys:
            raise Eagle3Error(f"{path} holds both {keys[name]} and {k}; re-export the drafter")
        if k != name and not k.startswith("midlayer.") and (convention == "vllm" or name.startswith("lm_head.")):
            why = ("vLLM's loader prefixes 'model.' itself and refuses 'model.model.'" if convention == "vllm"
                   else "SGLang's loader skips it without a word, leaving the draft head unloaded")
            raise Eagle3Error(f"{path}: {k} has a 'model.' prefix ({why}); name it {_export_key(name)} and re-export")
        keys[name] = k
    held = sorted({int(n.split(".")[1]) for n in keys if n.startswith("layers.") and n.split(".")[1].isdecimal()})
    if held != list(range(arch.num_layers)):
        shown = f"{held[:8]}{' ...' if len(held) > 8 else ''}"
        raise Eagle3Error(f"{path} holds decoder layers {shown} but {CONFIG_FILE} has num_hidden_layers="
                          f"{arch.num_layers}; the two files come from different exports: re-export the drafter")
    want = expected_shapes(arch)
    optional = {"t2d"} | ({"d2t"} if arch.draft_vocab_size == arch.vocab_size else set())  # vLLM's full-vocab form
    missing = sorted(_export_key(n) for n in set(want) - set(keys) - optional)
    extra = sorted(keys[n] for n in set(keys) - set(want))
    if missing or extra:
        raise Eagle3Error(f"{path} lacks {missing[:8]}{' ...' if len(missing) > 8 else ''} and has unexpected "
                          f"{extra[:8]}{' ...' if len(extra) > 8 else ''} for the sizes in {CONFIG_FILE}; "
                          "re-export the drafter")
    for name, shape in sorted(want.items(), key=lambda kv: kv[0] in ("d2t", "t2d")):  # weights first
        if name not in keys:
            continue
        got, dtype = header[keys[name]]
        if tuple(got) != shape:
            fields = next((f for part, f in _SHAPE_FIELDS if part in name), ("hidden_size",))
            sizes = ", ".join(f"{f}={getattr(arch, f)}" for f in fields)
            raise Eagle3Error(f"{path}: {keys[name]} has shape {got} but {CONFIG_FILE} ({sizes}) implies {list(shape)}; "
                              "the two files come from different exports: re-export the drafter")
        kinds = {"d2t": _INT_DTYPES, "t2d": _INT_DTYPES | {"BOOL"}}.get(name, _FLOAT_DTYPES)
        if dtype not in kinds:
            raise Eagle3Error(f"{path}: {keys[name]} is stored as {dtype}, not one of {sorted(kinds)}; re-export the drafter")
    return keys


def _export_key(name: str) -> str:
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def _map_problem(ids: torch.Tensor, t2d: Optional[torch.Tensor], vocab_size: int) -> Optional[str]:
    """Why ``ids`` (target id of every draft id) is not a draft vocabulary, or None."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        return (f"maps draft ids to target ids {int(ids.min())}..{int(ids.max())}, outside the target vocabulary "
                f"of {vocab_size}")
    dup = ids.numel() - torch.unique(ids).numel()
    if dup:
        return f"maps {dup} draft ids onto target ids another draft id already has"
    if t2d is not None:
        if int(t2d.sum()) != ids.numel():
            return f"has {ids.numel()} draft ids but the stored t2d marks {int(t2d.sum())} target ids"
        off = int((~t2d[ids]).sum())
        if off:
            return f"maps {off} draft ids to target ids the stored t2d does not mark"
    return None


def check_vocab_maps(d2t: torch.Tensor, t2d: Optional[torch.Tensor], vocab_size: int, path: Path) -> torch.Tensor:
    """Check ``d2t`` as the offset map SGLang and vLLM read (``target_id = i + d2t[i]``).

    Args:
        d2t: ``[Vd]`` integer offsets. t2d: the stored ``[V]`` mask, or None.
        vocab_size: ``V``. path: the weights file (named in errors).

    Returns:
        ``[V]`` bool: the ``t2d`` rebuilt from ``d2t``.

    Raises:
        Eagle3Error: ``i + d2t[i]`` leaves the vocabulary, repeats, or disagrees with the
            stored ``t2d``; when ``d2t`` itself reads as a valid map, it says that ``d2t``
            holds target ids rather than offsets.
    """
    d2t = d2t.to(torch.int64)
    mask = None if t2d is None else t2d.to(torch.bool)
    ids = torch.arange(d2t.numel()) + d2t
    problem = _map_problem(ids, mask, vocab_size)
    if problem is not None:
        if d2t.numel() > 1 and _map_problem(d2t, mask, vocab_size) is None:
            raise Eagle3Error(f"{path}: d2t holds target ids, not offsets (target_id = i + d2t[i]); "
                              "re-export with d2t = ids - arange(n)")
        raise Eagle3Error(f"{path}: d2t {problem} (d2t holds offsets: target_id = i + d2t[i]); re-export the drafter")
    out = torch.zeros(vocab_size, dtype=torch.bool)
    out[ids] = True
    return out
