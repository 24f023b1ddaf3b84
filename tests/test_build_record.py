"""The build record of a target folder (eagle3_build.json) and the content-hash checks that name it.

GPTQ builds differ between machines (docs/notebook/results.md: the same command gave another content
hash on an AVX-512 CPU than on an AVX2 CPU or an H200), so a hash that differs must say where
each build was made and what to copy."""

import json
import types
from pathlib import Path

import pytest
import torch

from eagle3.errors import Eagle3Error
from eagle3.target.build_record import BUILD_RECORD, describe, hash_mismatch_advice, read_build_record
from eagle3.target.resolve import content_hash
from eagle3.target.source import _atomic_build

W4A16 = {"method": "w4a16", "bits": 4, "group_size": 32, "symmetric": True, "algorithm": "gptq"}
AVX512 = {"what": "W4A16 build (gptq) of x", "built_utc": "2026-12-03T10:00:00+00:00", "cpu": "Intel Xeon 8480",
          "cpu_capability": "AVX512", "gpu": None, "versions": {}}
AVX2 = {**AVX512, "cpu": "AMD EPYC 7B13", "cpu_capability": "AVX2", "built_utc": "2026-12-07T09:00:00+00:00"}


def test_every_build_records_this_machine_and_the_record_is_not_in_the_content_hash(tmp_path):
    def builder(tmp):
        (tmp / "model.safetensors").write_bytes(b"weights")
        (tmp / "config.json").write_text("{}")

    built = _atomic_build(tmp_path / "built", builder, "W4A16 build (gptq) of dense")
    rec = json.loads((built / BUILD_RECORD).read_text())
    assert rec["what"] == "W4A16 build (gptq) of dense"
    assert rec["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert rec["gpu"] is None and rec["versions"]["torch"] == torch.__version__
    assert read_build_record(built) == rec
    # the same weights without the record: the same content hash
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes(b"weights")
    assert content_hash(built, tmp_path / "c1") == content_hash(bare, tmp_path / "c2")


def test_a_missing_or_damaged_record_is_none():
    assert read_build_record(None) is None
    assert describe(None) == "built where no record was kept"


def test_a_damaged_record_reads_as_none(tmp_path):
    (tmp_path / BUILD_RECORD).write_text("{not json")
    assert read_build_record(tmp_path) is None
    (tmp_path / BUILD_RECORD).write_text("[1, 2]")
    assert read_build_record(tmp_path) is None


def test_the_advice_names_both_machines_and_the_folder_to_copy():
    text = hash_mismatch_advice(AVX512, AVX2, "data/models/smol-w4a16-g32-sym")
    assert "built 2026-12-03 on an AVX512 CPU (Intel Xeon 8480), no GPU" in text
    assert "built 2026-12-07 on an AVX2 CPU (AMD EPYC 7B13), no GPU" in text
    assert "differs between machines" in text and "Copy the folder smol-w4a16-g32-sym" in text
    same = hash_mismatch_advice(AVX2, {**AVX2, "built_utc": "2026-12-08"}, "f")
    assert "the same machine built different bytes" in same


def test_training_refuses_features_of_another_build_and_says_where_each_was_made():
    from eagle3.train.data import check_features_match_target

    meta = {"target": {"content_hash": "sha256:aaa", "dtype": "bfloat16", "build": AVX512},
            "aux_layer_ids": [2, 4, 5]}
    here = types.SimpleNamespace(name="smol-int4", content_hash="sha256:bbb", dtype="bfloat16", hidden_size=8,
                                 vocab_size=64, aux_layer_ids=[2, 4, 5], build=AVX2, path="data/models/smol-w4a16")
    with pytest.raises(Eagle3Error) as e:
        check_features_match_target(meta, here, [Path("f")])
    msg = str(e.value)
    assert "target weights sha256:aaa" in msg and "AVX512 CPU" in msg and "AVX2 CPU" in msg
    assert "Copy the folder smol-w4a16" in msg


def test_evaluation_and_the_doctor_name_the_builds_when_only_the_bytes_differ():
    from eagle3.doctor.provenance import target_row
    from eagle3.export.provenance import check_export

    info = types.SimpleNamespace(name="smol-int4", content_hash="sha256:bbb", quantization=W4A16, build=AVX2,
                                 path="data/models/smol-w4a16")
    meta = {"target": {"name": "smol-int4", "content_hash": "sha256:aaa", "quantization": W4A16, "build": AVX512},
            "chat_template_hash": "sha256:t"}
    (w,) = check_export(meta, info, "sha256:t")
    assert w.startswith("drafter trained on features of a different target") and "AVX512 CPU" in w
    assert "Copy the folder smol-w4a16" in w
    row = target_row(meta, info, "smol-int4")
    assert row["status"] == "fail" and "AVX2 CPU" in row["fix"] and "Copy the folder smol-w4a16" in row["fix"]
    # another quantization is another target: no build advice, the recipe is the difference
    bf16 = {**meta, "target": {**meta["target"], "quantization": {"method": "none"}}}
    (w,) = check_export(bf16, info, "sha256:t")
    assert "Copy the folder" not in w and "'method': 'none'" in w
