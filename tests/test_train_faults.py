"""Bad training settings and garbage features: one sentence, nothing written, nothing exported."""

from __future__ import annotations

import logging

import pytest

from eagle3.errors import Eagle3Error
from eagle3.train.run import train_drafter
from toy import embed, make_cfg, tiny_target, write_features


@pytest.mark.parametrize(
    "setting, value",
    [
        ("optim.lr", -1.0), ("optim.lr", 0.0), ("optim.weight_decay", -0.1), ("optim.betas", [0.9, 1.0]),
        ("optim.betas", [0.9]), ("optim.warmup_ratio", 1.0), ("optim.grad_clip", -1.0), ("optim.scheduler", "reduce_lr_on_plateau"), ("optim.scheduler", "cosin"),
        ("loop.epochs", 0), ("loop.max_steps", 0), ("loop.max_tokens_per_batch", 4), ("loop.grad_accum", 0),
        ("loop.log_every", 0), ("loop.save_every", 0), ("loop.eval_every", 0), ("loop.num_workers", -1), ("loop.time_limit_min", 0.0), ("loop.collective_timeout_s", 0.0), ("loop.train_fraction", 0.0),
        ("loop.train_fraction", 1.5),
        ("loop.mixed_precision", "fp8"), ("loop.tracker", "wandb"), ("drafter.ttt_steps", 0), ("drafter.feature_noise", -0.1),
        ("drafter.step_weight", 0.0), ("drafter.lm_head_init", "zeros"), ("drafter.ttt_chain_chunk", 0),
        ("drafter.ttt_attention", "sparse"), ("drafter.target_temperature", 0.0),
    ],
)
def test_a_bad_setting_is_named_before_anything_is_written(tmp_path, setting, value):
    write_features(tmp_path / "f", n=12)
    out = tmp_path / "o"
    with pytest.raises(Eagle3Error) as e:
        train_drafter(make_cfg(tmp_path / "f", out, **{setting: value}), tiny_target(), embed())
    msg = str(e.value)
    assert msg.startswith(f"{setting}=") and "\n" not in msg, msg
    assert not out.exists()  # no run record, no draft vocabulary: the corrected command may use this folder


def test_flex_ttt_attention_is_refused_off_cuda_before_anything_is_written(tmp_path):
    """drafter.ttt_attention=flex: FlexAttention has no CPU backward pass, so a CPU run is refused
    up front (not at its first step), and with ttt_chain_chunk (a form of the dense one) anywhere."""
    write_features(tmp_path / "f", n=12)
    out = tmp_path / "o"
    with pytest.raises(Eagle3Error, match=r"^drafter.ttt_attention=flex trains on CUDA only .* on cpu\); use "):
        train_drafter(make_cfg(tmp_path / "f", out, **{"drafter.ttt_attention": "flex"}), tiny_target(), embed())
    assert not out.exists()
    with pytest.raises(Eagle3Error, match=r"^drafter.ttt_attention=flex does not take drafter.ttt_chain_chunk"):
        train_drafter(make_cfg(tmp_path / "f", out, **{"drafter.ttt_attention": "flex", "drafter.ttt_chain_chunk": 4}),
                      tiny_target(), embed())
    assert not out.exists()


def test_the_corrected_command_runs_in_the_same_folder(tmp_path):
    write_features(tmp_path / "f", n=12)
    out = tmp_path / "o"
    with pytest.raises(Eagle3Error, match="optim.lr=-1"):
        train_drafter(make_cfg(tmp_path / "f", out, **{"optim.lr": -1.0}), tiny_target(), embed())
    m = train_drafter(make_cfg(tmp_path / "f", out, **{"loop.max_steps": 2}), tiny_target(), embed())
    assert m["step"] == 2 and (out / "export" / "sglang" / "model.safetensors").is_file()


def test_a_train_fraction_too_small_for_one_step_is_named_and_the_raised_one_runs_in_the_same_folder(tmp_path):
    write_features(tmp_path / "f", n=12)  # 10 training samples
    out = tmp_path / "o"
    tiny = {"loop.train_fraction": 0.1, "loop.grad_accum": 2, "loop.max_steps": 1}
    with pytest.raises(Eagle3Error, match=r"1 training samples \(loop.train_fraction=0.1 of 10; raise it\)"):
        train_drafter(make_cfg(tmp_path / "f", out, **tiny), tiny_target(), embed())
    assert not (out / "train_config.json").exists()
    m = train_drafter(make_cfg(tmp_path / "f", out, **{**tiny, "loop.train_fraction": 1.0}), tiny_target(), embed())
    assert m["step"] == 1 and m["train_samples"] == 10


def test_a_record_written_before_a_setting_existed_resumes_with_its_old_value(tmp_path):
    """drafter.feature_noise, loop.train_fraction and drafter.target_temperature came later: a record
    without them reads as 0, 1 and 1 (what runs did before), so an unchanged command resumes; another
    value is refused."""
    import json

    write_features(tmp_path / "f", n=12)
    out = tmp_path / "o"
    train_drafter(make_cfg(tmp_path / "f", out, **{"loop.max_steps": 2}), tiny_target(), embed(), stop_after=1)
    rec = json.loads((out / "train_config.json").read_text())
    del rec["drafter"]["feature_noise"], rec["loop"]["train_fraction"], rec["drafter"]["target_temperature"]
    (out / "train_config.json").write_text(json.dumps(rec))
    with pytest.raises(Eagle3Error, match=r"loop.train_fraction=1.0, now 0.5"):
        train_drafter(make_cfg(tmp_path / "f", out, **{"loop.max_steps": 2, "loop.train_fraction": 0.5}),
                      tiny_target(), embed())
    assert train_drafter(make_cfg(tmp_path / "f", out, **{"loop.max_steps": 2}), tiny_target(), embed())["step"] == 2


