"""``mode=doctor``: each fault planted in a tiny export is named in its own row and makes the
doctor exit 1; a healthy export passes every row (exit 0).

The exports are made for the session's tiny 8-layer Llama target (tests/conftest.py; HF aux
ids [2, 4, 5], written [1, 3, 4] in SGLang's Llama convention, [2, 4, 5] in vLLM's), with a
hand-made features manifest recording the layers extraction captured. Expected ids, values
and messages are written out here, not taken from the code under test.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.config import DoctorConfig, EvaluateConfig, HFEngineConfig, ModelConfig
from eagle3.doctor.probe import likely_causes, summarize, verdict_row
from eagle3.doctor.run import diagnose, run_doctor
from eagle3.export import export_sglang
from eagle3.model.drafter import DrafterArch, Eagle3Drafter

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
V, VD, H = 49152, 256, 64  # the tiny target: SmolLM2's vocabulary, hidden 64
DRAFT_IDS = torch.arange(0, VD * 100, 100)  # spread-out draft vocabulary: 0, 100, ..., 25500
HF_AUX, SGLANG_AUX = [2, 4, 5], [1, 3, 4]


def features_folder(path: Path, aux_ids) -> str:
    """A features folder holding only a manifest that records ``aux_ids``; returns its sha256."""
    path.mkdir(parents=True)
    manifest = {"format": "eagle3-features", "version": 1, "complete": True, "samples_per_shard": 1, "plan": [],
                "splits": {"train": [], "validation": []}, "shards": [],
                "metadata": {"aux_layer_ids": list(aux_ids), "target": {"dtype": "bfloat16"}}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    """``(ModelConfig, TargetInfo, chat template hash)`` of the tiny target."""
    from eagle3.target import chat_template_hash, load_tokenizer, resolve_target

    model = ModelConfig(name="tiny", source=str(tiny_target_dir))
    info = resolve_target(model, str(tiny_target_dir.parent / "cache"))
    return model, info, chat_template_hash(load_tokenizer(model, str(tiny_target_dir.parent / "cache"), info))


def healthy_export(tmp_path, target, name="sglang") -> Path:
    """A float32 SGLang export of a seeded drafter for the tiny target, its features manifest beside it."""
    _, info, tmpl = target
    arch = DrafterArch(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                       num_layers=1, target_hidden_size=H, vocab_size=V, draft_vocab_size=VD)
    torch.manual_seed(0)
    m = Eagle3Drafter(arch)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[DRAFT_IDS] = True
    m.set_draft_vocab(DRAFT_IDS - torch.arange(VD), t2d)
    feats = tmp_path / "features"
    meta = {"target": {"name": "tiny", "content_hash": info.content_hash, "quantization": info.quantization,
                       "architecture": "llama"},
            "chat_template_hash": tmpl, "aux_layer_ids": HF_AUX, "features_dir": str(feats),
            "features_manifest_sha256": features_folder(feats, HF_AUX)}
    return export_sglang(m.eval(), tmp_path / "export" / name, meta, dtype=torch.float32)


def edit_json(path: Path, fn) -> None:
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def set_config_aux(export: Path, ids) -> None:
    edit_json(export / "config.json", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=ids))


def cfg_for(tmp_path, target, export: Path, probe=False, **doctor) -> EvaluateConfig:
    model, _, _ = target
    return EvaluateConfig(model=model, engine=HFEngineConfig(device="cpu"), drafter_dir=str(export),
                          output_dir=str(tmp_path / "doctor"), cache_dir=str(Path(model.source).parent / "cache"),
                          doctor=DoctorConfig(probe=probe, probe_prompts=2, probe_max_new_tokens=12, **doctor))


def by_name(rows) -> dict:
    return {r["name"]: r for r in rows}


def run_exit(cfg, capsys) -> tuple[int, dict, str]:
    """``run_doctor``'s exit code, its doctor.json rows by name and the printed table."""
    try:
        run_doctor(cfg)
        code = 0
    except SystemExit as e:
        code = e.code
    doc = json.loads((Path(cfg.output_dir) / "doctor.json").read_text())
    return code, by_name(doc["rows"]), capsys.readouterr().out


def only_failure(rows: dict) -> dict:
    bad = [r for r in rows.values() if r["status"] == "fail"]
    assert len(bad) == 1, [(r["name"], r["detail"]) for r in bad]
    return bad[0]


