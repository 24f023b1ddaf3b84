"""The evaluation backend interface: what the evaluate stage needs from an engine.

A backend evaluates one drafter export against its target on one engine: ``hf``
(:mod:`eagle3.evaluate.inprocess`: both decodings in this process), ``sglang``
(:mod:`eagle3.evaluate.sglang`: a baseline and a speculative SGLang server) or ``vllm``
(:mod:`eagle3.evaluate.vllm`: the same with vLLM servers). The stage
(:func:`eagle3.evaluate.run.run_evaluate`) drives every backend the same way:

1. :meth:`Backend.check` before any file is read or written (settings the engine refuses);
2. :meth:`Backend.read_export` on the export folder the engine serves
   (:func:`eagle3.export.export_dir` of ``drafter_dir`` and :attr:`Backend.export_engine`);
   the stage then checks its aux ids against the training features;
3. :meth:`Backend.run` with those inputs (:class:`StageInputs`): benchmarks, provenance
   against the target, the measurements; it returns the report's results dict;
4. :meth:`Backend.close` (a backend is a context manager); the stage writes the report.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


@dataclass
class StageInputs:
    """What the stage has read and checked before a backend runs.

    Attributes:
        settings: :class:`eagle3.spec.SpecSettings` (validated speculative + sampling settings).
        export: the export as read (:func:`eagle3.export.provenance.read_export` or
            :func:`eagle3.export.read_vllm_export`; ``.meta`` its ``eagle3_meta.json``).
        drafter_dir: the export folder read (:func:`eagle3.export.export_dir`).
        manifest: the training features' manifest (:func:`eagle3.export.provenance.load_train_manifest`), or None.
        output_dir: the stage's output folder (:func:`eagle3.paths.stage_output_dir`; created by
            the backend once its inputs are checked).
        warnings: the stage's warnings so far (settings notes, provenance of the features).
    """

    settings: Any
    export: Any
    drafter_dir: Path
    manifest: Optional[dict]
    output_dir: Path
    warnings: list[str] = field(default_factory=list)

    @property
    def meta(self) -> dict:
        """The export's ``eagle3_meta.json`` (aux ids, hashes, quantization)."""
        return self.export.meta


class Backend(abc.ABC):
    """One engine's evaluation (module docstring for the order of the calls).

    Attributes:
        name: the engine (``hf``, ``sglang``, ``vllm``), as the report's ``engine``.
        export_engine: which export subfolder it serves (``sglang`` or ``vllm``,
            :func:`eagle3.export.export_dir`).
    """

    name: str = ""
    export_engine: str = "sglang"

    def __init__(self, cfg: Any):
        self.cfg = cfg

    def check(self, settings: Any) -> list[str]:
        """Refuse settings the engine cannot evaluate, before any file is read; returns warnings.

        Raises:
            Eagle3Error: a setting the engine refuses.
        """
        return []

    def read_export(self, drafter_dir: Path):
        """The export at ``drafter_dir`` as this engine serves it (files, sizes, ``d2t``).

        Raises:
            Eagle3Error: no export, or a damaged one (:func:`eagle3.export.provenance.read_export`).
        """
        from eagle3.export.provenance import read_export

        return read_export(drafter_dir)

    @abc.abstractmethod
    def run(self, inputs: StageInputs) -> dict:
        """Evaluate: benchmarks, provenance against the target, measurements; the report's
        results dict (``engine``, ``benchmarks``, ``speculative``, ``sampling``, ``settings``,
        ``warnings``, ...; :func:`eagle3.evaluate.report.write_report` writes it).

        Raises:
            Eagle3Error: benchmark problems, provenance refusals, unreachable servers, ...
        """

    def run_schedule(self, inputs: StageInputs) -> dict:
        """``mode=schedule``: the served sweep that derives speculative tokens per batch size and
        checks them; the schedule results (:func:`eagle3.evaluate.schedule_report.schedule_results`).

        Raises:
            Eagle3Error: this engine has no schedule sweep (the default).
        """
        from eagle3.errors import Eagle3Error

        raise Eagle3Error(f"mode=schedule serves the drafter through a real server's per-batch-size setting: use "
                          f"engine=vllm (engine={self.name} has no schedule sweep)")

    def close(self) -> None:
        """Release what the backend still holds (idempotent)."""

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
