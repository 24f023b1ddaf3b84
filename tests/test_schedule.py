"""eagle3.schedule: the per-batch-size schedule from served measurements, by hand-computed cases
and properties (the served check against a real vLLM server is in tests/test_vllm_live_schedule.py)."""

from __future__ import annotations

import json
import random
import shlex

import pytest

from eagle3.schedule.bands import (Band, bands, off_above, sglang_adaptive_config, sglang_serve_command, steps_at,
                                   vllm_serve_command, vllm_speculative_config)
from eagle3.schedule.derive import ChainPoint, crossover, derive, expected_tau, predict

ACC = (0.7, 0.5, 0.3)  # tau(1) = 1.7, tau(2) = 2.2, tau(3) = 2.5


def _points():
    """Three concurrencies, off and chains 1 and 3 at each (tau of each chain as ACC implies)."""
    out = []
    for c, t0, t1, t3 in ((1, 10.0, 15.0, 20.0), (4, 35.0, 45.0, 44.0), (16, 100.0, 95.0, 80.0)):
        out += [ChainPoint(c, 0, t0), ChainPoint(c, 1, t1, 1.7, ACC[:1]), ChainPoint(c, 3, t3, 2.5, ACC)]
    return out


def test_predictions_by_hand():
    # c=1: costs 0.1, 1.7/15, 2.5/20; k=2 interpolates 1.7/15 and 0.125: 2.2 / 0.1191667 = 18.46
    ch = predict(_points(), 1)
    assert ch.predicted[0] == pytest.approx(10.0)
    assert ch.predicted[1] == pytest.approx(15.0)
    assert ch.predicted[2] == pytest.approx(2.2 / ((1.7 / 15 + 2.5 / 20) / 2))
    assert ch.predicted[2] == pytest.approx(18.4615, abs=1e-3)
    assert ch.predicted[3] == pytest.approx(20.0)
    assert ch.num_steps == 3 and ch.tau == pytest.approx({0: 1.0, 1: 1.7, 2: 2.2, 3: 2.5})
    # c=4: the unmeasured k=2 wins: 2.2 / ((1.7/45 + 2.5/44) / 2) = 46.51 > 45 (k=1) > 44 (k=3)
    ch = predict(_points(), 4)
    assert ch.predicted[2] == pytest.approx(46.512, abs=1e-2)
    assert ch.num_steps == 2
    assert predict(_points(), 16).num_steps == 0


def test_prediction_at_a_measured_chain_is_the_measurement():
    rng = random.Random(0)
    for _ in range(50):
        acc = tuple(sorted((rng.random() for _ in range(4)), reverse=True))
        pts = [ChainPoint(8, 0, rng.uniform(10, 100))]
        for k in (1, 2, 4):
            pts.append(ChainPoint(8, k, rng.uniform(10, 100), expected_tau(acc, k), acc[:k]))
        ch = predict(pts, 8)
        for p in pts:
            assert ch.predicted[p.num_steps] == pytest.approx(p.tokens_per_s)
        assert ch.predicted[ch.num_steps] == max(ch.predicted.values())


def test_bands_engine_settings_and_threshold():
    choices = derive(_points())
    assert [c.num_steps for c in choices] == [3, 2, 0]
    assert crossover(choices) == 16
    sched = bands(choices, max_batch=64)  # edges at floor(sqrt(1*4)) = 2 and floor(sqrt(4*16)) = 8
    assert sched == [Band(1, 2, 3), Band(3, 8, 2), Band(9, 64, 0)]
    assert [steps_at(sched, b) for b in (1, 2, 3, 8, 9, 64, 65)] == [3, 3, 2, 2, 0, 0, 0]
    assert off_above(sched) == 8
    spec = vllm_speculative_config("/d", sched)
    assert spec == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3,
                    "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 8, 2], [9, 64, 0]]}
    assert sglang_adaptive_config(sched) == {"1": {"candidate_steps": [3]}, "3": {"candidate_steps": [2]},
                                             "9": {"candidate_steps": [0]}}
    argv = shlex.split(vllm_serve_command("m", "/d", sched, 64))
    assert argv[:6] == ["vllm", "serve", "m", "--max-num-seqs", "64", "--speculative-config"]
    assert json.loads(argv[6]) == spec
    argv = shlex.split(sglang_serve_command("m", "/d", sched, "sched.json", 64))
    assert argv[argv.index("--max-running-requests") + 1] == "64"
    assert argv[argv.index("--speculative-num-steps") + 1] == "3"
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "4"
    assert argv[-2:] == ["--speculative-adaptive-config", "sched.json"]


