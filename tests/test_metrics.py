"""Acceptance measures, diversity and verdicts (hand-computed cases)."""

import pytest

from eagle3.evaluate.metrics import (
    acceptance_summary,
    accept_histogram,
    conditional_acceptance,
    distinct_n,
    diversity,
    is_loop,
    longest_loop,
    per_position_acceptance,
    verdict,
)


def test_acceptance_summary_hand_case():
    # 4 passes with num_steps=3 accepting 3, 0, 1, 3 drafts -> emitted 4+1+2+4 = 11
    s = acceptance_summary(verify_passes=4, emitted=11, accept_counts=[3, 0, 1, 3], num_steps=3)
    assert s["acceptance_length"] == 11 / 4
    assert s["acceptance_rate"] == 7 / 12
    assert s["accept_histogram"] == [1, 1, 0, 2]
    # position 1 accepted in 3 of 4 passes, position 2 in 2, position 3 in 2
    assert s["per_position_acceptance"] == [0.75, 0.5, 0.5]
    assert s["conditional_acceptance"] == [0.75, 2 / 3, 1.0]
    assert s["proposed_drafts"] == 12 and s["accepted_drafts"] == 7


def test_empty_and_invalid():
    s = acceptance_summary(0, 0, [], 3)
    assert s["acceptance_length"] is None and s["per_position_acceptance"] == []
    with pytest.raises(ValueError):
        accept_histogram([4], 3)
    assert per_position_acceptance([0, 0]) == []
    assert conditional_acceptance([2, 0, 0]) == [0.0, None]


def test_distinct_n():
    assert distinct_n([1, 2, 1, 2], 1) == 0.5
    assert distinct_n([1, 2, 1, 2], 2) == 2 / 3  # (1,2) (2,1) (1,2)
    assert distinct_n([1], 2) is None


def test_longest_loop():
    assert longest_loop([1, 2, 3, 4, 5]) == (0, 0)
    assert longest_loop([7, 7]) == (2, 1)
    # prefix, then "5 6 7" three times, then a tail
    assert longest_loop([1, 2, 5, 6, 7, 5, 6, 7, 5, 6, 7, 9]) == (9, 3)
    # a pattern seen twice but not adjacent is no loop
    assert longest_loop([1, 2, 3, 9, 1, 2, 3]) == (0, 0)
    # a partial third repeat counts in the span
    assert longest_loop([4, 1, 2, 1, 2, 1]) == (5, 2)
    assert longest_loop([3] * 10, max_period=4) == (10, 1)


def test_diversity_flags_loops():
    loop = [1, 2, 3, 4] * 12  # 48 tokens, all looping
    fresh = list(range(100, 148))
    d = diversity([loop, fresh, fresh, fresh])
    assert is_loop(loop, 48) and not is_loop(fresh, 0)
    assert d["looping_outputs"] == 1 and d["loop_fraction"] == 0.25 and d["loops"] is True
    assert d["longest_loop_max"] == 48
    assert d["distinct_1"] == pytest.approx((4 / 48 + 3) / 4)
    assert diversity([fresh] * 5)["loops"] is False


def test_verdicts():
    ok = {"acceptance_length": 2.8, "speedup": 1.6, "diversity": {"loops": False}, "lossless_matches": 5,
          "lossless_checked": 5}
    assert verdict(ok) == ("OK", [])
    v, notes = verdict({"acceptance_length": 1.02, "speedup": 0.7})
    assert v == "accepts-nothing, slower"
    assert "aux layer ids" in notes[0] and "costs more than it saves" in notes[1]
    v, notes = verdict({**ok, "diversity": {"loops": True, "looping_outputs": 3, "longest_loop_max": 90},
                        "acceptance_length_non_looping": 2.1})
    assert v == "loops" and "2.10" in notes[0]
    v, notes = verdict({**ok, "lossless_matches": 4})
    assert v == "not-lossless" and "a bug" in notes[0]
    v, notes = verdict({**ok, "lossless_matches": 3, "lossless_near_ties": 2})
    assert v == "OK" and "tie within rounding" in notes[0]
    assert verdict({**ok, "lossless_matches": 3, "lossless_near_ties": 1})[0] == "not-lossless"
    served = {**ok, "concurrency": [{"concurrency": 1, "speedup": 1.5}, {"concurrency": 128, "speedup": 0.4}]}
    v, notes = verdict(served, spec_cap=48)
    assert v == "throttled" and "48" in notes[0]
    # gains at low load, losses at high load under a cap that was not reached: the device, not the server
    v, notes = verdict({**ok, "concurrency": [{"concurrency": 1, "speedup": 1.3}, {"concurrency": 4, "speedup": 0.9}]},
                       spec_cap=256)
    assert v == "compute-bound" and "[4]" in notes[0] and "256" in notes[0] and "not a throttled server" in notes[0]
    v, notes = verdict({**ok, "concurrency": [{"concurrency": 1, "speedup": 1.3}, {"concurrency": 4, "speedup": 0.9}]})
    assert v == "throttled" and "unknown" in notes[0]
    # a bad drafter is not called throttled
    assert "throttled" not in verdict({**served, "acceptance_length": 1.0}, spec_cap=48)[0]
    assert verdict({"acceptance_length": float("nan")})[0] == "OK"


