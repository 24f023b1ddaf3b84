"""The entry points' command-line checks: an unknown config choice or key, an output_dir that is a file: one line and exit code 2, before Hydra runs."""

import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.cli import config_groups, unknown_group_choice

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def test_each_entry_point_checks_the_groups_of_its_own_config():
    assert sorted(config_groups(CONF, "extract")) == ["data", "engine", "experiment", "features", "model"]
    assert sorted(config_groups(CONF, "train")) == ["data", "drafter", "engine", "experiment", "features", "model",
                                                    "optim"]
    assert sorted(config_groups(CONF, "evaluate")) == ["data", "engine", "model"]  # data=jsonl: a prompt file


def test_unknown_choices_are_named_and_known_ones_pass():
    groups = config_groups(CONF, "train")
    assert unknown_group_choice(["model=smollm2-135m-bf16", "drafter=ttt3", "optim.lr=1e-4"], CONF, groups) is None
    assert unknown_group_choice(["+drafter=nope"], CONF, groups) == (
        "drafter 'nope' is unknown; available drafter configs: eagle3, ttt3")
    assert "model 'x'" in unknown_group_choice(["--multirun", "model=smollm2-135m-bf16,x"], CONF, groups)
    assert unknown_group_choice(["engine=nope"], CONF, groups) == (  # the capture engine of features=online
        "engine 'nope' is unknown; available engine configs: hf, remote, sglang, vllm")
    assert unknown_group_choice(["features=nope"], CONF, groups) == (
        "features 'nope' is unknown; available features configs: none, offline, online")
    assert unknown_group_choice(["hydra/launcher=nope"], CONF, groups) is None  # not a group of train.yaml: Hydra's


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


def _compose(stage, overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=stage, overrides=overrides)


def test_a_key_the_schema_lacks_is_refused_with_the_nearest_setting():
    from eagle3.cli import to_typed, unknown_keys
    from eagle3.errors import Eagle3Error

    cfg = _compose("train", ["+loop.max_step=5", "+nosuchkey=1"])
    assert [k for k, _ in unknown_keys(cfg)] == ["loop.max_step", "nosuchkey"]
    with pytest.raises(Eagle3Error, match=r"^'loop.max_step' is not a setting of this stage .*did you mean loop.max_steps\?$"):
        to_typed(cfg)
    with pytest.raises(Eagle3Error, match="'nosuchkey' is not a setting .*the settings there are model, data, engine, features, drafter"):
        to_typed(_compose("train", ["+nosuchkey=1"]))
    with pytest.raises(Eagle3Error, match="'engine.extra_args' is not a setting .*the settings there are name, device"):
        to_typed(_compose("train", ["+engine.extra_args=[--x]"]))  # engine=hf (features=online's) has no extra_args
    # '+' on a list the schema has is a value, not a key; free-form dicts are not checked
    typed = to_typed(_compose("evaluate", ["engine=sglang", "+engine.extra_args=[--x]"]))
    assert typed.engine.extra_args == ["--x"] and unknown_keys(_compose("evaluate", [])) == []
    for stage in ("extract", "train", "evaluate"):
        assert unknown_keys(_compose(stage, [])) == [], stage