# ------------------------------------------------------------------------------ healthy
def test_healthy_export_passes_every_check(tmp_path, target, capsys):
    export = healthy_export(tmp_path, target)
    code, rows, out = run_exit(cfg_for(tmp_path, target, export), capsys)
    assert code == 0
    assert {n: r["status"] for n, r in rows.items()} == {
        "target": "pass", "export schema": "pass", "tie_word_embeddings": "pass", "d2t": "pass",
        "aux layer ids": "pass", "chat template": "pass", "target and quantization": "pass",
        "compute dtype": "pass"}  # doctor.probe=false: no probe row
    assert rows["aux layer ids"]["detail"] == (
        f"config.json ids {SGLANG_AUX} make sglang capture HF layers {HF_AUX}, the layers of the training features "
        f"in {tmp_path / 'features'}")
    assert rows["d2t"]["detail"] == f"{VD} offsets map the draft vocabulary onto distinct target ids 0..25500, t2d agrees"
    assert "0 failed, 0 warned" in out and "exit 0" in out


# ------------------------------------------------------------------------------ planted faults
def test_missing_d2t_is_named(tmp_path, target, capsys):
    export = healthy_export(tmp_path, target)
    tensors = load_file(str(export / "model.safetensors"))
    del tensors["d2t"]
    save_file(tensors, str(export / "model.safetensors"), metadata={"format": "pt"})
    code, rows, out = run_exit(cfg_for(tmp_path, target, export), capsys)
    bad = only_failure(rows)
    assert code == 1 and bad["name"] == "d2t" and rows["export schema"]["status"] == "pass"
    assert bad["detail"].startswith(f"{export}/model.safetensors has no d2t")
    assert "FAIL  d2t" in out and "exit 1" in out


def test_d2t_written_as_ids_is_named(tmp_path, target, capsys):
    export = healthy_export(tmp_path, target)
    tensors = load_file(str(export / "model.safetensors"))
    tensors["d2t"] = DRAFT_IDS.clone()  # i + 100 i stays inside the vocabulary, distinct: only t2d tells
    save_file(tensors, str(export / "model.safetensors"), metadata={"format": "pt"})
    code, rows, _ = run_exit(cfg_for(tmp_path, target, export), capsys)
    bad = only_failure(rows)
    assert code == 1 and bad["name"] == "d2t"
    assert bad["detail"] == f"{export}/model.safetensors: d2t holds target ids, not offsets (target_id = i + d2t[i])"
    assert bad["fix"] == "re-export with d2t = ids - arange(n)"


def test_aux_ids_shifted_by_one_are_named(tmp_path, target, capsys):
    export = healthy_export(tmp_path, target)
    set_config_aux(export, [0, 2, 3])  # one below SGLang's [1, 3, 4]: a Llama server captures [1, 3, 4]
    code, rows, _ = run_exit(cfg_for(tmp_path, target, export), capsys)
    bad = only_failure(rows)
    assert code == 1 and bad["name"] == "aux layer ids"
    assert bad["detail"] == (f"config.json ids [0, 2, 3] make sglang capture HF layers [1, 3, 4], but the drafter was "
                             f"trained on {HF_AUX} (the training features in {tmp_path / 'features'}); the ids are shifted")
    assert bad["fix"].startswith(f"set eagle_config.eagle_aux_hidden_state_layer_ids to {SGLANG_AUX} (sglang's")


def test_export_for_vllm_served_by_sglang_is_named(tmp_path, target, capsys):
    export = healthy_export(tmp_path, target)
    set_config_aux(export, HF_AUX)  # vLLM's convention: the HF ids as given
    edit_json(export / "eagle3_meta.json", lambda m: m.update(aux_id_convention="vllm"))
    code, rows, _ = run_exit(cfg_for(tmp_path, target, export, serving_engine="sglang"), capsys)
    bad = only_failure(rows)
    assert code == 1 and bad["name"] == "aux layer ids"
    assert bad["detail"].startswith("this export is written for vllm (eagle3_meta.json says aux_id_convention: vllm): "
                                    f"config.json ids {HF_AUX} make sglang capture HF layers [3, 5, 6]")
    assert bad["fix"] == f"serve export/vllm with vllm, or serve export/sglang (ids {SGLANG_AUX}) with sglang"
    # the same folder served by vLLM is healthy
    code, rows, _ = run_exit(cfg_for(tmp_path, target, export, serving_engine="vllm"), capsys)
    assert code == 0 and rows["aux layer ids"]["status"] == "pass"


def test_hf_ids_in_an_sglang_export_are_detected_as_vllm_convention(tmp_path, target, capsys):
    """No meta field: the ids match the trained layers under vLLM's rule only, so that is named."""
    export = healthy_export(tmp_path, target)
    set_config_aux(export, HF_AUX)
    _, rows, _ = run_exit(cfg_for(tmp_path, target, export), capsys)
    assert rows["aux layer ids"]["detail"].startswith(
        "this export is written for vllm (under vllm's rule they capture exactly the trained layers)")
    # and the SGLang export served by vLLM is named the other way round
    export2 = healthy_export(tmp_path / "b", target)
    code, rows, _ = run_exit(cfg_for(tmp_path, target, export2, serving_engine="vllm"), capsys)
    assert code == 1 and rows["aux layer ids"]["fix"] == (
        f"serve export/sglang with sglang, or serve export/vllm (ids {HF_AUX}) with vllm")


