"""scripts/offline_bundle.py: the dependency closure it packs, the parts it cuts, the target folders it carries."""

from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bundle():
    spec = importlib.util.spec_from_file_location("offline_bundle", ROOT / "scripts" / "offline_bundle.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_closure_follows_requirements_and_stops_at_what_the_host_has():
    # hydra-core 1.3.8 needs omegaconf and antlr4-python3-runtime (and packaging); omegaconf needs
    # antlr4 and PyYAML; importlib-resources only below Python 3.9 (a false marker here)
    got = _bundle().closure(["hydra-core==1.3.8"], have={"packaging", "pyyaml"})
    assert got == {n: metadata.version(n) for n in ("hydra-core", "omegaconf", "antlr4-python3-runtime")}
    # what the host has is neither packed nor followed
    assert _bundle().closure(["hydra-core"], have={"packaging", "pyyaml", "omegaconf"}) == {
        n: metadata.version(n) for n in ("hydra-core", "antlr4-python3-runtime")}


def test_parts_join_to_the_original_bytes(tmp_path):
    mod = _bundle()
    src = tmp_path / "x.whl"
    data = bytes(range(256)) * 41  # 10,496 bytes
    src.write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    parts = mod.write_parts(src, out, 4096)
    assert [p.name for p in parts] == ["x.whl.part000", "x.whl.part001", "x.whl.part002"]
    assert [p.stat().st_size for p in parts] == [4096, 4096, 10496 - 8192]
    assert b"".join(p.read_bytes() for p in parts) == data
    (whole,) = mod.write_parts(src, tmp_path / "out", len(data))  # fits: copied whole
    assert whole.name == "x.whl" and whole.read_bytes() == data
    import hashlib

    assert mod.sha256(whole) == hashlib.sha256(data).hexdigest()


def test_settings_that_would_break_the_bundle_are_refused_before_any_download(tmp_path, capsys):
    import pytest

    mod = _bundle()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "q.jsonl").write_text("1")
    (tmp_path / "b" / "q.jsonl").write_text("2")
    out = tmp_path / "bundle"
    cases = [(["--part-mb", "0"], "parts must be at least 1 MiB"),
             (["--add", str(tmp_path / "missing")], "not a file"),
             (["--add", str(tmp_path / "a" / "q.jsonl"), str(tmp_path / "b" / "q.jsonl")], "a second file named q.jsonl"),
             (["--with", "no-such-distribution"], "not installed here"),
             (["--have", " ".join(mod.closure([r for r in metadata.requires("eagle3") if "extra ==" not in r], set())),
               "--with", ""], "nothing to pack")]
    for args, message in cases:
        with pytest.raises(SystemExit) as e:
            mod.main(["--out", str(out), *args])
        assert e.value.code == 2 and message in capsys.readouterr().err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # nothing written
    out.mkdir()
    with pytest.raises(SystemExit) as e:
        mod.main(["--out", str(out)])
    assert e.value.code == 2 and "exists" in capsys.readouterr().err


def _tiny_wheel(folder: Path) -> Path:
    """A real, installable pure-Python wheel (``tiny`` 0.1) written by hand."""
    import zipfile

    whl = folder / "tiny-0.1-py3-none-any.whl"
    files = {"tiny/__init__.py": "VALUE = 41 + 1\n",
             "tiny-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: tiny\nVersion: 0.1\n",
             "tiny-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in files) + "tiny-0.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(whl, "w") as z:
        for name, text in {**files, "tiny-0.1.dist-info/RECORD": record}.items():
            z.writestr(name, text)
    return whl


def test_a_packed_target_folder_is_unpacked_whole_beside_the_wheels(tmp_path, monkeypatch, capsys):
    """--target packs a built target folder, cut into parts like the wheels; unpack.sh joins
    it into <models dir>/<name> (byte for byte), installs the wheels, and leaves a target that
    is already there as it is."""
    import os
    import subprocess

    import pytest

    mod = _bundle()
    monkeypatch.setattr(mod, "closure", lambda roots, have: {"tiny": "0.1"})
    monkeypatch.setattr(mod, "fetch_wheels", lambda pins, staging, *a: _tiny_wheel(staging))
    target = tmp_path / "models-here" / "Tiny-w4a16"
    target.mkdir(parents=True)
    weights = os.urandom(int(2.5 * 2**20))
    (target / "model.safetensors").write_bytes(weights)
    (target / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(SystemExit) as e:  # a folder that is no built target is refused first
        mod.main(["--out", str(tmp_path / "b0"), "--target", str(tmp_path / "models-here")])
    assert e.value.code == 2 and "not a built target folder" in capsys.readouterr().err
    out = tmp_path / "bundle"
    mod.main(["--out", str(out), "--target", str(target), "--with", "", "--part-mb", "1"])
    parts = sorted(p.name for p in (out / "targets" / "Tiny-w4a16").iterdir())
    assert parts == ["config.json", "model.safetensors.part000", "model.safetensors.part001",
                     "model.safetensors.part002"]
    models, site = tmp_path / "host" / "data" / "models", tmp_path / "site"
    r = subprocess.run(["bash", str(out / "unpack.sh"), str(site), str(models)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (models / "Tiny-w4a16" / "model.safetensors").read_bytes() == weights
    assert (models / "Tiny-w4a16" / "config.json").read_text() == '{"model_type": "llama"}'
    assert sorted(p.name for p in models.iterdir()) == ["Tiny-w4a16"]  # no .partial left
    v = subprocess.run(["python3", "-c", "import tiny; print(tiny.VALUE)"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(site)})
    assert v.stdout.strip() == "42"
    (models / "Tiny-w4a16" / "config.json").write_text("mine")
    r = subprocess.run(["bash", str(out / "unpack.sh"), str(site), str(models)], capture_output=True, text=True)
    assert r.returncode == 0 and "exists; left as it is" in r.stderr
    assert (models / "Tiny-w4a16" / "config.json").read_text() == "mine"
    # a part that does not match its sum stops the unpack before anything is installed or placed
    (out / "targets" / "Tiny-w4a16" / "model.safetensors.part001").write_bytes(b"x")
    r = subprocess.run(["bash", str(out / "unpack.sh"), str(tmp_path / "site2"), str(tmp_path / "m2")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "part001" in r.stdout + r.stderr
    assert not (tmp_path / "site2").exists() and not (tmp_path / "m2").exists()
