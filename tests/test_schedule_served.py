"""mode=schedule's sweep and report on hand-built runs and fake servers (no real server: the real
vLLM check is tests/test_vllm_live_schedule.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from eagle3.engines.vllm import Completion, SpecCounters
from eagle3.evaluate.schedule_report import (SCHEDULE_JSON, SCHEDULE_PLOT, SCHEDULE_REPORT, SGLANG_CONFIG, schedule_results,
                                             compare, measured_crossover, table, write_schedule_report)
from eagle3.evaluate.vllm.measure import SweepRun
from eagle3.evaluate.vllm.schedule import points, role_steps, sweep
from eagle3.schedule.bands import bands
from eagle3.schedule.derive import derive


def _run(tokens, seconds, counters=None, n=4):
    """``n`` completions sharing ``tokens``, TTFT 0.1 s, latency 0.1 + 0.01 * (tokens - 1) s each."""
    per = tokens // n
    done = [Completion(list(range(per)), 0.1, 0.1 + 0.01 * (per - 1), "length", {"completion_tokens": per})
            for _ in range(n)]
    return SweepRun(done, seconds, counters)


def _records():
    """Two rounds; c=1: chain-3 twice off's throughput, c=8: off fastest; the check phase adds the schedule."""
    recs = []
    c3 = SpecCounters(40.0, 120.0, 60.0, [30.0, 20.0, 10.0], True)  # tau 2.5, per position .75 .5 .25
    c1 = SpecCounters(60.0, 60.0, 45.0, [45.0], True)  # tau 1.75
    spec = {1: {"off": (100, 10.0), "chain-3": (100, 5.0), "chain-1": (100, 6.0), "schedule": (100, 4.9)},
            8: {"off": (800, 10.0), "chain-3": (800, 16.0), "chain-1": (800, 12.0), "schedule": (800, 10.1)}}
    for phase in ("derive", "check"):
        for r in range(2):
            for c, by in spec.items():
                for role, (tok, sec) in by.items():
                    if role == "schedule" and phase == "derive":
                        continue
                    cnt = {"chain-3": c3, "chain-1": c1, "schedule": c3}.get(role)
                    recs.append({"phase": phase, "round": r, "concurrency": c, "role": role, "order": 0,
                                 "run": _run(tok, sec, cnt)})
    return recs


def test_points_pool_rounds_and_read_the_counters():
    pts = {(p.concurrency, p.num_steps): p for p in points([r for r in _records() if r["phase"] == "derive"])}
    assert pts[(1, 0)].tokens_per_s == pytest.approx(10.0) and pts[(1, 0)].tau == 1.0
    assert pts[(1, 3)].tokens_per_s == pytest.approx(20.0)
    assert pts[(1, 3)].tau == pytest.approx(2.5) and pts[(1, 3)].per_position == pytest.approx((0.75, 0.5, 0.25))
    assert pts[(8, 1)].tau == pytest.approx(1.75) and pts[(8, 1)].per_position == pytest.approx((0.75,))
    assert [ch.num_steps for ch in derive(list(pts.values()))] == [3, 0]
    assert role_steps("off") == 0 and role_steps("chain-5") == 5 and role_steps("schedule") is None


def test_table_comparison_and_crossover():
    tab = table(_records(), "check")
    cell = tab[1]["chain-3"]
    assert cell["tokens_per_s"] == pytest.approx(20.0) and cell["per_round"] == pytest.approx([20.0, 20.0])
    assert cell["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert cell["itl_ms"]["p50"] == pytest.approx(10.0)  # (latency - TTFT) / (tokens - 1)
    assert cell["matches_off"] == [8, 8]  # 2 rounds x 4 answers, all range(25) like off's
    rows = {r["concurrency"]: r for r in compare(tab)}
    assert rows[1]["best_static"] == "chain-3" and rows[1]["vs_best"] == pytest.approx(5.0 / 4.9)
    assert rows[1]["vs_off"] == pytest.approx(10.0 / 4.9) and rows[1]["meets_vs_off"] is True
    assert rows[8]["best_static"] == "off" and rows[8]["vs_best"] == pytest.approx(10.0 / 10.1)
    assert rows[8]["meets_vs_best"] is True and rows[8]["meets_vs_off"] is None  # 0.990 >= 0.97
    assert rows[1]["vs_best_ci95"] == pytest.approx([5.0 / 4.9] * 2)  # identical rounds: a point interval
    assert measured_crossover(tab) == 8


def test_report_files_and_deployment_notes(tmp_path):
    recs = _records()
    choices = derive(points([r for r in recs if r["phase"] == "derive"]))
    sched = bands(choices, 16)
    cfg = SimpleNamespace(engine=SimpleNamespace(max_num_seqs=16), seed=0,
                          schedule=SimpleNamespace(rounds=2, chains=[3, 1]))
    desc = {r: {"effective": {"max_num_seqs": 16}} for r in ("off", "chain-3", "chain-1", "schedule")}
    res = schedule_results(cfg, recs, choices, sched, desc, [], "/d", "/m", 6)
    assert res["schedule"] == [[1, 2, 3], [3, 16, 0]] and res["off_above"] == 2
    assert res["vllm_speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 2, 3], [3, 16, 0]]
    assert res["meets_bars"] is True
    export = tmp_path / "export"
    export.mkdir()
    write_schedule_report(tmp_path / "out", res, str(export))
    for name in (SCHEDULE_JSON, SCHEDULE_REPORT, SCHEDULE_PLOT, SGLANG_CONFIG):
        assert (tmp_path / "out" / name).stat().st_size > 0
    md = (tmp_path / "out" / SCHEDULE_REPORT).read_text()
    assert res["vllm_serve_command"] in md and "| 1-2 | 3 |" in md and "met both bars" in md
    assert json.loads((tmp_path / "out" / SGLANG_CONFIG).read_text()) == {"1": {"candidate_steps": [3]},
                                                                           "3": {"candidate_steps": [0]}}
    notes = json.loads((export / "deployment_schedule.json").read_text())
    assert notes["schedule"] == res["schedule"] and (export / "deployment_schedule.md").read_text() == md


class _FakeClient:
    """Answers every completion with 4 tokens; counts its calls in order on a shared log."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def reset_prefix_cache(self):
        self.log.append(self.name)

    def complete(self, body):
        return Completion([1, 2, 3, 4], 0.01, 0.02, "length", {"completion_tokens": 4})

    def metrics_text(self):
        return ""


def test_sweep_rotates_the_order_and_cycles_prompts():
    log: list[str] = []
    clients = {r: _FakeClient(r, log) for r in ("off", "chain-3", "chain-1")}
    recs = sweep({"off": clients["off"]}, {}, [[1], [2]], [1, 4], 1, "derive")
    assert [len(r["run"].completions) for r in recs] == [2, 4]  # 2 prompts cycled to concurrency 4
    log.clear()
    recs = sweep(clients, {}, [[1], [2]], [1, 2], 2, "derive")
    assert log[:3] == ["off", "chain-3", "chain-1"] and log[3:6] == ["chain-3", "chain-1", "off"]
    assert log[6:9] == ["chain-1", "off", "chain-3"]
    assert len(recs) == 12 and {r["round"] for r in recs} == {0, 1}
