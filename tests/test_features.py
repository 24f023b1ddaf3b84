"""Capture contract: shards, manifest, checksums, resume, reader."""

import json

import pytest
import torch

from eagle3.errors import Eagle3Error
from eagle3.features import (
    Capture,
    FeatureDataset,
    FeatureWriter,
    Record,
    bytes_per_token,
    AUX_FP8,
    check_compatible,
    dequantize_aux,
    estimate_bytes,
    load_manifest,
    quantize_aux,
    samples_per_shard,
)

H, K = 8, 4


def make_record(sid, T, split="train", seed=0):
    g = torch.Generator().manual_seed(seed)
    return Record(
        sample_id=sid,
        split=split,
        input_ids=torch.randint(0, 100, (T,), generator=g, dtype=torch.int32),
        loss_mask=(torch.arange(T) >= T // 2).to(torch.uint8),
        capture=Capture(
            aux_hidden_states=torch.randn(T, 3, H, generator=g).bfloat16(),
            topk_ids=torch.randint(0, 100, (T, K), generator=g, dtype=torch.int32),
            topk_logprobs=-torch.rand(T, K, generator=g),
        ),
    )


PLAN = [(f"s{i}", "validation" if i == 4 else "train") for i in range(5)]
META = {"target": {"content_hash": "abc", "hidden_size": H}, "aux_layer_ids": [2, 3, 4], "capture": {"top_k": K}}


def write_all(d, plan=PLAN, meta=META, stop_after=None):
    w = FeatureWriter.open(d, meta, plan, samples_per_shard=2, splits={"train": [], "test": ["t0"]})
    for n, (idx, chunk) in enumerate(w.pending()):
        if stop_after is not None and n == stop_after:
            return w
        recs = [make_record(sid, 5 + int(sid[1:]), split, seed=int(sid[1:])) for sid, split in chunk if sid != "s3"]
        w.write_shard(idx, recs, dropped={"s3": "prompt longer than max_length"} if any(s == "s3" for s, _ in chunk) else {})
    return w.finalize({"note": "x"})


def test_bytes_estimate():
    assert bytes_per_token(H, K) == 3 * H * 2 + K * 8 + 5
    assert estimate_bytes(10, H, K) == 10 * bytes_per_token(H, K)
    assert samples_per_shard(1, 100, 20, 100) == 1_000_000 // (100 * bytes_per_token(100, 20))


def test_fp8_aux_by_hand_and_within_e4m3_bounds():
    # a state whose absmax is 448 has scale 1: E4M3 values come back exactly, others round to 3 mantissa bits
    x = torch.tensor([[[448.0, -224.0, 1.0, 0.0, 0.1015625, 3.3, -17.0, 2.0 ** -9]]]).expand(1, 3, 8).clone()
    x[0, 1] *= 2  # absmax 896: scale 2, the same values at twice the size
    x[0, 2] = 0  # an all-zero state: scale 1, zeros back
    q, s = quantize_aux(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.tolist() == [[1.0, 2.0, 1.0]]
    back = dequantize_aux(q, s)
    assert back.dtype == torch.bfloat16
    # 3.3 -> 3.25 and -17 -> -16 (E4M3 steps of 0.25 in [2, 4) and 2 in [16, 32)); 0.1015625 = 13 * 2^-7 exact;
    # 2^-9 is E4M3's smallest subnormal
    want = [448.0, -224.0, 1.0, 0.0, 0.1015625, 3.25, -16.0, 2.0 ** -9]
    assert back[0, 0].float().tolist() == want and back[0, 1].float().tolist() == [2 * v for v in want]
    assert back[0, 2].float().abs().sum() == 0
    # the bound on random states with outlier channels, as residual streams have (relative 2^-4 of
    # each element, plus E4M3's subnormal step 2^-9 of the scale for the smallest)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 3, 576, generator=g)
    a[:, :, 7] *= 300
    q, s = quantize_aux(a)
    err = (dequantize_aux(q, s).float() - a).abs()
    assert bool((err <= a.abs() * 2.0 ** -4 + s[..., None] * 2.0 ** -9 + a.abs() * 2.0 ** -8).all())
    cos = torch.nn.functional.cosine_similarity(dequantize_aux(q, s).float(), a, dim=-1)
    assert cos.min() > 0.998
    # non-finite states stay non-finite (training's non-finite check must still see them)
    bad = torch.ones(2, 3, 8)
    bad[0, 1, 3], bad[1, 2, 0] = float("nan"), float("inf")
    back = dequantize_aux(*quantize_aux(bad)).float()
    assert back[0, 1].isnan().all() and back[1, 2].isnan().all() and back[0, 0].eq(1).all()


def test_fp8_folder_reads_back_as_bf16_in_half_the_bytes(tmp_path):
    m16 = write_all(tmp_path / "bf16")
    m8 = write_all(tmp_path / "fp8", meta={**META, "capture": {"top_k": K, "aux_dtype": AUX_FP8}})
    assert bytes_per_token(H, K, AUX_FP8) == 3 * H + 12 + K * 8 + 5
    a, b = FeatureDataset(tmp_path / "bf16"), FeatureDataset(tmp_path / "fp8")
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert y["aux_hidden_states"].dtype == torch.bfloat16 and y["aux_hidden_states"].shape == x["aux_hidden_states"].shape
        q, s = quantize_aux(x["aux_hidden_states"])
        assert torch.equal(y["aux_hidden_states"], dequantize_aux(q, s))
        for k in ("input_ids", "loss_mask", "topk_ids", "topk_logprobs"):
            assert torch.equal(x[k], y[k]), k
    # the aux part of each shard shrinks from 6H to 3H + 12 bytes a token
    from safetensors import safe_open

    def aux_bytes(path):
        with safe_open(str(path), framework="pt") as f:
            return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys() if k.startswith("aux_"))

    for s16, s8 in zip(m16["shards"], m8["shards"]):
        if s16["file"]:
            T = s16["tokens"]
            assert (aux_bytes(tmp_path / "bf16" / s16["file"]), aux_bytes(tmp_path / "fp8" / s8["file"])) == (T * 6 * H,
                                                                                                       T * (3 * H + 12))
    # both read together (one training run over a bf16 and an fp8 folder)
    both = FeatureDataset([tmp_path / "bf16", tmp_path / "fp8"])
    assert len(both) == 2 * len(a) and both[len(a)]["aux_hidden_states"].dtype == torch.bfloat16


def test_a_shard_whose_aux_storage_does_not_match_its_scales_is_refused(tmp_path):
    """fp8 aux states without their scales (or bf16 ones with scales) are named, not trained on."""
    from safetensors.torch import load_file, save_file

    write_all(tmp_path, meta={**META, "capture": {"top_k": K, "aux_dtype": AUX_FP8}})
    shard = tmp_path / load_manifest(tmp_path)["shards"][0]["file"]
    t = load_file(str(shard))
    del t["aux_scales"]
    save_file(t, str(shard))
    with pytest.raises(Eagle3Error, match=r"stores aux_hidden_states as F8_E4M3 without aux_scales"):
        FeatureDataset(tmp_path, verify=False)[0]


def test_roundtrip_and_counts(tmp_path):
    m = write_all(tmp_path)
    assert m["complete"] and len(m["shards"]) == 3
    assert m["counts"]["samples"] == 4 and m["counts"]["dropped"] == 1
    assert m["counts"]["tokens"] == sum(5 + i for i in (0, 1, 2, 4))
    assert m["counts"]["masked_tokens"] == sum((5 + i) - (5 + i) // 2 for i in (0, 1, 2, 4))
    ds = FeatureDataset(tmp_path, splits=("train",))
    assert ds.sample_ids == ["s0", "s1", "s2"] and ds.lengths == [5, 6, 7]
    ref = make_record("s2", 7, seed=2).tensors()
    got = ds[2]
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    val = FeatureDataset(tmp_path, splits=("validation",))
    assert val.sample_ids == ["s4"] and torch.equal(val[0]["input_ids"], make_record("s4", 9, seed=4).input_ids)


def test_resume_equals_uninterrupted_and_redoes_corrupt_shard(tmp_path):
    full = write_all(tmp_path / "full")
    write_all(tmp_path / "part", stop_after=1)  # killed after its first shard
    assert not load_manifest(tmp_path / "part", require_complete=False)["complete"]
    with pytest.raises(Eagle3Error, match="did not finish"):
        FeatureDataset(tmp_path / "part")
    resumed = write_all(tmp_path / "part")
    assert json.dumps(resumed["shards"]) == json.dumps(full["shards"])
    # corrupt a shard: reopening reports and re-does it; the reader refuses it meanwhile
    f = tmp_path / "part" / resumed["shards"][1]["file"]
    f.write_bytes(f.read_bytes()[:-3] + b"xyz")
    with pytest.raises(Eagle3Error, match="sha256"):
        FeatureDataset(tmp_path / "part")
    w = FeatureWriter.open(tmp_path / "part", META, PLAN, samples_per_shard=2)
    assert [i for i, _ in w.pending()] == [1]
    again = write_all(tmp_path / "part")
    assert json.dumps(again["shards"]) == json.dumps(full["shards"])


def test_refuses_other_settings_and_bad_records(tmp_path):
    write_all(tmp_path, stop_after=1)
    with pytest.raises(Eagle3Error, match="aux_layer_ids"):
        FeatureWriter.open(tmp_path, {**META, "aux_layer_ids": [1, 2, 3]}, PLAN, 2)
    with pytest.raises(Eagle3Error, match="data.limit"):
        FeatureWriter.open(tmp_path, META, PLAN[:3], 2)
    w = FeatureWriter.open(tmp_path, META, PLAN, 2)
    with pytest.raises(Eagle3Error, match="do not match"):
        w.write_shard(1, [make_record("s3", 4)], {})
    bad = make_record("s2", 5)
    bad.capture.aux_hidden_states = torch.zeros(5, 2, H)
    with pytest.raises(Eagle3Error, match=r"\[5, 3, H\]"):
        w.write_shard(1, [bad], {"s3": "x"})
    assert not list(tmp_path.glob("*.tmp"))


def test_missing_folder_and_incompatible(tmp_path):
    with pytest.raises(Eagle3Error, match="does not exist"):
        FeatureDataset(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(Eagle3Error, match="no manifest.json"):
        FeatureDataset(tmp_path / "empty")
    a = write_all(tmp_path / "a")
    b = write_all(tmp_path / "b", meta={**META, "target": {"content_hash": "zzz", "hidden_size": H}})
    with pytest.raises(Eagle3Error, match="target.content_hash"):
        check_compatible([a, b], ["a", "b"])
    with pytest.raises(Eagle3Error, match="content_hash"):
        FeatureDataset([tmp_path / "a", tmp_path / "b"])
    assert len(FeatureDataset([tmp_path / "a", tmp_path / "a"])) == 6


def _drop(key):
    def damage(m):
        del m[key]
        return json.dumps(m).encode()
    return damage


def _drop_shard_key(key):
    def damage(m):
        del m["shards"][1][key]
        return json.dumps(m).encode()
    return damage


@pytest.mark.parametrize(
    "damage, what",
    [
        (_drop("shards"), "it has no 'shards' entry"),
        (_drop("plan"), "it has no 'plan' entry"),
        (_drop("samples_per_shard"), "it has no 'samples_per_shard' entry"),
        (_drop("format"), "it has no 'format' entry"),
        (_drop_shard_key("sha256"), "shards entry 1 has no 'sha256'"),
        (lambda m: json.dumps(dict(m, shards={"0": m["shards"][0]})).encode(), "its 'shards' entry is not a JSON list"),
        (lambda m: json.dumps(m).encode()[:-40], "not valid JSON: "),
        (lambda m: json.dumps(m["shards"]).encode(), "it is not a JSON object"),
        (lambda m: b'{"format": "\xff' + json.dumps(m).encode()[13:], "byte 12 is not UTF-8"),
    ],
)
def test_a_damaged_manifest_names_the_file_what_is_missing_and_what_to_do(tmp_path, damage, what):
    d = tmp_path / "d"
    write_all(d, stop_after=2)  # an unfinished extraction, as a resume finds it
    path = d / "manifest.json"
    path.write_bytes(damage(json.loads(path.read_text())))
    before = {f.name: f.read_bytes() for f in d.iterdir()}
    expected = (f"the features manifest {path} is damaged ({what}"), (
        f"); re-run extract.py into a fresh output_dir, or delete {path} to extract that folder again")
    for call in (
        lambda: load_manifest(d, require_complete=False),
        lambda: FeatureDataset(d),  # training opens the folder
        lambda: FeatureWriter.open(d, META, PLAN, samples_per_shard=2),  # a resume opens it
    ):
        with pytest.raises(Eagle3Error) as e:
            call()
        msg = str(e.value)
        assert msg.startswith(expected[0]) and msg.endswith(expected[1]) and "\n" not in msg, msg
    assert {f.name: f.read_bytes() for f in d.iterdir()} == before  # nothing touched
    path.unlink()  # what the message says to do: the folder is extracted again, as an uninterrupted run
    assert json.dumps(write_all(d)["shards"]) == json.dumps(write_all(tmp_path / "full")["shards"])
