"""The train stage: exact resume, input checks, metrics, exports, Hydra sweep."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import eagle3  # noqa: F401
from eagle3.errors import Eagle3Error
from eagle3.features import FeatureDataset
from eagle3.train.data import BatchPlan, length_bucketed_batches, train_subset
from eagle3.model.drafter import Eagle3Drafter
from eagle3.train.run import train_drafter
from toy import H, V, embed, held_out, make_cfg, rule, tiny_target, write_features, write_target_and_features

ROOT = Path(__file__).resolve().parents[1]


def test_batches_deterministic_and_within_budget():
    lengths = [5, 50, 17, 9, 30, 2, 44, 12] * 5
    a = length_bucketed_batches(lengths, 64, seed=1, epoch=0)
    assert a == length_bucketed_batches(lengths, 64, seed=1, epoch=0)
    assert a != length_bucketed_batches(lengths, 64, seed=1, epoch=1)
    assert sorted(i for b in a for i in b) == list(range(len(lengths)))
    assert all(len(b) * max(min(lengths[i], 64) for i in b) <= 64 for b in a)


def test_train_subsets_are_nested_seeded_and_checked():
    a, b = train_subset(40, 0.25, seed=3), train_subset(40, 0.5, seed=3)
    assert (len(a), len(b)) == (10, 20) and set(a) <= set(b) and list(b) == sorted(set(b))
    assert train_subset(40, 0.5, seed=4) != b and train_subset(40, 1.0, seed=3) is None
    assert train_subset(3, 0.01, seed=0) is not None and len(train_subset(3, 0.01, seed=0)) == 1
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(Eagle3Error, match="train_fraction"):
            train_subset(40, bad, seed=0)
    # a plan over the subset batches those samples only, each once per epoch, within the budget
    lengths = [5, 50, 17, 9, 30, 2, 44, 12] * 5
    plan = BatchPlan(lengths, 64, seed=1, grad_accum=1, world=1, samples=b)
    got = [i for batch in plan.batches_of(0) for i in batch]
    assert sorted(got) == list(b) and plan.num_samples == 20
    assert all(len(x) * max(min(lengths[i], 64) for i in x) <= 64 for x in plan.batches_of(0))


def test_train_fraction_trains_on_its_subset_only(tmp_path):
    write_features(tmp_path / "f", n=30)
    tgt, E = tiny_target(), embed()
    ids = FeatureDataset([tmp_path / "f"], splits=("train",), verify=False).sample_ids
    seen = {}
    for frac in (0.5, 1.0):
        got = set()
        m = train_drafter(make_cfg(tmp_path / "f", tmp_path / f"d{frac}", **{"loop.epochs": 3, "loop.train_fraction": frac}),
                          tgt, E, on_batch=lambda s, b: got.update(b))
        seen[frac] = got
        assert (m["train_samples"], m["train_split_samples"]) == (len(got), len(ids))
    sub = {ids[i] for i in train_subset(len(ids), 0.5, seed=0)}
    assert seen[0.5] == sub and seen[1.0] == set(ids) and len(sub) == round(len(ids) / 2)
    # the draft vocabulary's counts are those of the label tokens of the samples trained on
    ds = FeatureDataset([tmp_path / "f"], splits=("train",), verify=False)
    for frac in (0.5, 1.0):
        want = torch.zeros(V, dtype=torch.int64)
        for i in range(len(ds)):
            if ds.sample_ids[i] in seen[frac]:
                rec = ds[i]
                want += torch.bincount(rec["input_ids"][rec["loss_mask"].bool()].long(), minlength=V)
        got = load_file(str(tmp_path / f"d{frac}" / "draft_vocab.safetensors"))["counts"]
        assert torch.equal(got, want), frac


def test_with_feature_noise_a_resumed_run_still_equals_the_uninterrupted_one(tmp_path):
    """The noise of each micro-batch comes from a generator seeded by its global index, so
    3 steps + resume + 2 give the same drafter as 5 steps; without the seeding they differ."""
    write_features(tmp_path / "f", n=30)
    tgt, E = tiny_target(), embed()
    over = {"loop.max_steps": 5, "drafter.feature_noise": 0.2}
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "a", **over), tgt, E)
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **over), tgt, E, stop_after=3)
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **over), tgt, E)
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "c", **{"loop.max_steps": 5}), tgt, E)
    ea, eb, ec = (load_file(str(tmp_path / d / "export" / "sglang" / "model.safetensors")) for d in "abc")
    assert all(torch.equal(ea[k], eb[k]) for k in ea)
    assert not all(torch.equal(ea[k], ec[k]) for k in ea)  # the noise did change the drafter


def test_five_steps_equal_three_plus_resume_plus_two(tmp_path):
    write_features(tmp_path / "f", n=30)
    tgt, E = tiny_target(), embed()
    over = {"loop.max_steps": 5, "loop.grad_accum": 2}
    order_a, order_b = [], []
    full = train_drafter(make_cfg(tmp_path / "f", tmp_path / "a", **over), tgt, E,
                         on_batch=lambda s, ids: order_a.append((s, ids)))
    assert full["step"] == 5 and full["epoch"] >= 1  # the 5 steps cross an epoch boundary
    part = train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **over), tgt, E, stop_after=3,
                         on_batch=lambda s, ids: order_b.append((s, ids)))
    assert part == {"interrupted": True, "step": 3, "output_dir": str(tmp_path / "b")}
    assert not (tmp_path / "b" / "export").exists()
    rest = train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **over), tgt, E,
                         on_batch=lambda s, ids: order_b.append((s, ids)))
    assert rest["step"] == 5
    # metrics.json says which steps its training metrics can cover: those after the resume
    assert (full["launch_first_step"], rest["launch_first_step"]) == (0, 3)
    assert order_a == order_b  # same samples, same order, none repeated
    ca, cb = tmp_path / "a" / "checkpoints" / "step-00000005", tmp_path / "b" / "checkpoints" / "step-00000005"
    wa, wb = load_file(str(ca / "model.safetensors")), load_file(str(cb / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    oa = torch.load(ca / "optimizer.bin", weights_only=False)
    ob = torch.load(cb / "optimizer.bin", weights_only=False)
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(oa["state"][i][k]), torch.as_tensor(ob["state"][i][k])), k
    sa = torch.load(ca / "custom_checkpoint_0.pkl", weights_only=False)
    sb = torch.load(cb / "custom_checkpoint_0.pkl", weights_only=False)
    assert sa["_last_lr"] == sb["_last_lr"] and sa["last_epoch"] == sb["last_epoch"] == 5
    # the exports are identical too
    ea = load_file(str(tmp_path / "a" / "export" / "sglang" / "model.safetensors"))
    eb = load_file(str(tmp_path / "b" / "export" / "sglang" / "model.safetensors"))
    assert all(torch.equal(ea[k], eb[k]) for k in ea)
    # running a finished run again re-exports without training
    again = train_drafter(make_cfg(tmp_path / "f", tmp_path / "a", **over), tgt, E,
                          on_batch=lambda s, ids: pytest.fail("trained again"))
    assert again["step"] == 5


def test_a_run_that_stops_mid_epoch_reports_the_validation_of_its_last_step(tmp_path):
    # by default validation runs at each epoch's end; 5 steps end inside the second epoch, so
    # metrics.json must hold a validation of step 5's weights, not the epoch end's (a stale one
    # was reported before). Reference: the same run validating at step 5 inside the loop.
    write_features(tmp_path / "f", n=30)
    tgt, E = tiny_target(), embed()
    over = {"loop.max_steps": 5, "loop.grad_accum": 2}
    stop = train_drafter(make_cfg(tmp_path / "f", tmp_path / "a", **over), tgt, E)
    ref = train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **over, **{"loop.eval_every": 5}), tgt, E)
    assert stop["epoch"] >= 1 and stop["validation"]["step"] == ref["validation"]["step"] == 5
    assert stop["validation"] == ref["validation"]
    saved = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert saved["validation"]["step"] == 5


def test_a_time_limited_run_exports_early_and_resumes_to_the_same_drafter(tmp_path):
    write_features(tmp_path / "f", n=30)
    tgt, E = tiny_target(), embed()
    over = {"loop.max_steps": 4}
    full = train_drafter(make_cfg(tmp_path / "f", tmp_path / "a", **over), tgt, E)
    assert (full["step"], full["planned_steps"], full["time_limited"]) == (4, 4, False)
    # a limit already passed when the loop starts: one optimizer step, then a normal finish
    early = train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **over, **{"loop.time_limit_min": 1e-9}), tgt, E)
    assert (early["step"], early["planned_steps"], early["time_limited"]) == (1, 4, True)
    meta = json.loads((tmp_path / "b" / "export" / "sglang" / "eagle3_meta.json").read_text())
    assert meta["train_step"] == 1
    assert json.loads((tmp_path / "b" / "metrics.json").read_text())["time_limited"] is True
    # resumed without the limit, the run continues its schedule to the drafter of the uninterrupted run
    rest = train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **over), tgt, E)
    assert (rest["step"], rest["time_limited"], rest["launch_first_step"]) == (4, False, 1)
    ea = load_file(str(tmp_path / "a" / "export" / "sglang" / "model.safetensors"))
    eb = load_file(str(tmp_path / "b" / "export" / "sglang" / "model.safetensors"))
    assert ea.keys() == eb.keys() and all(torch.equal(ea[k], eb[k]) for k in ea)


def test_chunked_ttt_attention_trains_the_same_drafter(tmp_path):
    """drafter.ttt_chain_chunk: the chunked chain attention of eagle3.train.ttt.ChainMask trains
    the drafter that the dense mask trains (float32 on CPU, up to rounding)."""
    write_features(tmp_path / "f", n=30)
    tgt, E = tiny_target(), embed()
    over = {"loop.max_steps": 3}
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "a", **over), tgt, E)
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **over, **{"drafter.ttt_chain_chunk": 3}), tgt, E)
    ea = load_file(str(tmp_path / "a" / "export" / "sglang" / "model.safetensors"))
    eb = load_file(str(tmp_path / "b" / "export" / "sglang" / "model.safetensors"))
    assert ea.keys() == eb.keys()
    moved = [k for k in ea if ea[k].is_floating_point() and not torch.equal(ea[k], ea[k] * 0)]
    assert moved
    for k in ea:  # bf16 exports: a float32 rounding difference may flip an element's last bf16 bit
        torch.testing.assert_close(ea[k], eb[k], msg=k)
    same = sum(int((ea[k] == eb[k]).sum()) for k in ea)
    assert same >= 0.999 * sum(ea[k].numel() for k in ea)


def test_the_ttt_attention_form_may_change_on_resume(tmp_path):
    """drafter.ttt_chain_chunk and drafter.ttt_attention compute one attention (the tests of
    tests/test_ttt.py), so a run stopped with one form resumes with another (resuming on a GPU with
    flex, say) and ends at the drafter of the uninterrupted run; a changed learning rate is refused."""
    write_features(tmp_path / "f", n=30)
    tgt, E = tiny_target(), embed()
    over = {"loop.max_steps": 4}
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "a", **over), tgt, E)
    early = train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **over, **{"loop.time_limit_min": 1e-9}), tgt, E)
    assert early["step"] == 1
    with pytest.raises(Eagle3Error, match="optim.lr"):
        train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **over, **{"optim.lr": 1e-3}), tgt, E)
    rest = train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **over, **{"drafter.ttt_chain_chunk": 3}), tgt, E)
    assert (rest["step"], rest["launch_first_step"]) == (4, 1)
    ea = load_file(str(tmp_path / "a" / "export" / "sglang" / "model.safetensors"))
    eb = load_file(str(tmp_path / "b" / "export" / "sglang" / "model.safetensors"))
    for k in ea:
        torch.testing.assert_close(ea[k], eb[k], msg=k)


def test_the_pad_multiple_changes_no_weight_and_may_change_on_resume(tmp_path):
    """loop.pad_multiple pads each batch's length (and its chain rows) further; padding is masked
    out of the loss, so a run padded to 1 and resumed padded to 64 ends at the drafter of an
    unresumed run padded to 16 (float32 on CPU, up to rounding)."""
    write_features(tmp_path / "f", n=30)
    tgt, E = tiny_target(), embed()
    over = {"loop.max_steps": 4}
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "a", **over), tgt, E)
    early = train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **over,
                                   **{"loop.time_limit_min": 1e-9, "loop.pad_multiple": 1}), tgt, E)
    assert early["step"] == 1
    rest = train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **over, **{"loop.pad_multiple": 64}), tgt, E)
    assert (rest["step"], rest["launch_first_step"]) == (4, 1)
    ea = load_file(str(tmp_path / "a" / "export" / "sglang" / "model.safetensors"))
    eb = load_file(str(tmp_path / "b" / "export" / "sglang" / "model.safetensors"))
    assert any(not torch.equal(ea[k], ea[k] * 0) for k in ea if ea[k].is_floating_point())
    for k in ea:
        torch.testing.assert_close(ea[k], eb[k], msg=k)
    with pytest.raises(Eagle3Error, match="loop.pad_multiple"):
        train_drafter(make_cfg(tmp_path / "f", tmp_path / "c", **over, **{"loop.pad_multiple": 0}), tgt, E)


def test_target_temperature_reaches_the_loss_not_the_rows(tmp_path):
    """drafter.target_temperature changes the loss the run trains and validates on (sharper q: another
    KL), not which rows carry loss."""
    write_features(tmp_path / "f", n=30)
    tgt, E = tiny_target(), embed()
    a = train_drafter(make_cfg(tmp_path / "f", tmp_path / "a", **{"loop.max_steps": 2}), tgt, E)
    b = train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **{"loop.max_steps": 2, "drafter.target_temperature": 0.25}),
                      tgt, E)
    assert a["validation"]["step_rows"] == b["validation"]["step_rows"]
    assert abs(a["validation"]["loss"] - b["validation"]["loss"]) > 1e-3


@torch.no_grad()
def rule_hit_rate(drafter, samples) -> float:
    """Share of positions whose first draft (TTT step 0, as a server drafts after a
    verified token) is the toy rule's next token.

    Row ``r`` gets token ``x[r+1]``, the target's fused aux states at ``r`` and position
    ``r``, and must propose ``rule(x[r+1])`` (= ``x[r+2]``).
    """
    hits = rows = 0
    for ids, aux in samples:
        T = len(ids)
        hidden = drafter.fuse(aux[None].to(drafter.fc.weight.dtype))
        out = drafter(ids[None, 1:], hidden[:, :-1], torch.arange(T - 1)[None])
        proposed = drafter.draft_to_target(out.logits.argmax(-1))
        hits += int((proposed == rule(ids[None, 1:])).sum())
        rows += T - 1
    return hits / rows


def test_learns_the_toy_task_and_writes_metrics_and_exports(tmp_path):
    epochs = 60
    write_features(tmp_path / "f", n=36, nan_ids=("s0", "s7"))
    cfg = make_cfg(tmp_path / "f", tmp_path / "o", **{"loop.epochs": epochs, "loop.tracker": "tensorboard",
                                                      "optim.lr": 1e-2, "loop.max_tokens_per_batch": 2000,
                                                      "loop.eval_every": 1000, "drafter.draft_vocab_size": None})
    m = train_drafter(cfg, tiny_target(), embed())
    saved = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert saved["step"] == m["step"] > 0
    val = saved["validation"]
    assert len(val["step_acc"]) == 3 and len(val["step_loss"]) == 3 and val["samples"] == 6
    # a deterministic successor rule: after 60 full-batch steps the drafter is far above chance (1/64)
    assert val["step_acc"][0] > 0.3 and val["tau"] > 1.2, val
    # the serving replay visits fewer chains (one per verify pass) and stays within a chain's bounds
    assert 0 < val["replay_chains"] < val["chains"] and 1.0 < val["replay_tau"] <= 4.0, val
    assert saved["skipped_nonfinite"] == 2 * epochs  # two NaN samples, skipped in each epoch
    assert saved["tokens_per_s"] > 0 and saved["peak_memory_gb"] > 0 and saved["mixed_precision"] == "no"
    assert 0 < saved["draft_vocab_coverage"] <= 1
    sg = tmp_path / "o" / "export" / "sglang"
    meta = json.loads((sg / "eagle3_meta.json").read_text())
    assert meta["target"]["content_hash"] == "sha256:tiny" and meta["chat_template_hash"] == "sha256:tmpl"
    # draft vocabulary by default: the distinct label tokens (all 64 here), rounded up to 64
    assert meta["aux_layer_ids"] == [2, 4, 5] and meta["ttt_steps"] == 3 and meta["draft_vocab_size"] == 64
    assert meta["features_manifest_sha256"] and meta["features_dir"] == str(tmp_path / "f")
    assert json.loads((sg / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert list((tmp_path / "o").glob("**/events.out.tfevents*")), "no TensorBoard events"
    # the loaded export drafts the toy rule on held-out samples (bf16, as a server runs it);
    # measured: 0.78 of the positions after 60 steps, 0.03 for a fresh drafter (chance 1/64)
    from eagle3.export import load_sglang_export

    d, _ = load_sglang_export(sg, embed())
    assert d.d2t.shape == (64,)
    samples = held_out()
    trained = rule_hit_rate(d, samples)
    assert trained > 0.5, trained
    torch.manual_seed(0)
    fresh = Eagle3Drafter(d.arch)
    fresh.set_draft_vocab(d.d2t, d.t2d)
    fresh.init_from_target(embed())
    untrained = rule_hit_rate(fresh.to(torch.bfloat16).eval(), samples)
    assert untrained < 0.08, untrained


def test_input_checks(tmp_path):
    tgt, E = tiny_target(), embed()
    with pytest.raises(Eagle3Error, match="does not exist"):
        train_drafter(make_cfg(tmp_path / "missing", tmp_path / "o"), tgt, E)
    (tmp_path / "empty").mkdir()
    with pytest.raises(Eagle3Error, match="manifest.json"):
        train_drafter(make_cfg(tmp_path / "empty", tmp_path / "o"), tgt, E)
    write_features(tmp_path / "a")
    write_features(tmp_path / "b", content_hash="sha256:other")
    with pytest.raises(Eagle3Error, match=r"content_hash \('sha256:tiny' vs 'sha256:other'\)"):
        train_drafter(make_cfg(f"{tmp_path / 'a'},{tmp_path / 'b'}", tmp_path / "o"), tgt, E)
    with pytest.raises(Eagle3Error, match="extracted from target weights sha256:other"):
        train_drafter(make_cfg(tmp_path / "b", tmp_path / "o"), tgt, E)
    with pytest.raises(Eagle3Error, match="aux layers"):
        train_drafter(make_cfg(tmp_path / "a", tmp_path / "o"), tiny_target(aux_layer_ids=[2, 3, 5]), E)
    # a resumed run must keep the settings that shape training
    train_drafter(make_cfg(tmp_path / "a", tmp_path / "r", **{"loop.max_steps": 1}), tgt, E, stop_after=1)
    with pytest.raises(Eagle3Error, match="drafter.ttt_steps=3.*now 2"):
        train_drafter(make_cfg(tmp_path / "a", tmp_path / "r", **{"loop.max_steps": 1, "drafter.ttt_steps": 2}), tgt, E)
    write_features(tmp_path / "nolabels", no_labels=True)
    with pytest.raises(Eagle3Error, match="no loss-masked"):
        train_drafter(make_cfg(tmp_path / "nolabels", tmp_path / "o3"), tgt, E)
    with pytest.raises(Eagle3Error, match="drafter.num_layers=0 must be >= 1"):
        train_drafter(make_cfg(tmp_path / "a", tmp_path / "o2", **{"drafter.num_layers": 0}), tgt, E)
    # two layers train and export for both engines (the export's layout: tests/test_export.py)
    train_drafter(make_cfg(tmp_path / "a", tmp_path / "o4", **{"drafter.num_layers": 2, "loop.max_steps": 1}), tgt, E)
    from eagle3.export import load_sglang_export, read_vllm_export
    assert len(load_sglang_export(tmp_path / "o4" / "export" / "sglang")[0].layers) == 2
    assert read_vllm_export(tmp_path / "o4" / "export" / "vllm").arch.num_layers == 2


def test_hydra_multirun_gives_one_folder_per_job_and_a_summary(tmp_path):
    """``python train.py -m drafter.ttt_steps=1,2`` on a tiny local target."""
    write_target_and_features(tmp_path / "tiny", tmp_path / "f", tmp_path / "cache", n=12)
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", "drafter.ttt_steps=1,2",
           f"model.source={tmp_path / 'tiny'}", "model.name=tiny", "model.quantization.method=none",
           "model.dtype=float32", f"cache_dir={tmp_path / 'cache'}", f"features_dir={tmp_path / 'f'}",
           "data.name=toy", "drafter.draft_vocab_size=48", "loop.max_tokens_per_batch=64", "loop.max_steps=2",
           "loop.tracker=none", "export.speculators=false", "device=cpu", f"hydra.sweep.dir={sweep}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for job, steps in (("0", 1), ("1", 2)):
        m = json.loads((sweep / job / "metrics.json").read_text())
        assert m["ttt_steps"] == steps and len(m["validation"]["step_acc"]) == steps
        assert (sweep / job / "export" / "sglang" / "config.json").exists()
    table = (sweep / "summary.md").read_text()
    assert "drafter.ttt_steps=1" in table and "drafter.ttt_steps=2" in table and "tau" in table
    assert "sweep summary" in r.stdout


def test_the_cpu_main_job_recipe_is_the_h200_recipes_lr_and_ttt_and_keeps_the_default_folders():
    # the README's main job trains with experiment=train-cpu, then `python evaluate.py` must find
    # the drafter where it always does: same features and output folders as the defaults
    from hydra import compose, initialize_config_dir

    from eagle3.cli import to_typed

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        default = to_typed(compose("train"))
        cpu = to_typed(compose("train", ["experiment=train-cpu"]))
        h200 = to_typed(compose("train", ["experiment=h200"]))
    assert (cpu.features_dir, cpu.output_dir, cpu.device) == (default.features_dir, default.output_dir, default.device)
    assert (cpu.optim.lr, cpu.drafter.ttt_steps) == (h200.optim.lr, h200.drafter.ttt_steps) == (1e-3, 3)
    assert (default.optim.lr, default.drafter.ttt_steps, default.loop.epochs) == (1e-4, 7, 1)
    assert cpu.loop.epochs == 10 and cpu.loop.max_tokens_per_batch == default.loop.max_tokens_per_batch


def test_the_speculators_export_is_written_where_it_fits_and_skipped_with_a_warning_where_not(tmp_path, caplog):
    """With speculators installed, a drafter of the target's width is also exported in its
    format; a narrower one (own embedding table, which that format cannot hold) still gets
    its SGLang and vLLM exports and the run finishes, with the reason logged."""
    from eagle3.export.speculators import speculators_available

    if not speculators_available():
        pytest.skip("speculators is not installed (.ci/run installs it)")
    write_features(tmp_path / "f", n=20)
    tgt, E = tiny_target(), embed()
    over = {"loop.max_steps": 1, "export.speculators": True}
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "a", **over), tgt, E)
    assert sorted(p.name for p in (tmp_path / "a" / "export").iterdir()) == ["sglang", "speculators", "vllm"]
    narrow = {**over, "drafter.hidden_size": H // 2, "drafter.head_dim": 4}
    with caplog.at_level("WARNING", logger="eagle3"):
        out = train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **narrow), tgt, E)
    assert out["step"] == 1
    assert sorted(p.name for p in (tmp_path / "b" / "export").iterdir()) == ["sglang", "vllm"]
    assert "export/speculators skipped: the speculators format needs hidden_size == the target's" in caplog.text
