"""Where the stages write: defaults from the schema, Hydra's run folder = output_dir, one folder per multirun job."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from eagle3.cli import to_typed
from eagle3.errors import Eagle3Error
from eagle3.paths import features_dirs, hydra_job, stage_output_dir

CONF = Path(__file__).resolve().parents[1] / "conf"


def _compose(stage: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(stage, overrides, return_hydra_config=True)


@pytest.mark.parametrize(
    "stage, overrides, expected",
    [
        ("extract", [], {"output_dir": "data/features/smollm2-135m-int4/sharegpt"}),
        ("extract", ["model=smollm2-135m-bf16", "data=gsm8k"], {"output_dir": "data/features/smollm2-135m-bf16/gsm8k"}),
        ("train", ["data=gsm8k"], {"features_dir": "data/features/smollm2-135m-int4/gsm8k",
                                   "output_dir": "data/drafters/smollm2-135m-int4/gsm8k"}),
        ("evaluate", ["model=smollm2-135m-bf16"], {"output_dir": "data/eval/smollm2-135m-bf16",
                                                   "drafter_dir": "data/drafters/smollm2-135m-bf16/sharegpt"}),
    ],
)
def test_defaults_follow_model_and_data(stage, overrides, expected):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        typed = to_typed(compose(stage, overrides))
    for key, value in expected.items():
        assert getattr(typed, key) == value
    cfg = _compose(stage, overrides)
    # Hydra's run folder (.hydra/config.yaml, the log) is the stage's output folder, and a
    # multirun puts job n under <output_dir>/n
    assert cfg.hydra.run.dir == expected["output_dir"]
    assert cfg.hydra.sweep.dir == expected["output_dir"]
    assert OmegaConf.to_container(cfg.hydra.sweep, resolve=False)["subdir"] == "${hydra.job.num}"


def test_explicit_output_dir_moves_the_run_folder_too(tmp_path):
    cfg = _compose("train", [f"output_dir={tmp_path}"])
    assert cfg.output_dir == str(tmp_path) and cfg.hydra.run.dir == str(tmp_path)


def test_stage_output_dir_outside_hydra_and_in_a_multirun_job(tmp_path):
    cfg = _compose("evaluate", [f"output_dir={tmp_path / 'eval'}"])
    assert hydra_job() is None
    assert stage_output_dir(cfg) == tmp_path / "eval"
    with open_dict(cfg):  # what Hydra sets for job 3 of a multirun
        cfg.hydra.mode = "MULTIRUN"
        cfg.hydra.job.num = 3
        cfg.hydra.runtime.output_dir = str(tmp_path / "eval" / "3")
    HydraConfig.instance().set_config(cfg)
    try:
        job = hydra_job()
        assert job is not None and job.multirun and job.num == "3"
        assert stage_output_dir(cfg) == tmp_path / "eval" / "3"
    finally:
        HydraConfig.instance().cfg = None
    cfg.output_dir = ""
    with pytest.raises(Eagle3Error, match="output_dir"):
        stage_output_dir(cfg)


def test_features_dirs_splits_on_commas():
    cfg = type("C", (), {"features_dir": "a, b/c,,"})()
    assert features_dirs(cfg) == [Path("a"), Path("b/c")]


def _extract(tmp_path, tiny_target_dir, *overrides):
    import subprocess
    import sys

    (tmp_path / "chats.jsonl").write_text('{"messages":[{"role":"user","content":"Hi there"}]}\n'
                                          '{"messages":[{"role":"user","content":"Count to three"}]}\n')
    flags = [o for o in overrides if o.startswith("-")]
    cmd = [sys.executable, str(CONF.parent / "extract.py"), *flags, "model=smollm2-135m-bf16", "model.name=tiny",
           f"model.source={tiny_target_dir}", "data=jsonl", "data.path=chats.jsonl", "cache_dir=c",
           *(o for o in overrides if not o.startswith("-"))]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_hydra_run_writes_its_record_beside_the_artifacts(tmp_path, tiny_target_dir):
    """``python extract.py output_dir=f``: Hydra's record and log land in f, nothing else in the cwd."""
    _extract(tmp_path, tiny_target_dir, "sampling.max_new_tokens=4", "output_dir=f")
    out = tmp_path / "f"
    assert (out / "manifest.json").is_file() and (out / ".hydra" / "config.yaml").is_file()
    assert OmegaConf.load(out / ".hydra" / "config.yaml").output_dir == "f"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "chats.jsonl", "f"]


def test_a_multirun_gives_each_job_its_own_folder(tmp_path, tiny_target_dir):
    _extract(tmp_path, tiny_target_dir, "-m", "sampling.max_new_tokens=2,3", "output_dir=sweep")
    for n, new_tokens in ((0, 2), (1, 3)):
        job = tmp_path / "sweep" / str(n)
        cfg = OmegaConf.load(job / ".hydra" / "config.yaml")
        assert cfg.sampling.max_new_tokens == new_tokens and (job / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "chats.jsonl", "sweep"]
