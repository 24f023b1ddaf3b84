"""Teacher-forced replay of a decoded turn against the decoder itself (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from eagle3.evaluate.inprocess.records import TurnRecord
from eagle3.evaluate.inprocess.teacher_forced import (
    _sample,
    chain_acceptance_rows,
    summarize_teacher_forced,
    teacher_forced_turn,
)
from eagle3.spec import Eagle3Proposer, SpecSettings, SpeculativeDecoder, StaticTargetRunner, TargetRunner
from eagle3.train.ttt import TTTCollator, target_to_draft_index, ttt_forward
from test_spec_decode import AUX, PROMPT, greedy_reference, tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")
N = 48  # new tokens


@pytest.fixture(scope="module")
def setup():
    """A tiny target, its greedy reply to PROMPT, and a drafter fitted to that reply so
    that chains are partly accepted (a random drafter accepts nothing: no test)."""
    target = tiny_target(seed=3)
    ref = greedy_reference(target, PROMPT, N)
    drafter = tiny_drafter(target, vocab_draft=96, seed=2)
    runner = TargetRunner(target, AUX)
    ids = torch.tensor(ref)
    with torch.no_grad():
        _, aux = runner.forward(ids[None], torch.arange(len(ref))[None], runner.new_cache())
    batch = TTTCollator(target_to_draft_index(drafter.d2t, drafter.t2d.numel()), 3, len(ref))(
        [_sample(ids, len(PROMPT), aux)])
    batch["aux_hidden_states"] = aux[None]
    torch.manual_seed(0)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    drafter.train()
    for _ in range(10):  # 10 steps: chains of 0-3 accepted drafts (30 accept all 3 everywhere)
        opt.zero_grad()
        ttt_forward(drafter, batch, 3, 1.0).loss.backward()
        opt.step()
    drafter.eval()
    return target, drafter, ref


def test_replay_equals_the_decoders_chains_in_float32(setup):
    target, drafter, ref = setup
    s, _ = SpecSettings.make(3, 1, 4, max_new_tokens=N)
    dec = SpeculativeDecoder(TargetRunner(target, AUX), Eagle3Proposer(drafter, AUX), s)
    res = dec.generate(PROMPT)
    assert res.tokens == ref[len(PROMPT):]  # lossless: the reply is the target's greedy text
    counts = res.accept_counts
    assert len(set(counts)) >= 3, f"the fitted drafter should give varied chains, got {counts}"
    tf = teacher_forced_turn(TargetRunner(target, AUX), drafter, PROMPT, res.tokens, 3)
    assert tf["replay_counts"][: len(counts) - 1] == counts[:-1]
    # the static runner (the CUDA default), its one cache just used by a decoding
    static = StaticTargetRunner(target, AUX, max_len=128)
    res_s = SpeculativeDecoder(static, Eagle3Proposer(drafter, AUX), s).generate(PROMPT)
    assert res_s.accept_counts == counts
    assert teacher_forced_turn(static, drafter, PROMPT, res.tokens, 3) == tf
    rec = TurnRecord("b", "p", 0, len(PROMPT), res.tokens, res.tokens, 1.0, 1.0, 0.1, 0.1,
                     res.verify_passes, res.emitted, counts, teacher_forced=tf)
    summary = summarize_teacher_forced([rec])
    assert summary["identical_turns"] == 1 and summary["turns"] == 1
    assert summary["served_tau"] == pytest.approx(1 + sum(counts) / len(counts))


def test_every_row_equals_a_decoder_started_there(setup):
    # the chain at row q is what a decoder gets on its first verify pass when its prompt
    # is the text up to token q (the prefill emits token q + 1, the chain drafts from there)
    target, drafter, ref = setup
    P = len(PROMPT)
    acc, first, end = chain_acceptance_rows(TargetRunner(target, AUX), drafter, PROMPT, ref[P:], 3)
    assert (first, end) == (P - 2, len(ref) - 2)
    s, _ = SpecSettings.make(3, 1, 4, max_new_tokens=12)
    checked = set()
    for q in range(P, len(ref) - 8):
        dec = SpeculativeDecoder(TargetRunner(target, AUX), Eagle3Proposer(drafter, AUX), s)
        res = dec.generate(ref[: q + 1])
        assert res.tokens[:8] == ref[q + 1 : q + 9]
        assert res.accept_counts[0] == int(acc[q]), f"row {q}"
        checked.add(int(acc[q]))
    assert len(checked) >= 3  # rows with 0, some and all drafts accepted were compared


def test_nothing_to_replay_gives_none(setup):
    target, drafter, ref = setup
    P = len(PROMPT)
    runner = TargetRunner(target, AUX)
    assert teacher_forced_turn(runner, drafter, PROMPT, ref[P : P + 2], 3) is None  # reply too short
    assert teacher_forced_turn(runner, drafter, PROMPT[:1], ref[P:], 3) is None  # prompt of one token

    class NaNRunner(TargetRunner):
        def prefill(self, input_ids, cache, capture=True):
            logits, aux = super().prefill(input_ids, cache, capture)
            return logits, aux * float("nan")

    assert teacher_forced_turn(NaNRunner(target, AUX), drafter, PROMPT, ref[P:], 3) is None


def test_summary_hand_case():
    # two turns: decoder counts [3, 0, 1] and [2, 2]; replays [3, 0, 2] and [2, 1, 0]
    a = TurnRecord("b", "p", 0, 5, [1] * 8, [1] * 8, 1.0, 1.0, 0.1, 0.1, 3, 7, [3, 0, 1],
                   teacher_forced={"replay_counts": [3, 0, 2], "every_accepted": 10, "every_chains": 8,
                                   "every_per_step": [5, 3, 2]})
    b = TurnRecord("b", "q", 0, 5, [1] * 6, [1] * 6, 1.0, 1.0, 0.1, 0.1, 2, 6, [2, 2],
                   teacher_forced={"replay_counts": [2, 1, 0], "every_accepted": 2, "every_chains": 2,
                                   "every_per_step": [1, 1, 0]})
    s = summarize_teacher_forced([a, b])
    assert s["served_tau"] == pytest.approx(1 + 8 / 5)
    assert s["replay_tau"] == pytest.approx(1 + 8 / 6)
    assert s["every_tau"] == pytest.approx(1 + 12 / 10)
    assert s["every_per_position"] == pytest.approx([0.6, 0.4, 0.2])
    assert s["identical_turns"] == 2  # the last chain is left out: [3, 0] == [3, 0], [2] == [2]
    assert summarize_teacher_forced([TurnRecord("b", "p", 0, 5, [1], [1], 1, 1, 0, 0, 0, 0, [])]) is None
