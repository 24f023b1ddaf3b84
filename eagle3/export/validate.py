"""The one reader of a drafter export folder (SGLang's layout, also served by vLLM).

:class:`ExportFiles` opens the files of an export folder one by one (``config.json``,
``eagle3_meta.json``, the header of ``model.safetensors``, the small ``d2t`` / ``t2d``
tensors), so that the doctor can report each fault in its own row;
:func:`read_sglang_export` reads them all, runs every check of
:mod:`eagle3.export.schema` and returns an :class:`SGLangExport`: the config, the
provenance (``eagle3_meta.json``), the sizes, the file keys of the weights and the draft
vocabulary. Everything that opens an export folder goes through here (the loaders
:func:`eagle3.export.load_sglang_export` and :func:`eagle3.export.read_vllm_export`, the
evaluate stage's :func:`eagle3.export.provenance.read_export`, the doctor, the studies).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError, safe_open

from eagle3.errors import Eagle3Error
from eagle3.export.files import DTYPES, META_FILE, check_convention, export_convention
from eagle3.export.schema import (  # noqa: F401  (the checks, re-exported where they used to live)
    AUX_IDS_FIELD,
    CONFIG_FILE,
    ENGINE_ONLY_FLAGS,
    SGLANG_ARCHITECTURE,
    WEIGHTS_FILE,
    arch_from_sglang_config,
    check_config_and_meta,
    check_vocab_maps,
    check_weights,
    drafter_name,
    engine_norm_alias,
    expected_shapes,
    read_json_object,
)
from eagle3.target import engine_captured_ids


@dataclass
class ExportFiles:
    """An export folder, read file by file (each ``read_*`` method fills its attribute and
    returns it; a field stays None or empty until read).

    Attributes:
        dir: the export folder.
        config: ``config.json`` (None until read); ``meta``: ``eagle3_meta.json``, the
            export's provenance ({} when absent or not read).
        arch: the drafter's sizes (:class:`eagle3.model.drafter.DrafterArch`), None until read.
        header: ``model.safetensors`` key -> (shape, safetensors dtype string), None until read.
        keys: drafter state-dict name (``layers.0.*`` for ``midlayer.*``) -> key in the file.
    """

    dir: Path
    config: Optional[dict] = None
    meta: dict = field(default_factory=dict)
    arch: Any = None
    header: Optional[dict] = None
    keys: dict = field(default_factory=dict)

    @property
    def config_path(self) -> Path:
        return Path(self.dir) / CONFIG_FILE

    @property
    def weights_path(self) -> Path:
        return Path(self.dir) / WEIGHTS_FILE

    @property
    def meta_path(self) -> Path:
        return Path(self.dir) / META_FILE

    def missing(self) -> Optional[str]:
        """The first of ``config.json`` and ``model.safetensors`` the folder lacks, or None."""
        return next((p.name for p in (self.config_path, self.weights_path) if not p.is_file()), None)

    def read_config(self) -> dict:
        """``config.json``. Raises: Eagle3Error: unreadable, not JSON, or not a JSON object."""
        self.config = read_json_object(self.config_path)
        return self.config

    def read_meta(self) -> dict:
        """``eagle3_meta.json`` ({} when absent). Raises: Eagle3Error: as :meth:`read_config`."""
        self.meta = read_json_object(self.meta_path) if self.meta_path.exists() else {}
        return self.meta

    def read_arch(self):
        """The sizes of :attr:`config` (:func:`eagle3.export.schema.arch_from_sglang_config`).

        Raises:
            Eagle3Error: not an ``LlamaForCausalLMEagle3`` config, or a size missing or not positive.
        """
        self.arch = arch_from_sglang_config(self.config or {}, str(self.config_path))
        return self.arch

    def read_header(self) -> dict[str, tuple[list[int], str]]:
        """File key -> (shape, safetensors dtype string) of ``model.safetensors``, from its header only.

        Raises:
            Eagle3Error: the file is not a readable safetensors file.
        """
        try:
            with safe_open(str(self.weights_path), framework="pt") as f:
                self.header = {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
        except (SafetensorError, OSError) as e:
            raise Eagle3Error(f"{self.weights_path} is not a readable safetensors file ({e}); it is damaged or "
                              "truncated: copy or re-export the drafter") from None
        return self.header

    def read_vocab(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The stored ``d2t [Vd]`` and ``t2d [V]`` (each None when the file has none), by :attr:`keys`.

        Raises:
            Eagle3Error: the weights file cannot be read.
        """
        try:
            with safe_open(str(self.weights_path), framework="pt") as f:
                return tuple(f.get_tensor(self.keys[n]) if n in self.keys else None for n in ("d2t", "t2d"))
        except (SafetensorError, OSError) as e:
            raise Eagle3Error(f"{self.weights_path} cannot be read ({e}); copy or re-export the drafter") from None

    @property
    def written_aux_ids(self) -> Any:
        """``eagle_config.eagle_aux_hidden_state_layer_ids`` as written (in the convention of the
        engine the export is for), or None; as stored when it is not a list (the doctor reports it)."""
        eagle = (self.config or {}).get("eagle_config")
        ids = eagle.get(AUX_IDS_FIELD) if isinstance(eagle, dict) else None
        return list(ids) if isinstance(ids, list) else ids

    def captured_aux_ids(self, engine: str, architecture: str) -> list[int]:
        """The HF layer ids ``engine`` (``sglang`` | ``vllm``) serving a target of ``architecture``
        captures for :attr:`written_aux_ids` (:func:`eagle3.target.engine_captured_ids`).

        Raises:
            Eagle3Error: an unknown engine or architecture.
        """
        return engine_captured_ids(list(self.written_aux_ids), engine, architecture)


