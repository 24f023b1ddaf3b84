"""Damaged or inconsistent SGLang exports: each is refused in one sentence naming the file and
the field (or, where a check cannot be made, warned about), never loaded or evaluated.

Every case starts from a good tiny export and damages one thing by hand; the expected sizes,
ids and hashes are written out here, not taken from the code under test.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.errors import Eagle3Error
from eagle3.export.provenance import read_export_meta
from eagle3.export import export_sglang, load_sglang_export
from eagle3.model.drafter import DrafterArch, Eagle3Drafter

sys.path.insert(0, str(Path(__file__).parent))
from fake_sglang import FakeConfig, FakeSGLang, write_tiny_chat_tokenizer  # noqa: E402

V, VD, H = 96, 40, 32
ARCH = DrafterArch(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                   num_layers=1, target_hidden_size=H, vocab_size=V, draft_vocab_size=VD)
#: a draft vocabulary whose ids stay below V - VD, so that ``i + ids[i]`` is still inside the vocabulary
LOW_IDS = torch.tensor(sorted(set(range(0, 56, 2)) | {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23}))
assert LOW_IDS.numel() == VD and int(LOW_IDS.max()) + VD - 1 < V


def good_export(tmp_path, ids=LOW_IDS, name="export", meta_extra=None) -> Path:
    """A float32 export of a seeded drafter whose draft vocabulary is ``ids`` (offsets ``ids - i``)."""
    torch.manual_seed(0)
    m = Eagle3Drafter(ARCH)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    m.set_draft_vocab(ids - torch.arange(VD), t2d)
    meta = {"target": {"name": "tiny", "content_hash": "sha256:abc", "quantization": {"method": "none"},
                       "architecture": "llama"},
            "chat_template_hash": "sha256:def", "aux_layer_ids": [2, 5, 8], **(meta_extra or {})}
    return export_sglang(m.eval(), tmp_path / name, meta, dtype=torch.float32)


def edit_json(path: Path, fn) -> None:
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def edit_tensors(path: Path, **replace) -> None:
    tensors = load_file(str(path))
    tensors.update(replace)
    save_file(tensors, str(path), metadata={"format": "pt"})


def refused(export: Path, match: str) -> list[str]:
    """Both readers refuse ``export`` with one sentence matching ``match``; returns the two messages."""
    msgs = []
    for read in (load_sglang_export, read_export_meta):
        with pytest.raises(Eagle3Error, match=match) as e:
            read(export)
        assert "\n" not in str(e.value) and "Traceback" not in str(e.value)
        msgs.append(str(e.value))
    return msgs


# ------------------------------------------------------------------------------ damaged files
def test_draft_vocab_size_that_disagrees_with_lm_head_is_named(tmp_path):
    out = good_export(tmp_path)
    edit_json(out / "config.json", lambda c: c.update(draft_vocab_size=41))
    msg = refused(out, "lm_head.weight")[0]
    assert msg == (f"{out}/model.safetensors: lm_head.weight has shape [40, 32] but config.json "
                   "(draft_vocab_size=41, hidden_size=32) implies [41, 32]; the two files come from different "
                   "exports: re-export the drafter")


def test_config_json_that_does_not_parse_is_named(tmp_path):
    out = good_export(tmp_path)
    text = (out / "config.json").read_text()
    (out / "config.json").write_text(text[: len(text) // 2])  # cut mid-write
    msg = refused(out, "config.json is not valid JSON")[0]
    assert msg.startswith(f"{out}/config.json is not valid JSON (") and msg.endswith("); re-export the drafter")


def test_meta_json_that_does_not_parse_is_named(tmp_path):
    out = good_export(tmp_path)
    (out / "eagle3_meta.json").write_text('{"aux_layer_ids": [2, 5, 8],')
    refused(out, r"eagle3_meta.json is not valid JSON \(")


def test_non_numeric_size_is_named(tmp_path):
    out = good_export(tmp_path)
    edit_json(out / "config.json", lambda c: c.update(num_attention_heads="four"))
    msg = refused(out, "num_attention_heads")[0]
    assert msg == f"{out}/config.json field 'num_attention_heads' is 'four', not a positive int; re-export the drafter"


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_safetensors_is_named(tmp_path, keep):
    out = good_export(tmp_path)
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: int(len(data) * keep)])
    msg = refused(out, "model.safetensors is not a readable safetensors file")[0]
    assert msg.startswith(f"{out}/model.safetensors is not a readable safetensors file (")
    assert msg.endswith("it is damaged or truncated: copy or re-export the drafter")


def test_healthy_export_reads_back(tmp_path):
    out = good_export(tmp_path)
    drafter, meta = load_sglang_export(out)
    assert torch.equal(drafter.draft_ids(), LOW_IDS) and meta["aux_layer_ids"] == [2, 5, 8]
    assert read_export_meta(out)["draft_vocab_size"] == VD
    # an export without the optional t2d still loads, its t2d rebuilt from d2t
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["t2d"]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    drafter, _ = load_sglang_export(out)
    assert torch.equal(torch.nonzero(drafter.t2d).flatten(), LOW_IDS)


# ------------------------------------------------------------------------------ d2t convention
D2T_AS_IDS = "d2t holds target ids, not offsets (target_id = i + d2t[i]); re-export with d2t = ids - arange(n)"


def test_d2t_written_as_target_ids_is_named(tmp_path):
    """``i + ids[i]`` stays inside the vocabulary and never repeats: only the stored t2d tells."""
    out = good_export(tmp_path)
    assert int((torch.arange(VD) + LOW_IDS).max()) < V  # would pass a range check alone
    edit_tensors(out / "model.safetensors", d2t=LOW_IDS.clone())
    assert refused(out, "d2t holds target ids")[0] == f"{out}/model.safetensors: {D2T_AS_IDS}"


def test_d2t_as_ids_out_of_range_is_named_as_ids(tmp_path):
    ids = torch.arange(V - VD, V)  # the last 40 ids: i + ids[i] reaches 39 + 95 = 134 >= 96
    out = good_export(tmp_path, ids=ids)
    edit_tensors(out / "model.safetensors", d2t=ids.clone())
    assert refused(out, "d2t holds target ids")[0] == f"{out}/model.safetensors: {D2T_AS_IDS}"
    # without the stored t2d the ids reading is still the only valid one
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["t2d"]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    refused(out, "d2t holds target ids")


def test_d2t_with_repeated_targets_is_refused(tmp_path):
    out = good_export(tmp_path)
    offsets = LOW_IDS - torch.arange(VD)
    offsets[5] = int(LOW_IDS[4]) - 5  # draft ids 4 and 5 both map to target id LOW_IDS[4]
    edit_tensors(out / "model.safetensors", d2t=offsets)
    msg = refused(out, "onto target ids another draft id already has")[0]
    assert msg == (f"{out}/model.safetensors: d2t maps 1 draft ids onto target ids another draft id already has "
                   "(d2t holds offsets: target_id = i + d2t[i]); re-export the drafter")


def test_d2t_that_contradicts_the_stored_t2d_is_refused(tmp_path):
    out = good_export(tmp_path)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[LOW_IDS + 1] = True  # the neighbours of the draft vocabulary: 40 ids, mostly others
    edit_tensors(out / "model.safetensors", t2d=t2d)
    overlap = len(set((LOW_IDS + 1).tolist()) & set(LOW_IDS.tolist()))
    msg = refused(out, "stored t2d does not mark")[0]
    assert msg == (f"{out}/model.safetensors: d2t maps {VD - overlap} draft ids to target ids the stored t2d does "
                   "not mark (d2t holds offsets: target_id = i + d2t[i]); re-export the drafter")


# ------------------------------------------------------------------------------ aux ids, end to end
FEATURES_FORMAT, FEATURES_VERSION = "eagle3-features", 1  # docs/design.md, "Features on disk"
SERVED_V, SERVED_H = 512, 4


@pytest.fixture(scope="module")
def fake_servers():
    servers = [FakeSGLang(FakeConfig(hidden_size=SERVED_H, vocab_size=SERVED_V, speculative=False)),
               FakeSGLang(FakeConfig(hidden_size=SERVED_H, vocab_size=SERVED_V, speculative=True))]
    for s in servers:
        s.start()
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tiny_chat_tokenizer(tmp_path_factory.mktemp("tok") / "tiny", SERVED_V)


def features_folder(path: Path, aux_ids) -> str:
    """A hand-made features folder (manifest only) recording ``aux_ids``; returns its manifest's sha256."""
    path.mkdir(parents=True)
    manifest = {"format": FEATURES_FORMAT, "version": FEATURES_VERSION, "complete": True, "samples_per_shard": 1, "plan": [],
                "splits": {"train": [], "validation": []}, "shards": [],
                "metadata": {"aux_layer_ids": list(aux_ids), "aux_layer_convention": "hf_output_hidden_states"}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()


def served_export(tmp_path, tok_dir, features: Path | None) -> Path:
    """An export for the 8-layer fake target: HF aux ids [2, 4, 5], written [1, 3, 4] for llama."""
    from transformers import AutoTokenizer

    from eagle3.target import chat_template_hash

    arch = DrafterArch(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, intermediate_size=16,
                       num_layers=1, target_hidden_size=SERVED_H, vocab_size=SERVED_V, draft_vocab_size=64)
    meta = {"target": {"name": "fake-target", "content_hash": None, "quantization": {"method": "none"},
                       "architecture": "llama"},
            "chat_template_hash": chat_template_hash(AutoTokenizer.from_pretrained(tok_dir)),
            "aux_layer_ids": [2, 4, 5]}
    if features is not None:
        meta.update(features_dir=str(features), features_manifest_sha256=features_folder(features, [2, 4, 5]))
    torch.manual_seed(0)
    out = export_sglang(Eagle3Drafter(arch), tmp_path / "export", meta)
    assert json.loads((out / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    return out


def served_cfg(tmp_path, tok_dir, servers, export: Path):
    from eagle3.config import (BenchmarksConfig, EvaluateConfig, ModelConfig, SGLangEngineConfig,
                               SpeculativeConfig)

    model = ModelConfig(name="fake-target", source="org/fake-target", architecture="llama", num_layers=8,
                        hidden_size=SERVED_H, vocab_size=SERVED_V, tokenizer=tok_dir)
    return EvaluateConfig(
        model=model, engine=SGLangEngineConfig(baseline_url=servers[0].url, speculative_url=servers[1].url,
                                               max_retries=2, backoff_s=0.001),
        data=BenchmarksConfig(names=["gsm8k"], limit=2), speculative=SpeculativeConfig(3, 1, 4), max_new_tokens=8,
        warmup_prompts=0, concurrency=[1], drafter_dir=str(export), output_dir=str(tmp_path / "eval"),
        cache_dir=str(tmp_path / "models"))


def shift_aux(export: Path, sglang_ids=None, hf_ids=None) -> None:
    if sglang_ids is not None:
        edit_json(export / "config.json", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=sglang_ids))
    if hf_ids is not None:
        edit_json(export / "eagle3_meta.json", lambda m: m.update(aux_layer_ids=hf_ids))


def test_aux_ids_shifted_in_both_files_are_refused_against_the_features(tmp_path, tok_dir, fake_servers):
    from eagle3.evaluate.run import run_evaluate

    export = served_export(tmp_path, tok_dir, tmp_path / "features")
    # both files moved by one layer, consistently with each other: the server would capture [3, 5, 6]
    shift_aux(export, sglang_ids=[2, 4, 5], hf_ids=[3, 5, 6])
    with pytest.raises(Eagle3Error) as e:
        run_evaluate(served_cfg(tmp_path, tok_dir, fake_servers, export))
    assert str(e.value) == (
        f"the export at {export} makes the server capture aux layers [3, 5, 6] (HF ids; SGLang ids [2, 4, 5] in "
        f"config.json) but its training features in {tmp_path / 'features'} were captured from layers [2, 4, 5]; "
        "re-export the drafter from its training run with aux_layer_ids [2, 4, 5], or retrain it on features of "
        "the layers you want")
    assert not (tmp_path / "eval" / "report.json").exists()


def test_config_aux_ids_that_disagree_with_the_meta_are_refused(tmp_path, tok_dir, fake_servers):
    from eagle3.evaluate.run import run_evaluate

    export = served_export(tmp_path, tok_dir, tmp_path / "features")
    shift_aux(export, sglang_ids=[2, 4, 5])  # config.json alone moved: a llama server captures [3, 5, 6]
    with pytest.raises(Eagle3Error) as e:
        run_evaluate(served_cfg(tmp_path, tok_dir, fake_servers, export))
    assert str(e.value) == (
        f"{export}/config.json has the SGLang aux ids [2, 4, 5], which SGLang serving a llama target captures as HF layers "
        "[3, 5, 6], but eagle3_meta.json records aux_layer_ids [2, 4, 5] (SGLang ids [1, 3, 4]); re-export the drafter")
    assert not (tmp_path / "eval" / "report.json").exists()


def test_aux_ids_unchecked_when_the_features_are_gone_is_a_warning(tmp_path, tok_dir, fake_servers):
    from eagle3.evaluate.run import run_evaluate

    export = served_export(tmp_path, tok_dir, tmp_path / "features")
    (tmp_path / "features" / "manifest.json").unlink()
    (tmp_path / "features").rmdir()
    res = run_evaluate(served_cfg(tmp_path, tok_dir, fake_servers, export))
    want = ("the export's aux layer ids [2, 4, 5] could not be checked against the layers its training features "
            f"were captured from (the features folder {tmp_path / 'features'} cannot be read); make sure they are "
            "the layers extraction captured")
    assert want in res["warnings"]
    assert want in json.loads((tmp_path / "eval" / "report.json").read_text())["warnings"]


def test_features_manifest_changed_since_training_is_a_warning(tmp_path, tok_dir, fake_servers):
    from eagle3.evaluate.run import run_evaluate

    export = served_export(tmp_path, tok_dir, tmp_path / "features")
    manifest = tmp_path / "features" / "manifest.json"
    recorded = hashlib.sha256(manifest.read_bytes()).hexdigest()
    manifest.write_text(manifest.read_text() + "\n")  # same ids, other bytes
    now = hashlib.sha256(manifest.read_bytes()).hexdigest()
    res = run_evaluate(served_cfg(tmp_path, tok_dir, fake_servers, export))
    assert (f"the features manifest in {tmp_path / 'features'} changed since the drafter was trained on it (sha256 "
            f"{recorded[:12]}… recorded, {now[:12]}… now); its aux layer and held-out checks use the current "
            "manifest") in res["warnings"]


def test_consistent_aux_ids_pass_without_an_aux_warning(tmp_path, tok_dir, fake_servers):
    from eagle3.evaluate.run import run_evaluate

    export = served_export(tmp_path, tok_dir, tmp_path / "features")
    res = run_evaluate(served_cfg(tmp_path, tok_dir, fake_servers, export))
    assert res["benchmarks"]["gsm8k"]["num_prompts"] == 2
    assert not [w for w in res["warnings"] if "aux layer" in w], res["warnings"]


def test_damaged_export_exits_2_with_one_line(tmp_path, tok_dir, fake_servers, capsys):
    """``python evaluate.py ... drafter_dir=<export with a cut config.json>``: exit code 2, one line."""
    from hydra import compose, initialize_config_dir

    from eagle3.cli import run_stage
    from eagle3.evaluate.run import run_evaluate

    export = served_export(tmp_path, tok_dir, None)
    (export / "config.json").write_text((export / "config.json").read_text()[:-40])
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="evaluate", overrides=[
            "model=kimi-k25-int4", "engine=sglang", f"engine.baseline_url={fake_servers[0].url}",
            f"engine.speculative_url={fake_servers[1].url}", "model.architecture=llama", "model.num_layers=8",
            "model.aux_layer_ids=[2,4,5]",
            f"model.tokenizer={tok_dir}", f"model.hidden_size={SERVED_H}", f"model.vocab_size={SERVED_V}",
            f"drafter_dir={export}", "data.names=[gsm8k]", "data.limit=1", "concurrency=[1]", "max_new_tokens=4",
            f"output_dir={tmp_path / 'eval'}", f"cache_dir={tmp_path / 'models'}",
        ])
    with pytest.raises(SystemExit) as e:
        run_stage(run_evaluate, cfg)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {export}/config.json is not valid JSON (")
    assert not (tmp_path / "eval" / "report.json").exists()


def test_training_folders_named_in_another_order_are_not_changed_manifests():
    """The recorded hashes pair with folders by name, not by position: naming the training
    folders in another order (or moved elsewhere) is no change; a changed one quotes its own
    recorded hash, and a folder trained on by none is said to be none of them."""
    from eagle3.export.provenance import _changed_manifest

    meta = {"features_dir": ["/run/w/f-sg", "/run/w/f-gsm8k"], "features_manifest_sha256": ["a" * 64, "b" * 64]}
    assert _changed_manifest(meta, "/elsewhere/f-gsm8k", "b" * 64) is None
    assert _changed_manifest(meta, "/elsewhere/f-sg", "a" * 64) is None
    assert _changed_manifest(meta, "/elsewhere/f-sg", "c" * 64) == (
        f"changed since the drafter was trained on it (sha256 {'a' * 12}… recorded, {'c' * 12}… now)")
    assert _changed_manifest(meta, "/elsewhere/f-he", "c" * 64) == (
        f"is none of the 2 the drafter was trained on (its sha256 {'c' * 12}… is not recorded)")
    one = {"features_dir": "/run/f", "features_manifest_sha256": "a" * 64}  # an export of one folder
    assert _changed_manifest(one, "/other/g", "c" * 64).startswith(f"changed since the drafter was trained on it (sha256 {'a' * 12}")
    assert _changed_manifest({}, "/run/f", "c" * 64) is None  # nothing recorded: nothing to compare
