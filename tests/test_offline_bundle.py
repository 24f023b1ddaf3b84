"""scripts/offline_bundle.py: the dependency closure it packs and the parts it cuts."""

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
