"""The entry points' command-line check: an unknown config choice is one line and exit code 2, before Hydra runs."""

import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.cli import config_groups, unknown_group_choice

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def test_each_entry_point_checks_the_groups_of_its_own_config():
    assert sorted(config_groups(CONF, "extract")) == ["data", "engine", "experiment", "model"]
    assert sorted(config_groups(CONF, "train")) == ["data", "drafter", "experiment", "model", "optim"]
    assert sorted(config_groups(CONF, "evaluate")) == ["engine", "model"]


def test_unknown_choices_are_named_and_known_ones_pass():
    groups = config_groups(CONF, "train")
    assert unknown_group_choice(["model=smollm2-135m-bf16", "drafter=ttt3", "optim.lr=1e-4"], CONF, groups) is None
    assert unknown_group_choice(["+drafter=nope"], CONF, groups) == (
        "drafter 'nope' is unknown; available drafter configs: eagle3, ttt3")
    assert "model 'x'" in unknown_group_choice(["--multirun", "model=smollm2-135m-bf16,x"], CONF, groups)
    assert unknown_group_choice(["engine=nope"], CONF, groups) is None  # not a group of train.yaml: Hydra's to report


@pytest.mark.parametrize(
    "script, override, names",
    [
        ("extract.py", "model=nope", ["smollm2-135m-int4", "smollm2-135m-bf16", "kimi-k25-int4"]),
        ("train.py", "drafter=nope", ["eagle3", "ttt3"]),
        ("evaluate.py", "model=nope", ["smollm2-135m-int4", "smollm2-135m-bf16", "kimi-k25-int4"]),
        ("evaluate.py", "engine=nope", ["hf", "sglang"]),
    ],
)
def test_an_unknown_choice_is_one_line_and_exit_code_2(script, override, names):
    r = subprocess.run([sys.executable, script, override], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    group = override.split("=")[0]
    assert err.startswith(f"error: {group} 'nope' is unknown; available {group} configs: ")
    for name in names:
        assert name in err
