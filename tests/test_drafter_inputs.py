"""eagle3.study.drafter_inputs: the CPU diagnostics refuse a drafter, target and features that do
not belong together, before any work, with the field and both values named."""

from __future__ import annotations

import argparse

import pytest
import torch
from safetensors.torch import save_file

from eagle3.errors import Eagle3Error
from eagle3.study.drafter_inputs import check_features_match, positive_int, trained_on, writable_json
from eagle3.target.load import embeddings_in_folder


def test_features_of_another_target_or_other_aux_layers_are_refused():
    meta = {"target": {"content_hash": "sha256:aa"}, "aux_layer_ids": [2, 15, 27]}
    check_features_match(meta, {"target": {"content_hash": "sha256:aa"}, "aux_layer_ids": [2, 15, 27]}, "d", "f")
    with pytest.raises(Eagle3Error, match="content hash sha256:aa.*sha256:bb"):
        check_features_match(meta, {"target": {"content_hash": "sha256:bb"}, "aux_layer_ids": [2, 15, 27]}, "d", "f")
    with pytest.raises(Eagle3Error, match=r"aux layer ids \[2, 15, 27\].*\[2, 15, 29\]"):
        check_features_match(meta, {"target": {"content_hash": "sha256:aa"}, "aux_layer_ids": [2, 15, 29]}, "d", "f")
    check_features_match({}, {"aux_layer_ids": [1, 2, 3]}, "d", "f")  # nothing recorded: nothing compared


def test_embeddings_are_read_from_every_shard_and_bad_folders_are_named(tmp_path):
    e = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    save_file({"model.layers.0.mlp.weight": torch.zeros(2, 2)}, str(tmp_path / "model-00001.safetensors"))
    save_file({"model.embed_tokens.weight": e}, str(tmp_path / "model-00002.safetensors"))
    embed, head = embeddings_in_folder(tmp_path)
    assert torch.equal(embed, e) and head is embed  # tied: the same tensor
    with pytest.raises(Eagle3Error, match="not a model folder"):
        embeddings_in_folder(tmp_path / "nosuch")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(Eagle3Error, match="cannot read"):
        embeddings_in_folder(tmp_path / "bad")
    (tmp_path / "noembed").mkdir()
    save_file({"w": torch.zeros(1)}, str(tmp_path / "noembed" / "model.safetensors"))
    with pytest.raises(Eagle3Error, match="no embed_tokens.weight"):
        embeddings_in_folder(tmp_path / "noembed")


def test_argument_checks(tmp_path):
    assert positive_int("3") == 3
    for bad in ("0", "-1", "abc", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)
    assert writable_json(None) is None
    assert writable_json(tmp_path / "a" / "b.json") == tmp_path / "a" / "b.json"  # folder created
    with pytest.raises(Eagle3Error, match="it is a folder"):
        writable_json(tmp_path)


def test_the_drafters_own_training_features_are_recognised():
    assert trained_on({"features_manifest_sha256": ["a1", "b2"]}, "b2")
    assert trained_on({"features_manifest_sha256": "a1"}, "a1")
    assert not trained_on({"features_manifest_sha256": ["a1"]}, "c3") and not trained_on({}, "c3")