def test_features_that_are_mostly_nan_stop_the_run_before_any_export(tmp_path, caplog):
    write_features(tmp_path / "f", n=12, nan_ids=tuple(f"s{i}" for i in range(12)))
    out = tmp_path / "o"
    with caplog.at_level(logging.WARNING, logger="eagle3"), pytest.raises(Eagle3Error, match="non-finite") as e:
        train_drafter(make_cfg(tmp_path / "f", out, **{"loop.max_steps": 2}), tiny_target(), embed())
    assert "nothing was exported" in str(e.value)
    assert not (out / "export").exists() and not (out / "metrics.json").exists()
    assert any("non-finite" in r.getMessage() for r in caplog.records)


def test_steps_whose_loss_overflows_are_skipped_and_a_run_of_mostly_skipped_steps_exports_nothing(tmp_path, caplog):
    import torch

    write_features(tmp_path / "f", n=12, huge_ids=tuple(f"s{i}" for i in range(12)))  # finite, every loss NaN
    out = tmp_path / "o"
    cfg = make_cfg(tmp_path / "f", out, **{"loop.max_steps": 2, "drafter.feature_noise": 0.1})
    with caplog.at_level(logging.WARNING, logger="eagle3"):
        train_drafter(cfg, tiny_target(), embed(), stop_after=1)
        opt = torch.load(out / "checkpoints" / "step-00000001" / "optimizer.bin", weights_only=False)
        assert opt["state"] == {}  # AdamW never stepped: no moment, no step count
        with pytest.raises(Eagle3Error) as e:  # the same command resumes, skips step 2 too, and refuses to export
            train_drafter(cfg, tiny_target(), embed())
    assert str(e.value).startswith("2 of the 2 optimizer steps of this run had non-finite gradients"), e.value
    assert "nothing was exported" in str(e.value)
    assert not (out / "export").exists() and not (out / "metrics.json").exists()
    warned = [r.getMessage() for r in caplog.records if "skipped on every process" in r.getMessage()]
    assert [w.split(" skipped")[0] for w in warned] == ["optimizer step 1", "optimizer step 2"]


def test_a_few_nan_samples_are_trained_around_with_a_warning(tmp_path, caplog):
    write_features(tmp_path / "f", n=12, nan_ids=("s1",))
    out = tmp_path / "o"
    with caplog.at_level(logging.WARNING, logger="eagle3"):
        m = train_drafter(make_cfg(tmp_path / "f", out, **{"loop.epochs": 1}), tiny_target(), embed())
    warned = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert m["skipped_nonfinite"] == 1 and len(warned) == 1 and "s1" in warned[0]
    assert (out / "export" / "sglang" / "model.safetensors").is_file()


def test_features_of_another_dtype_build_name_the_model_dtype_to_pass():
    from pathlib import Path

    from eagle3.train.data import check_features_match_target

    meta = {"target": {"content_hash": "sha256:f32-build", "dtype": "float32"}, "aux_layer_ids": [2, 4, 5]}
    bf16 = tiny_target(content_hash="sha256:bf16-build", dtype="bfloat16")
    with pytest.raises(Eagle3Error, match=r"float32 build of the target, but model.dtype is bfloat16; pass model.dtype=float32"):
        check_features_match_target(meta, bf16, [Path("f")])
    # same dtype, other weights: the weight hashes are named, not the dtype
    with pytest.raises(Eagle3Error, match="target weights sha256:f32-build"):
        check_features_match_target(meta, tiny_target(content_hash="sha256:other", dtype="float32"), [Path("f")])


def test_a_resumed_run_reports_the_whole_run_training_loss(tmp_path):
    """metrics.json's ``train_run`` averages over every step of the run, those before a resume included."""
    import json

    write_features(tmp_path / "f", n=30)
    tgt, E = tiny_target(), embed()
    over = {"loop.max_steps": 5, "loop.grad_accum": 2, "loop.log_every": 1000, "loop.save_every": 2}
    full = train_drafter(make_cfg(tmp_path / "f", tmp_path / "a", **over), tgt, E)
    assert train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **over), tgt, E, stop_after=3)["interrupted"]
    rest = train_drafter(make_cfg(tmp_path / "f", tmp_path / "b", **over), tgt, E)
    assert full["train_run"]["steps"] == rest["train_run"]["steps"] == 5 and full["train_run"]["loss"] > 0
    assert rest["train_run"] == full["train_run"]  # bit-identical runs: the same sums, exactly
    assert json.loads((tmp_path / "b" / "metrics.json").read_text())["train_run"] == full["train_run"]


def test_the_train_stage_names_a_missing_features_folder_or_bad_setting_before_building_the_target(tmp_path, monkeypatch):
    """``run_train`` builds the target (minutes on first use) only after the settings and every
    features folder's manifest are checked."""
    import eagle3.target
    from eagle3.train.run import run_train

    def no_build(*a, **k):
        raise AssertionError("the target was resolved before the cheap checks")

    monkeypatch.setattr(eagle3.target, "resolve_target", no_build)
    write_features(tmp_path / "f", n=12)
    with pytest.raises(Eagle3Error, match="does not exist; run extract.py first"):
        run_train(make_cfg(f"{tmp_path / 'f'},{tmp_path / 'missing'}", tmp_path / "o"))
    with pytest.raises(Eagle3Error, match=r"^optim.lr=-1"):
        run_train(make_cfg(tmp_path / "f", tmp_path / "o", **{"optim.lr": -1.0}))
    assert not (tmp_path / "o").exists()