def test_wrong_architecture_name_is_named(tmp_path, target, capsys):
    export = healthy_export(tmp_path, target)
    edit_json(export / "config.json", lambda c: c.update(architectures=["LlamaForCausalLM"]))
    code, rows, _ = run_exit(cfg_for(tmp_path, target, export), capsys)
    assert code == 1 and rows["export schema"]["status"] == "fail"
    assert rows["export schema"]["detail"] == (f"{export}/config.json declares ['LlamaForCausalLM'], not "
                                               "['LlamaForCausalLMEagle3']")
    assert rows["export schema"]["fix"].startswith('set "architectures": ["LlamaForCausalLMEagle3"] in config.json')
    assert rows["d2t"]["status"] == "skip"


def test_tied_word_embeddings_are_named(tmp_path, target, capsys):
    export = healthy_export(tmp_path, target)
    edit_json(export / "config.json", lambda c: c.update(tie_word_embeddings=True))
    code, rows, _ = run_exit(cfg_for(tmp_path, target, export), capsys)
    bad = only_failure(rows)
    assert code == 1 and bad["name"] == "tie_word_embeddings"
    assert bad["fix"] == 'set "tie_word_embeddings": false in config.json'


def test_features_of_another_quantization_are_named(tmp_path, target, capsys):
    export = healthy_export(tmp_path, target)
    int4 = {"method": "w4a16", "bits": 4, "group_size": 32, "symmetric": True}
    edit_json(export / "eagle3_meta.json",
              lambda m: m["target"].update(name="tiny-int4", content_hash="sha256:0123456789abcdef99", quantization=int4))
    code, rows, _ = run_exit(cfg_for(tmp_path, target, export), capsys)
    bad = only_failure(rows)
    assert code == 1 and bad["name"] == "target and quantization"
    assert bad["detail"].startswith("the features were extracted from tiny-int4 (content hash sha256:012345678, "
                                    "quantization w4a16 4-bit g32) but model=tiny serves tiny (content hash ")
    assert bad["detail"].endswith("quantization none (dense))")
    assert bad["fix"] == "serve the target the features came from (model=tiny-int4), or extract features from " \
                         "model=tiny and retrain"


def test_another_chat_template_is_named(tmp_path, target, capsys):
    export = healthy_export(tmp_path, target)
    edit_json(export / "eagle3_meta.json", lambda m: m.update(chat_template_hash="sha256:" + "ab" * 32))
    code, rows, _ = run_exit(cfg_for(tmp_path, target, export), capsys)
    bad = only_failure(rows)
    assert code == 1 and bad["name"] == "chat template"
    assert bad["detail"].startswith("the drafter was trained on prompts rendered with chat template sha256:abababab")
    assert bad["fix"].startswith("evaluate with the training template")


# ------------------------------------------------------------------------------ the probe
def test_probe_measures_by_hand():
    # 4 passes accepting 0, 0, 1, 3 drafts emit 1 + 1 + 2 + 4 = 8 tokens
    s = summarize([0, 0, 1, 3], 8, draft_vocab_size=VD, num_steps=3)
    assert s["tau"] == 2.0 and s["first_position_acceptance"] == 0.5 and s["accepted_drafts"] == 4
    assert s["proposed_drafts"] == 12 and s["chance_first_position"] == 1 / 256 and s["at_chance"] is False
    # 40 passes, none accepted: within 3 sigma of 1/256 (bound 1/256 + 3 sqrt(255/256^2/40) = 0.034)
    z = summarize([0] * 40, 40, draft_vocab_size=VD, num_steps=3)
    assert z["tau"] == 1.0 and z["first_position_acceptance"] == 0.0 and z["at_chance"] is True
    assert summarize([0] * 39 + [1], 41, VD, 3)["at_chance"] is True  # 0.025 < 0.034
    assert summarize([0] * 38 + [1, 1], 42, VD, 3)["at_chance"] is False  # 0.05 > 0.034


