"""Aux-hidden-state layer ids: the one convention eagle3 uses, and SGLang's.

eagle3 convention (everywhere except the SGLang export): id ``k`` indexes HF
``output_hidden_states``, i.e. the residual stream *entering* decoder layer ``k``
(= the output of layer ``k-1``); ``0`` is the embedding output and ``L`` the
final, pre-norm output of the last layer.

SGLang convention (``eagle_config.eagle_aux_hidden_state_layer_ids`` in the drafter's
``config.json``), read from ``srt/models/llama.py`` and ``srt/models/deepseek_v2.py``:

* ``llama`` family: the server captures the input of layer ``c + 1`` for every id ``c``.
* ``deepseek_v2`` family (DeepSeek-V3, Kimi-K2/K2.5): ``+1`` is applied to all ids only
  when the first id is ``1``; otherwise each id ``c`` captures the input of layer ``c``.

So HF ids ``[2, L//2, L-3]`` are written ``[1, L//2-1, L-4]`` on both families.

vLLM convention (read from ``vllm/model_executor/models/llama.py``: the layer loop calls
``_maybe_add_hidden_state(aux, idx + 1, ...)`` after decoder layer ``idx``): id ``k``
is captured after layer ``k-1``, which *is* HF ``output_hidden_states[k]``, on every
family. An export for vLLM therefore writes the HF ids unchanged, and the same
``config.json`` served by the two engines feeds the drafter different layers: each
engine needs its own export (``eagle3_meta.json`` records which: ``aux_id_convention``).
"""

from __future__ import annotations

from eagle3.errors import Eagle3Error

ARCHITECTURES = ("llama", "deepseek_v2")


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """``[2, L//2, L-3]`` for an ``L``-layer target (EAGLE-3 / SGLang default), ``L >= 7``.

    The three ids are strictly increasing exactly when ``2 < L//2 < L-3``, i.e. ``L >= 7``
    (``L = 6`` gives ``[2, 3, 3]``: the same layer twice).

    Raises:
        Eagle3Error: ``num_layers < 7``; set ``model.aux_layer_ids`` explicitly then.
    """
    if num_layers < 7:
        raise Eagle3Error(
            f"the target has only {num_layers} decoder layers; the default aux layer ids "
            "[2, L//2, L-3] are three distinct layers only from 7 layers on, so set model.aux_layer_ids "
            "explicitly (three strictly increasing ids in 1..L)"
        )
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(ids: list[int] | None, num_layers: int) -> list[int]:
    """Return validated HF-convention aux ids (the default when ``ids`` is None).

    Raises:
        Eagle3Error: not exactly three ids, not strictly increasing, or outside
            ``1..num_layers`` (``0``, the embeddings, carries no target computation).
    """
    ids = default_aux_layer_ids(num_layers) if ids is None else [int(i) for i in ids]
    if len(ids) != 3:
        raise Eagle3Error(f"model.aux_layer_ids must list 3 layers, got {ids}")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise Eagle3Error(f"model.aux_layer_ids must be strictly increasing, got {ids}")
    bad = [i for i in ids if not 1 <= i <= num_layers]
    if bad:
        raise Eagle3Error(
            f"model.aux_layer_ids {ids} has {bad} outside the target's {num_layers} layers; "
            f"use ids in 1..{num_layers} (HF output_hidden_states indices), "
            f"e.g. the default {default_aux_layer_ids(num_layers) if num_layers >= 6 else '[1, 2, 3]'}"
        )
    return ids


def _check_arch(architecture: str) -> None:
    if architecture not in ARCHITECTURES:
        raise Eagle3Error(
            f"model.architecture '{architecture}' has no known SGLang aux-id rule; "
            f"use one of {list(ARCHITECTURES)}"
        )


def sglang_captured_ids(sglang_ids: list[int], architecture: str) -> list[int]:
    """What SGLang captures (as HF indices) for the ids written in a drafter config."""
    _check_arch(architecture)
    if architecture == "llama" or (sglang_ids and sglang_ids[0] == 1):
        return [i + 1 for i in sglang_ids]
    return list(sglang_ids)


def to_sglang_ids(hf_ids: list[int], architecture: str) -> list[int]:
    """HF-convention ids -> the ids to write in the exported ``config.json``.

    Raises:
        Eagle3Error: the ids cannot be expressed for this architecture (deepseek_v2 with
            a first HF id of 1: written as 1 it would get +1, written as 0 it would not).
    """
    _check_arch(architecture)
    if architecture == "llama":
        out = [i - 1 for i in hf_ids]
    elif hf_ids[0] == 2:
        out = [i - 1 for i in hf_ids]  # first written id is 1 -> server adds +1 to all
    elif hf_ids[0] != 1:
        out = list(hf_ids)  # first id is not 1 -> server uses them as given
    else:
        raise Eagle3Error(
            f"aux layer ids {hf_ids} cannot be expressed for a deepseek_v2 target in SGLang "
            "(a first id of 1 is read as 'add 1'); start the ids at 2 or higher"
        )
    if sglang_captured_ids(out, architecture) != list(hf_ids):
        raise Eagle3Error(f"aux layer ids {hf_ids} cannot be expressed for {architecture} in SGLang")
    return out


def from_sglang_ids(sglang_ids: list[int], architecture: str) -> list[int]:
    """Inverse of :func:`to_sglang_ids`: the HF indices the server will capture."""
    return sglang_captured_ids(sglang_ids, architecture)


ENGINES = ("sglang", "vllm")


def vllm_captured_ids(vllm_ids: list[int]) -> list[int]:
    """What vLLM captures (as HF indices) for the ids written in a drafter config: the same ids."""
    return [int(i) for i in vllm_ids]


def to_vllm_ids(hf_ids: list[int]) -> list[int]:
    """HF-convention ids -> the ids to write in an export vLLM serves (unchanged)."""
    return [int(i) for i in hf_ids]


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise Eagle3Error(f"no aux-layer-id convention is known for engine '{engine}'; use one of {list(ENGINES)}")


def to_engine_ids(hf_ids: list[int], engine: str, architecture: str) -> list[int]:
    """HF-convention ids -> the ids an export for ``engine`` (``sglang`` | ``vllm``) writes.

    Raises:
        Eagle3Error: an unknown engine, or ids SGLang cannot express (:func:`to_sglang_ids`).
    """
    _check_engine(engine)
    return to_sglang_ids(hf_ids, architecture) if engine == "sglang" else to_vllm_ids(hf_ids)


def engine_captured_ids(written_ids: list[int], engine: str, architecture: str) -> list[int]:
    """The HF indices ``engine`` captures for ids written in a drafter's ``config.json``.

    Raises:
        Eagle3Error: an unknown engine or architecture.
    """
    _check_engine(engine)
    return sglang_captured_ids(written_ids, architecture) if engine == "sglang" else vllm_captured_ids(written_ids)