def test_a_misspelt_plus_override_is_one_line_and_exit_code_2():
    r = subprocess.run([sys.executable, "train.py", "+loop.max_step=5"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr == ("error: 'loop.max_step' is not a setting of this stage (a '+' override adds keys nothing "
                        "reads); did you mean loop.max_steps?\n")


def _leaf_keys(node, prefix=""):
    from omegaconf import DictConfig

    for k in node.keys():
        child = node._get_node(k)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            yield from _leaf_keys(child, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


@pytest.mark.parametrize("stage", ["extract", "train", "evaluate"])
def test_a_plain_override_of_a_key_the_schema_lacks_is_named_before_hydra_runs(stage):
    """Every key of the composed config passes (no false refusal, engine keys and groups
    included); a misspelt one is named with the nearest setting, at any depth."""
    from eagle3.cli import unknown_override_key
    from eagle3.config import EvaluateConfig, ExtractConfig, TrainConfig

    schema = {"extract": ExtractConfig, "train": TrainConfig, "evaluate": EvaluateConfig}[stage]
    groups = config_groups(CONF, stage)
    keys = list(_leaf_keys(_compose(stage, [])))
    assert len(keys) > 20
    assert unknown_override_key([f"{k}=1" for k in keys] + [f"{g}=x" for g in groups], schema, groups) is None
    assert unknown_override_key(["+loop.max_step=5", "~x", "hydra/job_logging=disabled", "hydra.verbose=true",
                                 "-m", "--cfg"], schema, groups) is None
    engine = unknown_override_key(["engine.max_batch_token=1"], schema, groups)  # along the schema of the engine chosen
    assert engine == "'engine.max_batch_token' is not a setting of engine=hf; did you mean engine.max_batch_tokens?"
    if True:  # every stage now chooses an engine (train.py: the capture engine of features=online)
        for name in ("hf", "sglang", "vllm"):  # every key of each engine's composed config passes with that engine
            keys = [k for k in _leaf_keys(_compose(stage, [f"engine={name}"])) if k.startswith("engine.")]
            assert len(keys) > 5
            assert unknown_override_key([f"engine={name}"] + [f"{k}=1" for k in keys], schema, groups) is None
        assert unknown_override_key(["engine=vllm", "engine.pythn=/x"], schema, groups) == (
            "'engine.pythn' is not a setting of engine=vllm; did you mean engine.python?")
        assert unknown_override_key(["engine=tgi", "engine.x=1"], schema, groups) is None  # Hydra names the engine
    assert unknown_override_key(["data.limt=3"], schema, groups) == (
        "'data.limt' is not a setting of this stage; did you mean data.limit?")
    assert unknown_override_key(["seed=1", "sead=2"], schema, groups) == (
        "'sead' is not a setting of this stage; did you mean seed?")
    assert unknown_override_key(["zzz=1"], schema, groups).startswith(
        "'zzz' is not a setting of this stage; the settings there are model, ")


@pytest.mark.parametrize("stage", ["extract", "evaluate"])
def test_engine_keys_are_checked_along_the_engine_the_chosen_model_selects(stage):
    """conf/model/kimi-k25-int4.yaml selects engine=sglang: ``python extract.py model=kimi-k25-int4
    engine.url=...`` (docs/sglang.md) composes, so the check before Hydra must pass it too."""
    from eagle3.cli import unknown_override_key
    from eagle3.config import EvaluateConfig, ExtractConfig

    schema = {"extract": ExtractConfig, "evaluate": EvaluateConfig}[stage]
    groups = config_groups(CONF, stage)
    url = "engine.baseline_url=http://h:1" if stage == "evaluate" else "engine.url=http://h:1"
    assert _compose(stage, ["model=kimi-k25-int4", url]).engine.name == "sglang"
    assert unknown_override_key(["model=kimi-k25-int4", url], schema, groups, CONF) is None
    assert unknown_override_key([url], schema, groups, CONF).startswith(  # the default model: the stage's hf
        f"'{url.split('=')[0]}' is not a setting of engine=hf")
    # an engine= on the command line wins over the model's choice
    assert unknown_override_key(["model=kimi-k25-int4", "engine=vllm", "engine.pythn=/x"], schema, groups, CONF) == (
        "'engine.pythn' is not a setting of engine=vllm; did you mean engine.python?")


def test_a_misspelt_plain_override_is_one_line_and_exit_code_2():
    r = subprocess.run([sys.executable, "train.py", "drafter.num_layer=2"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr == "error: 'drafter.num_layer' is not a setting of this stage; did you mean drafter.num_layers?\n"


def test_an_output_dir_override_naming_a_file_is_found(tmp_path):
    from eagle3.cli import output_dir_override_problem

    f = tmp_path / "notes.txt"
    f.write_text("x")
    is_file = f"output_dir={f} is an existing file, not a folder; pass output_dir= a folder path, or move that file away"
    for ov in (f"output_dir={f}", f"+output_dir={f}", f"++output_dir='{f}'", f'output_dir="{f}"'):
        assert output_dir_override_problem(["data.limit=2", ov]) == is_file, ov
    assert output_dir_override_problem(["-m", f"output_dir={tmp_path / 'a'},{f}"]) == is_file
    assert output_dir_override_problem([f"output_dir={f}/sub/run"]) == (
        f"output_dir={f}/sub/run lies inside {f}, which is a file, not a folder; "
        "pass output_dir= a folder path, or move that file away")
    for ok in (f"output_dir={tmp_path}", f"output_dir={tmp_path / 'new' / 'run'}", "output_dir=${oc.env:HOME}/x",
               f"features_dir={f}", "output_dir="):
        assert output_dir_override_problem([ok]) is None, ok


@pytest.mark.parametrize("script", ["extract.py", "train.py", "evaluate.py"])
def test_an_output_dir_that_is_a_file_is_one_line_and_exit_code_2(script, tmp_path):
    f = tmp_path / "results.json"
    f.write_text("{}")
    r = subprocess.run([sys.executable, script, f"output_dir={f}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr == (f"error: output_dir={f} is an existing file, not a folder; pass output_dir= a folder path, "
                        "or move that file away\n")
    assert f.read_text() == "{}"


HOLD_A_SERVER = """
    server = LaunchedServer([sys.executable, "-c", "import time; time.sleep(600)"], out / "server.log", "http://127.0.0.1:9")
    server.start()
    try:
        (out / "pid").write_text(str(server.proc.pid))
        time.sleep(600)
    finally:
        server.stop()
"""
IMPORTS = "import sys, time\nfrom pathlib import Path\nfrom eagle3.engines.sglang.launch import LaunchedServer\n"
# a stage (through run_stage) and a pytest test that each launch a server, then wait
STAGE_WITH_A_SERVER = (IMPORTS + "from omegaconf import OmegaConf\nfrom eagle3.cli import run_stage\n"
                       "out = Path(sys.argv[1])\ndef stage(cfg):" + HOLD_A_SERVER + "run_stage(stage, OmegaConf.create({}))\n")
LIVE_TEST_WITH_A_SERVER = IMPORTS + "def test_holds_a_server():\n    out = Path(OUT)" + HOLD_A_SERVER


def _server_pid(folder: Path, timeout_s: float) -> int:
    """The pid the held server wrote to ``folder/pid`` (waits for it)."""
    import time

    deadline = time.time() + timeout_s
    while not (folder / "pid").exists() and time.time() < deadline:
        time.sleep(0.1)
    return int((folder / "pid").read_text())


def _gone(pid: int, timeout_s: float = 30.0) -> bool:
    """Whether process ``pid`` ends within ``timeout_s``."""
    import os
    import time

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_sigterm_stops_the_servers_a_stage_launched_and_exits_143(tmp_path):
    import os
    import signal

    proc = subprocess.Popen([sys.executable, "-c", STAGE_WITH_A_SERVER, str(tmp_path)], cwd=ROOT, stderr=subprocess.PIPE)
    server_pid = _server_pid(tmp_path, 60)
    os.kill(server_pid, 0)  # the server runs, in its own session (a plain SIGTERM to the stage would miss it)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err.decode()
    assert b"terminated (SIGTERM)" in err
    assert _gone(server_pid), f"the launched server (pid {server_pid}) survived its stage's SIGTERM"


def test_sigterm_to_pytest_stops_the_servers_a_live_test_launched(tmp_path):
    import shutil
    import signal

    d = tmp_path / "t"
    d.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), d / "conftest.py")
    (d / "test_holds.py").write_text(f"OUT = {str(tmp_path)!r}\n" + LIVE_TEST_WITH_A_SERVER)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(d)], cwd=d,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    server_pid = _server_pid(tmp_path, 120)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert _gone(server_pid), f"the server a test launched (pid {server_pid}) survived SIGTERM to pytest"


@pytest.mark.parametrize("stage", ["extract", "train", "evaluate"])
@pytest.mark.parametrize("model", sorted(p.stem for p in (CONF / "model").glob("*.yaml")))
def test_every_stage_composes_with_every_model_file(stage, model):
    """Each conf/model file composes into each stage's typed config (train.py model=kimi-k25-int4
    once failed: its model file selects the engine, which train.yaml listed after the model)."""
    from eagle3.cli import to_typed

    cfg = to_typed(_compose(stage, [f"model={model}"]))
    assert cfg.model.name == model
    want = "sglang" if model.startswith("kimi") else "hf"  # the Kimi model file selects SGLang
    assert cfg.engine.name == want
