"""``drafter_dir`` -> the export folder each engine reads (eagle3.export.export_dir), and no
code rewriting ``drafter_dir`` in place."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eagle3.errors import Eagle3Error
from eagle3.export import export_dir

ROOT = Path(__file__).resolve().parents[1]


def _export(d: Path) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}\n")
    return d


@pytest.fixture
def run(tmp_path):
    """A training run's folder as train.py leaves it: both exports under export/."""
    r = tmp_path / "drafters" / "m" / "sharegpt"
    _export(r / "export" / "sglang")
    _export(r / "export" / "vllm")
    return r


@pytest.mark.parametrize("engine, sub", [("hf", "sglang"), ("sglang", "sglang"), ("vllm", "vllm")])
def test_a_run_folder_gives_each_engine_its_export(run, engine, sub):
    assert export_dir(run, engine) == run / "export" / sub
    assert export_dir(str(run), engine) == run / "export" / sub  # a string, as the config holds it


def test_a_run_folder_without_the_engines_export_names_the_missing_folder(tmp_path):
    r = tmp_path / "run"
    _export(r / "export" / "sglang")  # written before there was a vLLM export
    assert export_dir(r, "vllm") == r / "export" / "vllm"  # its reader then says config.json is missing there
    assert export_dir(r, "hf") == r / "export" / "sglang"


@pytest.mark.parametrize("engine", ["hf", "sglang", "vllm"])
def test_an_export_folder_given_directly_is_returned_for_its_engine(run, tmp_path, engine):
    own = run / "export" / ("vllm" if engine == "vllm" else "sglang")
    assert export_dir(own, engine) == own
    copied = _export(tmp_path / "copied-export")  # any folder holding an export's files
    assert export_dir(copied, engine) == copied


def test_the_sglang_export_given_to_vllm_gives_the_vllm_export_beside_it(run, tmp_path):
    assert export_dir(run / "export" / "sglang", "vllm") == run / "export" / "vllm"
    lone = _export(tmp_path / "old" / "export" / "sglang")  # no vLLM export beside it
    assert export_dir(lone, "vllm") == lone  # as given: read_vllm_export refuses it, naming export/vllm
    empty = tmp_path / "old2" / "export"
    _export(empty / "sglang")
    (empty / "vllm").mkdir()  # an unfinished vLLM export (no config.json) is not taken
    assert export_dir(empty / "sglang", "vllm") == empty / "sglang"
    # hf and sglang keep the SGLang export even when a vLLM one is beside it
    assert export_dir(run / "export" / "sglang", "sglang") == run / "export" / "sglang"


def test_an_export_folder_not_yet_written_keeps_its_name(tmp_path):
    d = tmp_path / "run" / "export" / "sglang"  # the old default before any training: its reader names config.json
    assert export_dir(d, "hf") == d


def test_a_folder_that_is_neither_is_refused_with_the_fix(tmp_path):
    missing = tmp_path / "no-such-run"
    with pytest.raises(Eagle3Error) as e:
        export_dir(missing, "hf")
    assert str(e.value) == (
        f"drafter_dir={missing} does not exist: expected a training run's folder (train.py's output_dir, holding "
        "export/sglang and export/vllm) or an export folder (config.json, model.safetensors); run train.py first "
        "or set drafter_dir=<train output_dir>"
    )
    other = tmp_path / "checkpoints"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    with pytest.raises(Eagle3Error, match=re.escape(f"drafter_dir={other} holds neither export/ nor config.json, "
                                                    "model.safetensors, eagle3_meta.json: expected")):
        export_dir(other, "vllm")
    with pytest.raises(Eagle3Error, match="engine 'trt' has no drafter export; use engine=hf, engine=sglang or "
                                          "engine=vllm"):
        export_dir(other, "trt")


#: an assignment to an attribute named drafter_dir (``cfg.drafter_dir = ...``, ``c.drafter_dir += ...``)
ASSIGNMENT = re.compile(r"\.drafter_dir\s*(?:[-+*/]?=)(?!=)|setattr\([^,]+,\s*['\"]drafter_dir['\"]")


def test_the_assignment_pattern_finds_what_it_should():
    assert ASSIGNMENT.search("    cfg.drafter_dir = str(vllm_export_dir(cfg.drafter_dir))")
    assert ASSIGNMENT.search("        c.drafter_dir=str(drafter_dir)")
    assert ASSIGNMENT.search('setattr(cfg, "drafter_dir", d)')
    assert not ASSIGNMENT.search("    if cfg.drafter_dir == other:")
    assert not ASSIGNMENT.search("    d = export_dir(cfg.drafter_dir, engine)")
    assert not ASSIGNMENT.search('    results.update(drafter_dir=str(d))')


def test_nothing_in_eagle3_rewrites_drafter_dir():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in sorted((ROOT / "eagle3").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if ASSIGNMENT.search(line)]
    fix = "drafter_dir is rewritten; pass eagle3.export.export_dir(...) as an argument instead:\n"
    assert hits == [], fix + "\n".join(hits)