def test_verdict_calls_a_speed_up_above_tau_timing_noise_and_an_interval_across_one_no_speedup():
    # tau 1.03 with a measured 1.5x: impossible (a round emits tau tokens and costs >= one target step)
    v, notes = verdict({"acceptance_length": 1.03, "speedup": 1.5, "speedup_interval": [1.3, 1.7]})
    assert v == "accepts-nothing, timing-noise"
    assert "exceeds tau 1.03" in notes[1]
    # below 1 but the interval reaches above 1: not called slower, and said so
    v, notes = verdict({"acceptance_length": 2.5, "speedup": 0.95, "speedup_interval": [0.85, 1.04]})
    assert v == "no-speedup" and "contains 1.0" in notes[0]
    # above 1 with the interval reaching below 1: no gain claimed either
    v, notes = verdict({"acceptance_length": 1.18, "speedup": 1.02, "speedup_interval": [0.96, 1.08]})
    assert v == "no-speedup" and "[0.96, 1.08]" in notes[0]
    # an interval that ends at 1.0 contains it (the README's CPU run: 0.96 [0.92, 1.00])
    assert verdict({"acceptance_length": 1.18, "speedup": 0.96, "speedup_interval": [0.92, 1.0]})[0] == "no-speedup"
    assert verdict({"acceptance_length": 2.5, "speedup": 0.9, "speedup_interval": [0.85, 0.96]})[0] == "slower"
    assert verdict({"acceptance_length": 2.5, "speedup": 2.4})[0] == "OK"  # below tau: possible


def test_verdict_treats_a_failed_timing_as_not_measured_and_counts_ties_among_mismatches():
    nan = float("nan")
    v, notes = verdict({"acceptance_length": 2.0, "speedup": nan})
    assert v == "no-speedup" and "not a number" in notes[0]
    # an interval that is not two finite numbers is no interval: the point estimate decides
    assert verdict({"acceptance_length": 2.0, "speedup": 1.3, "speedup_interval": [nan, nan]})[0] == "OK"
    assert verdict({"acceptance_length": 2.0, "speedup": 0.8, "speedup_interval": [0.7]})[0] == "slower"
    # more ties than mismatches cannot be: 2 prompts differ, both at ties, not 5
    v, notes = verdict({"lossless_matches": 8, "lossless_checked": 10, "lossless_near_ties": 5})
    assert v == "OK" and "the other 2 first differ" in notes[0]


def test_in_process_speed_up_interval_is_the_bootstrap_over_prompts():
    import numpy as np

    from eagle3.evaluate.inprocess.records import TurnRecord, summarize_benchmark
    from eagle3.spec import SpecSettings

    s, _ = SpecSettings.make(3, 1, 4, max_new_tokens=8)
    # prompt i: baseline 8 tokens in 1 s; speculative 8 tokens in t_i s (two turns of prompt "a" pooled)
    spec_s = {"a": [0.25, 0.25], "b": [0.5], "c": [1.0], "d": [0.4]}
    recs = [TurnRecord("x", sid, t, 5, [1] * 8, [1] * 8, sec, 1.0, 0.0, 0.0, 4, 8, [1, 1, 1, 1])
            for sid, secs in spec_s.items() for t, sec in enumerate(secs)]
    out = summarize_benchmark(recs, s)
    rows = np.array([[16, 2, 16, 0.5], [8, 1, 8, 0.5], [8, 1, 8, 1.0], [8, 1, 8, 0.4]])
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 4, size=(2000, 4))
    t = rows[idx].sum(axis=1)
    want = np.quantile((t[:, 2] / t[:, 3]) / (t[:, 0] / t[:, 1]), [0.025, 0.975])
    assert out["speedup"] == pytest.approx((40 / 2.4) / (40 / 5))
    assert out["speedup_interval"] == pytest.approx(list(want))
