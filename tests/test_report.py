"""report.json / report.md / PNGs / metrics.json / console table."""

import json

from eagle3.evaluate.report import headline, write_report

KEYS = {"acceptance_length", "acceptance_rate", "verify_passes", "generated_tokens", "per_position_acceptance",
        "tokens_per_s_spec", "tokens_per_s_base", "speedup", "lossless_matches", "diversity",
        "verdict", "num_prompts", "settings"}


def bench(tau, speedup, pp, loops=False, n=10):
    return {
        "num_prompts": n, "acceptance_length": tau, "acceptance_rate": (tau - 1) / 3, "verify_passes": 100,
        "generated_tokens": 100, "per_position_acceptance": pp,
        "tokens_per_s_spec": 50.0 * speedup if speedup is not None else None,
        "tokens_per_s_base": 50.0, "speedup": speedup, "lossless_matches": n, "lossless_checked": n,
        "diversity": {"distinct_1": 0.6, "distinct_2": 0.8, "longest_loop_mean": 3.0, "longest_loop_max": 40,
                      "looping_outputs": 3 if loops else 0, "loop_fraction": 0.3 if loops else 0.0, "loops": loops},
    }


def hf_results():
    return {
        "engine": "hf",
        "benchmarks": {
            "gsm8k": bench(2.9, 1.7, [0.8, 0.6, 0.5]),
            "humaneval": bench(1.02, 0.6, [0.02, 0.0, 0.0]),
            "sharegpt": bench(3.4, 2.0, [0.9, 0.8, 0.7], loops=True),
        },
        "speculative": {"num_steps": 3, "topk": 1, "num_draft_tokens": 4},
        "sampling": {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 128},
        "settings": {"target": "t", "device": "cpu"},
        "warnings": ["drafter trained on features of a different target/quantization"],
    }


def test_write_report_hf(tmp_path, capsys):
    write_report(tmp_path, hf_results())
    rep = json.loads((tmp_path / "report.json").read_text())
    for name, b in rep["benchmarks"].items():
        assert KEYS <= set(b), name
        assert b["settings"]["num_steps"] == 3 and b["settings"]["temperature"] == 0.0
    assert rep["benchmarks"]["gsm8k"]["verdict"] == "OK"
    assert rep["benchmarks"]["humaneval"]["verdict"] == "accepts-nothing, slower"
    assert rep["benchmarks"]["sharegpt"]["verdict"] == "loops"
    for png in ("per_position_acceptance.png", "acceptance_length.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "report.md").read_text()
    assert "| gsm8k | 10 | 2.90 |" in md and "accepts nothing" in md and "different target" in md
    assert "![per_position_acceptance](per_position_acceptance.png)" in md
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert abs(m["tau mean"] - (2.9 + 1.02 + 3.4) / 3) < 1e-12
    assert m["tau gsm8k"] == 2.9 and m["lossless"] == "30/30" and m["steps/topk/draft"] == "3/1/4"
    out = capsys.readouterr().out
    assert "gsm8k" in out and "2.90" in out and "accepts-nothing, slower" in out
    assert "warning: drafter trained" in out


def test_nan_becomes_null_and_sglang_tables(tmp_path):
    res = {
        "engine": "sglang",
        "benchmarks": {"gsm8k": {**bench(2.6, 1.4, [0.7, 0.5, 0.4]), "num_prompts": None, "prompts": 7,
                                 "lossless_matches": None,
                                 "concurrency": [
                                     {"concurrency": 1, "speedup": 1.4, "baseline": {"output_tokens_per_s": 60.0},
                                      "speculative": {"output_tokens_per_s": 84.0, "acceptance_length": 2.6}},
                                     {"concurrency": 128, "speedup": 0.4, "baseline": {"output_tokens_per_s": 2370.0},
                                      "speculative": {"output_tokens_per_s": 849.0, "acceptance_length": 2.6}}]},
                       "mtbench": {**bench(float("nan"), None, []), "lossless_matches": None}},
        "speculative": {"num_steps": 3, "topk": 1, "num_draft_tokens": 4},
        "sampling": {"temperature": 0.0},
        "servers": {"speculative": {"effective": {"effective_max_running_requests": 48}}},
        "warnings": [],
    }
    res["benchmarks"]["gsm8k"].pop("num_prompts")
    write_report(tmp_path, res)
    rep = json.loads((tmp_path / "report.json").read_text())
    g = rep["benchmarks"]["gsm8k"]
    assert g["num_prompts"] == 7 and g["max_running_requests"] == 48 and g["verdict"] == "throttled"
    assert rep["benchmarks"]["mtbench"]["acceptance_length"] is None
    md = (tmp_path / "report.md").read_text()
    assert "Throughput versus concurrency" in md and "| 128 | 2370.0 | 849.0 | 0.40 | 2.60 |" in md
    assert headline(res)["speedup mean"] == 1.4