@dataclass
class SGLangExport(ExportFiles):
    """An export whose files passed :func:`read_sglang_export` (every :class:`ExportFiles`
    field read and checked).

    Attributes (beyond :class:`ExportFiles`'):
        d2t: ``[Vd]`` int64 offsets (target id = ``i + d2t[i]``).
        t2d: ``[V]`` bool, rebuilt from ``d2t`` (SGLang ignores the stored one; when stored
            it was checked to agree).
        dtype: the stored weight dtype (``torch_dtype``).
        convention: whose aux-id convention ``config.json`` uses (``sglang`` | ``vllm``,
            from ``eagle3_meta.json``'s ``aux_id_convention``; absent = ``sglang``).
    """

    d2t: Optional[torch.Tensor] = None
    t2d: Optional[torch.Tensor] = None
    dtype: torch.dtype = torch.bfloat16
    convention: str = "sglang"

    @property
    def sglang_aux_ids(self) -> Optional[list[int]]:
        """``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang convention), or None.
        An SGLang export only: :func:`read_sglang_export` refuses other conventions unless asked."""
        return self.written_aux_ids

    @property
    def trained_aux_ids(self) -> Optional[list[int]]:
        """The HF ids the drafter was trained on (``eagle3_meta.json``'s ``aux_layer_ids``), or None."""
        ids = self.meta.get("aux_layer_ids")
        return None if ids is None else [int(i) for i in ids]


def _check_norm_copies(files: ExportFiles) -> None:
    """A later layer's two norm copies (:func:`eagle3.export.schema.engine_norm_alias`) must be
    equal and finite: SGLang reads the second, vLLM the first."""
    d, keys = files.dir, files.keys
    try:
        with safe_open(str(files.weights_path), framework="pt") as f:
            for name in [n for n in keys if engine_norm_alias(n)]:
                a, b = (f.get_tensor(keys[n]).float() for n in (name, engine_norm_alias(name)))
                finite = bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())
                if not (finite and torch.equal(a, b)):
                    raise Eagle3Error(f"{d / WEIGHTS_FILE}: {keys[name]} and {keys[engine_norm_alias(name)]} "
                                      f"{'differ' if finite else 'hold NaN or inf'}, so SGLang (which reads the "
                                      "second) and vLLM (the first) would not serve the drafter trained; "
                                      "re-export the drafter")
    except (SafetensorError, OSError) as e:
        raise Eagle3Error(f"{d / WEIGHTS_FILE} cannot be read ({e}); copy or re-export the drafter") from None


def read_sglang_export(export_dir, convention: Optional[str] = "sglang") -> SGLangExport:
    """Open and check a drafter export in the ``LlamaForCausalLMEagle3`` layout without
    loading its weights.

    Reads ``config.json``, ``eagle3_meta.json`` (optional), the ``model.safetensors``
    header and its ``d2t`` / ``t2d`` tensors (:class:`ExportFiles`); checks them with
    :mod:`eagle3.export.schema`.

    Args:
        export_dir: the export folder.
        convention: the engine the caller serves it with (``sglang`` | ``vllm``); an
            export whose ``eagle3_meta.json`` records the other engine's aux-id convention
            is refused (:func:`eagle3.export.files.check_convention`). None: the convention
            the export itself declares (nothing refused for it).

    Raises:
        Eagle3Error: a missing file, an export for the other engine (naming the right
            folder), a config flag only some engines act on (:data:`ENGINE_ONLY_FLAGS`), a
            later layer's two norm copies that differ or are not finite, or anything the
            checks refuse, in one sentence naming the file and the field.
    """
    d = Path(export_dir)
    files = ExportFiles(d)
    gone = files.missing()
    if gone:
        raise Eagle3Error(f"{d} has no {gone}; point to a drafter export (<output_dir>/export/{convention or 'sglang'})")
    cfg, meta = files.read_config(), files.read_meta()
    convention = convention or export_convention(meta)
    check_convention(d, meta, convention)
    arch = files.read_arch()
    check_config_and_meta(d, cfg, meta)
    files.keys = check_weights(files.weights_path, files.read_header(), arch, convention)
    d2t, stored = files.read_vocab()
    d2t = torch.zeros(arch.draft_vocab_size, dtype=torch.int64) if d2t is None else d2t
    _check_norm_copies(files)
    t2d = check_vocab_maps(d2t, stored, arch.vocab_size, files.weights_path)
    return SGLangExport(d, cfg, meta, arch, files.header, files.keys, d2t=d2t.to(torch.int64), t2d=t2d,
                        dtype=DTYPES[cfg.get("torch_dtype") or "bfloat16"], convention=export_convention(meta))
