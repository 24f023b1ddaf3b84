"""Draft vocabulary: most frequent label tokens, padding, d2t/t2d properties."""

import pytest
import torch

from eagle3.errors import Eagle3Error
from eagle3.features import Capture, FeatureWriter, Record
from eagle3.train.vocab import auto_draft_vocab_size, build_draft_vocab, count_label_tokens


def check_properties(d2t, t2d, chosen_expected=None):
    N, V = d2t.numel(), t2d.numel()
    ids = torch.arange(N) + d2t
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert ids.min() >= 0 and ids.max() < V  # all in range
    assert torch.all(ids[1:] > ids[:-1])  # distinct, increasing
    assert int(t2d.sum()) == N
    assert torch.equal(t2d.nonzero().flatten(), ids)  # i + d2t[i] lists exactly the t2d ids
    if chosen_expected is not None:
        assert set(ids.tolist()) == set(chosen_expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_most_frequent_tokens_chosen(seed):
    g = torch.Generator().manual_seed(seed)
    V, N = 300, 40
    counts = torch.randint(0, 50, (V,), generator=g) * (torch.rand(V, generator=g) < 0.7)
    d2t, t2d = build_draft_vocab(counts, N)
    # independent reference: sort (count desc, id asc) with python
    ref = sorted(range(V), key=lambda i: (-int(counts[i]), i))
    ref = [i for i in ref if counts[i] > 0][:N]
    ref += [i for i in range(V) if i not in set(ref)][: N - len(ref)]
    check_properties(d2t, t2d, ref)
    # every chosen token is at least as frequent as every left-out one
    chosen = torch.arange(N) + d2t
    left = (~t2d).nonzero().flatten()
    assert counts[chosen].min() >= counts[left].max()


def test_fewer_distinct_tokens_than_n_pads_with_unused_ids():
    V, N = 50, 10
    counts = torch.zeros(V, dtype=torch.int64)
    counts[[7, 30, 41]] = torch.tensor([5, 9, 1])
    d2t, t2d = build_draft_vocab(counts, N)
    check_properties(d2t, t2d, [7, 30, 41, 0, 1, 2, 3, 4, 5, 6])
    d2t, t2d = build_draft_vocab(torch.zeros(V, dtype=torch.int64), N)  # nothing seen at all
    check_properties(d2t, t2d, list(range(N)))
    check_properties(*build_draft_vocab(counts, V), list(range(V)))  # N == V


def test_bad_sizes_are_user_errors():
    with pytest.raises(Eagle3Error, match="draft_vocab_size"):
        build_draft_vocab(torch.ones(10, dtype=torch.int64), 11)
    with pytest.raises(Eagle3Error, match="draft_vocab_size"):
        build_draft_vocab(torch.ones(10, dtype=torch.int64), 0)


def test_counts_only_loss_masked_tokens_of_the_training_split(tmp_path):
    H, K, V = 4, 2, 20
    recs = {
        "a": ([1, 2, 3, 3, 4], [0, 0, 1, 1, 1], "train"),
        "b": ([5, 5, 6, 7], [1, 1, 0, 1], "train"),
        "c": ([9, 9, 9], [1, 1, 1], "validation"),
    }
    plan = [(k, v[2]) for k, v in recs.items()]
    w = FeatureWriter.open(tmp_path, {"target": {"content_hash": "x"}}, plan, samples_per_shard=2)
    for idx, chunk in w.pending():
        rs = []
        for sid, split in chunk:
            ids, mask, _ = recs[sid]
            T = len(ids)
            rs.append(Record(sid, split, torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.uint8),
                             Capture(torch.zeros(T, 3, H).bfloat16(), torch.zeros(T, K, dtype=torch.int32), torch.zeros(T, K))))
        w.write_shard(idx, rs)
    m = w.finalize()
    counts = count_label_tokens([tmp_path], [m], V, progress=False)
    expected = torch.zeros(V, dtype=torch.int64)
    for t in [3, 3, 4, 5, 5, 7]:
        expected[t] += 1
    assert torch.equal(counts, expected)
    with pytest.raises(Eagle3Error, match="outside the target vocabulary"):
        count_label_tokens([tmp_path], [m], 6, progress=False)


def test_default_size_follows_the_data():
    counts = torch.zeros(50000, dtype=torch.int64)
    counts[:130] = 1
    assert auto_draft_vocab_size(counts) == 192  # 130 distinct, rounded up to a multiple of 64
    counts[:40000] = 1
    assert auto_draft_vocab_size(counts) == 32000  # EAGLE-3's size caps it
    assert auto_draft_vocab_size(torch.ones(100, dtype=torch.int64)) == 100  # never above the vocabulary
    assert auto_draft_vocab_size(torch.zeros(1000, dtype=torch.int64)) == 64
