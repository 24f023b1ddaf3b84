"""The learning curve of eagle3.sweep.curve: points sorted by samples, gains per doubling by
hand, the PATH:SAMPLES form for old runs, clear errors, a PNG written."""

from __future__ import annotations

import json

import pytest

from eagle3.errors import Eagle3Error
from eagle3.sweep.curve import curve_points, format_curve, gains_per_doubling, main, read_run


def run(samples, acc, tau, train=None):
    m = {"train_samples": samples, "step": 100, "validation": {"step_acc": acc, "replay_tau": tau}}
    if train:
        m["train"] = {"step_acc": train}
    return m


def test_points_are_sorted_and_gains_are_per_doubling():
    pts = curve_points([run(4000, [0.70, 0.6], 2.4), run(1000, [0.50, 0.4], 2.0), run(2000, [0.65, 0.5], 2.3)])
    assert [p["samples"] for p in pts] == [1000, 2000, 4000]
    g = gains_per_doubling(pts)
    # 1000 -> 2000 is one doubling: +0.15 top-1, +0.3 tau; 2000 -> 4000 one more: +0.05, +0.1
    assert g[0]["acc0"] == pytest.approx(0.15) and g[0]["replay_tau"] == pytest.approx(0.3)
    assert g[1]["acc0"] == pytest.approx(0.05) and g[1]["replay_tau"] == pytest.approx(0.1)
    # 1000 -> 4000 directly is two doublings: half the difference per doubling
    g2 = gains_per_doubling([pts[0], pts[2]])
    assert g2[0]["acc0"] == pytest.approx(0.10) and g2[0]["replay_tau"] == pytest.approx(0.2)
    table = format_curve(pts)
    assert "| 1,000 | 100 | 0.500 / 0.400 | 2.000 | - |" in table and "+0.1500" in table


def test_bad_runs_are_refused_with_what_to_pass():
    with pytest.raises(Eagle3Error, match="train_samples"):
        curve_points([{"validation": {"step_acc": [0.5], "replay_tau": 2.0}}])
    with pytest.raises(Eagle3Error, match="distinct subsets"):
        curve_points([run(1000, [0.5], 2.0), run(1000, [0.6], 2.1)])


def test_old_run_takes_its_count_after_a_colon_and_the_plot_is_a_png(tmp_path, capsys):
    old = run(0, [0.74, 0.7], 2.5, train=[0.8, 0.78])
    del old["train_samples"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(run(8000, [0.71, 0.68], 2.4)))
    assert read_run(f"{tmp_path / 'old.json'}:16000")["train_samples"] == 16000
    with pytest.raises(Eagle3Error, match="cannot read"):
        read_run(str(tmp_path / "missing.json"))
    png = tmp_path / "curve.png"
    main([str(tmp_path / "new.json"), f"{tmp_path / 'old.json'}:16000", "--plot", str(png)])
    out = capsys.readouterr().out
    assert "8,000 -> 16,000 samples: per doubling, top-1 (step 0) +0.0300, replay tau +0.1000" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_values_out_of_range_and_mixed_recipes_are_refused_naming_file_and_field(tmp_path):
    bad = [({"train_samples": True}, "train_samples is True"), ({"train_samples": 4106.5}, "not a positive whole"),
           ({"validation": {"step_acc": [float("nan"), 0.5], "replay_tau": 2.0}}, "validation.step_acc is nan"),
           ({"validation": {"step_acc": [1.5, 0.5], "replay_tau": 2.0}}, "not a number in"),
           ({"validation": {"step_acc": "0.6", "replay_tau": 2.0}}, "not a list")]
    for change, match in bad:
        m = {**run(1000, [0.5, 0.4], 2.0), **change}
        m["_source"] = "x.json"
        with pytest.raises(Eagle3Error, match=match) as e:
            curve_points([m, run(2000, [0.6, 0.5], 2.2)])
        assert "x.json" in str(e.value)
    with pytest.raises(Eagle3Error, match="different numbers of TTT steps"):
        curve_points([run(1000, [0.5], 2.0), run(2000, [0.6, 0.5], 2.2)])
    note = format_curve(curve_points([run(1000, [0.5], 2.0), {**run(2000, [0.6], 2.2), "step": 50}]))
    assert "different step counts (100, 50)" in note


def test_the_colon_count_is_checked_and_bad_input_exits_2_with_one_line(tmp_path, capsys):
    from eagle3.cli import run_tool

    (tmp_path / "new.json").write_text(json.dumps(run(8000, [0.71, 0.68], 2.4)))
    new = str(tmp_path / "new.json")
    with pytest.raises(Eagle3Error, match="records train_samples 8000, not 9"):
        read_run(f"{new}:9")
    with pytest.raises(Eagle3Error, match="positive whole number"):
        read_run(f"{new}:-5")
    for argv, match in (([f"{new}:abc"], "positive whole number"), ([new, "--plot", str(tmp_path / "c.txt")], ".png")):
        with pytest.raises(SystemExit) as e:
            run_tool(main, argv)
        assert e.value.code == 2 and match in capsys.readouterr().err


def _job(sweep, name, overrides, metrics):
    d = sweep / name
    d.mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps(metrics))
    (d / "summary.json").write_text(json.dumps({"overrides": overrides, "metrics_path": str(d / "metrics.json"),
                                                "summary": {"tau": metrics["validation"]["replay_tau"]}}))


def test_a_sweep_over_train_fraction_writes_its_learning_curve_and_others_do_not(tmp_path):
    from eagle3.sweep.summary import write_summary

    sweep = tmp_path / "curve"
    _job(sweep, "0", ["loop.train_fraction=0.5"], run(1000, [0.5, 0.4], 2.0))
    _job(sweep, "1", ["loop.train_fraction=1.0"], run(2000, [0.6, 0.5], 2.3))
    write_summary(sweep)
    md = (sweep / "learning_curve.md").read_text()
    assert "1,000 -> 2,000 samples: per doubling, top-1 (step 0) +0.1000, replay tau +0.3000" in md
    assert (sweep / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
    other = tmp_path / "other"
    _job(other, "0", ["drafter.ttt_steps=2"], run(1000, [0.5, 0.4], 2.0))
    _job(other, "1", ["drafter.ttt_steps=3"], run(1000, [0.6, 0.5, 0.4], 2.3))
    write_summary(other)
    assert (other / "summary.md").exists() and not (other / "learning_curve.md").exists()