def test_min_gain_and_never_speculating():
    # at c=4 k=2 predicts 46.5 against off's 35 (x1.33): a margin of 1.4 turns it off
    assert [c.num_steps for c in derive(_points(), min_gain=1.4)] == [3, 0, 0]
    off_only = [ChainPoint(c, 0, 10.0 * c) for c in (1, 2)] + [ChainPoint(c, 3, 5.0, 2.0, (0.5, 0.3, 0.2)) for c in (1, 2)]
    sched = bands(derive(off_only), 32)
    assert sched == [Band(1, 32, 0)] and off_above(sched) == 0
    assert vllm_speculative_config("/d", sched) is None
    assert "--speculative-config" not in vllm_serve_command("m", "/d", sched, 32)
    assert "--speculative-algorithm" not in sglang_serve_command("m", "/d", sched, "f.json", 32)
    always = bands([c for c in derive(_points()) if c.num_steps], 8)
    assert off_above(always) is None


def test_bands_follow_vllms_rules():
    """The rules vLLM's validate_and_normalize_dynamic_sd_schedule enforces, and SGLang's slots."""
    rng = random.Random(1)
    for _ in range(200):
        cs = sorted(rng.sample([1, 2, 3, 4, 8, 16, 32, 64, 128, 256], rng.randint(1, 6)))
        from eagle3.schedule.derive import Choice

        choices = [Choice(c, rng.randint(0, 4)) for c in cs]
        cap = rng.choice([cs[-1], 2 * cs[-1], max(1, cs[-1] // 2)])
        sched = bands(choices, cap)
        assert sched[0].start == 1 and sched[-1].end == cap
        assert all(b.start <= b.end for b in sched)
        assert all(a.end + 1 == b.start for a, b in zip(sched, sched[1:]))  # no gap, no overlap
        assert all(a.num_steps != b.num_steps for a, b in zip(sched, sched[1:]))  # merged
        for ch in choices:  # every measured concurrency within the cap runs its own choice
            if ch.concurrency <= cap:
                assert steps_at(sched, ch.concurrency) == ch.num_steps
        slots = {int(k): v["candidate_steps"][0] for k, v in sglang_adaptive_config(sched).items()}
        for b in range(1, cap + 1):  # SGLang: the slot of the largest key not above the batch size
            assert slots[max(k for k in slots if k <= b)] == steps_at(sched, b)


@pytest.mark.parametrize("bad, match", [
    (ChainPoint(1, 0, 0.0), "tokens_per_s must be positive"),
    (ChainPoint(1, 2, 5.0, 1.5, (0.5,)), "one acceptance per speculative token"),
    (ChainPoint(1, 1, 5.0, 0.9, (0.1,)), "tau is at least 1"),
    (ChainPoint(1, 1, 5.0, 2.2, (1.2,)), r"lies in \[0, 1\]"),
])
def test_bad_measurements_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        predict([ChainPoint(1, 0, 10.0), bad], 1)


def test_no_off_run_is_refused():
    with pytest.raises(ValueError, match="no speculation-off run"):
        predict([ChainPoint(2, 1, 5.0, 1.5, (0.5,))], 2)
    with pytest.raises(ValueError, match="nothing was measured at concurrency 3"):
        predict(_points(), 3)
    with pytest.raises(ValueError, match="min_gain"):
        derive(_points(), min_gain=0.9)