def test_verdict_ranks_the_failed_checks():
    res = {**summarize([0] * 40, 40, VD, 3), "prompts": 4, "draft_vocab_size": VD}
    rows = [{"name": "chat template", "status": "fail"}, {"name": "d2t", "status": "fail"},
            {"name": "compute dtype", "status": "warn"}, {"name": "aux layer ids", "status": "fail"},
            {"name": "target", "status": "pass"}]
    assert likely_causes(rows) == ["aux layer ids", "d2t", "chat template", "compute dtype"]
    v = verdict_row(res, rows, 1.05)
    assert v["status"] == "fail" and v["detail"].startswith(
        "accepts nothing: tau 1.00 over 40 verify passes (4 prompts), first-position acceptance 0.000 (at chance level)")
    assert "probability 0.0039" in v["detail"]
    assert v["fix"] == ("likely causes, most likely first: aux layer ids, d2t, chat template, compute dtype "
                        "(fix the rows above)")
    assert verdict_row(res, [], 1.05)["fix"].startswith("no check failed: the drafter itself is untrained")
    good = {**summarize([3] * 10, 40, VD, 3), "prompts": 1, "draft_vocab_size": VD}
    assert verdict_row(good, rows, 1.05)["status"] == "pass"


def test_probe_in_process_on_the_tiny_target(tmp_path, target, capsys):
    """A random drafter on the random tiny target accepts at chance level: the probe fails it
    and, no check having failed, blames the drafter itself."""
    export = healthy_export(tmp_path, target)
    rows, doc = diagnose(cfg_for(tmp_path, target, export, probe=True))
    r, p = by_name(rows)["acceptance probe"], doc["probe"]["in_process"]
    assert p["prompts"] == 2 and p["aux_layer_ids"] == HF_AUX and p["draft_vocab_size"] == VD
    assert p["verify_passes"] > 0 and p["tau"] == pytest.approx(p["emitted"] / p["verify_passes"])
    # a pass emits its accepted drafts plus one token; the last pass of a prompt may be cut at max_new_tokens
    assert p["emitted"] <= p["accepted_drafts"] + p["verify_passes"]
    assert p["emitted"] >= p["verify_passes"] and p["emitted"] <= 2 * (12 - 1)
    assert p["tau"] < 1.05 and r["status"] == "fail" and r["detail"].startswith("accepts nothing: tau ")
    assert r["fix"].startswith("no check failed: the drafter itself is untrained")


# ------------------------------------------------------------------------------ the entry point
@pytest.mark.parametrize("entry", [["evaluate.py", "mode=doctor"], ["doctor.py"]], ids=["evaluate", "doctor"])
def test_entry_point_exits_1_and_names_the_check(tmp_path, target, entry):
    model, _, _ = target
    export = healthy_export(tmp_path, target)
    set_config_aux(export, [0, 2, 3])
    cmd = [sys.executable, *entry, "model=smollm2-135m-bf16", "model.name=tiny",
           f"model.source={model.source}", f"cache_dir={Path(model.source).parent / 'cache'}", "engine.device=cpu",
           f"drafter_dir={export}", f"output_dir={tmp_path / 'out'}", "doctor.probe=false"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "FAIL  aux layer ids" in p.stdout and "exit 1" in p.stdout
    rows = by_name(json.loads((tmp_path / "out" / "doctor.json").read_text())["rows"])
    assert rows["aux layer ids"]["status"] == "fail" and rows["d2t"]["status"] == "pass"


def test_served_probe_reads_spec_verify_ct(tmp_path):
    """engine=sglang with speculative_url: the prompts go to the server, tau from its meta_info."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from eagle3.config import SGLangEngineConfig
    from eagle3.doctor.probe import probe_messages, probe_served
    from eagle3.target import render_prompt

    sys.path.insert(0, str(Path(__file__).parent))
    from fake_sglang import FakeConfig, FakeSGLang, response_length, spec_passes, write_tiny_chat_tokenizer

    tok = AutoTokenizer.from_pretrained(write_tiny_chat_tokenizer(tmp_path / "tok", 512))
    with FakeSGLang(FakeConfig(vocab_size=512, speculative=True, accept_pattern=[2, 0, 3, 1])) as server:
        cfg = SimpleNamespace(engine=SGLangEngineConfig(speculative_url=server.url, max_retries=1, backoff_s=0.001),
                              doctor=DoctorConfig(probe_prompts=3, probe_max_new_tokens=16))
        res = probe_served(cfg, tok, draft_vocab_size=64)
    # the fake answers prompt p with 3 + sum(p) % 5 tokens in passes accepting 2, 0, 3, 1, ... drafts
    lengths = [response_length(render_prompt(tok, m)) for m in probe_messages(3)]
    passes = sum(len(spec_passes(n - 1, [2, 0, 3, 1])) for n in lengths)  # the first token comes from the prefill
    assert res["verify_passes"] == passes and res["completion_tokens"] == sum(lengths)
    assert res["tau_sglang"] == pytest.approx(sum(lengths) / passes)
    assert res["tau"] == pytest.approx((sum(lengths) - 3) / passes)
    assert verdict_row({**res, "first_position_acceptance": None}, [], 1.05, "served acceptance probe")["status"] == \
        ("pass" if (sum(lengths) - 3) / passes >= 1.05 else "fail")
