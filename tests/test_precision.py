"""The precision study: the -int4-dequant build, drift metrics, the served-kernel comparison."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eagle3.config import ModelConfig, QuantizationConfig
from eagle3.errors import Eagle3Error
from eagle3.study.drift import measure_drift, scope_masks
from eagle3.study.metrics import (
    PairAccumulator,
    cosine_per_token,
    kl_per_token,
    relative_l2_per_token,
    top1_agreement_per_token,
)
from eagle3.study.report import format_table
from eagle3.study.served import compare_top1, top1_from_prompt_logprobs
from eagle3.target import load_target, resolve_target
from eagle3.target.quantize import dequantize_packed, unpack_int32

pytestmark = pytest.mark.usefixtures("one_thread")


def _tensors(folder: Path) -> dict:
    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def _cfgs(src):
    mk = lambda name, method: ModelConfig(name=name, source=str(src), quantization=QuantizationConfig(method=method))
    return mk("tiny", "none"), mk("tiny-int4", "w4a16"), mk("tiny-int4-dequant", "w4a16-dequant")


# ------------------------------------------------------------------------ unpacking
def test_unpack_int32_reads_nibbles_least_significant_first():
    # values -8..-1 stored as 0..7 (offset +8), element k at bits 4k..4k+3
    word = torch.tensor([[0x76543210]], dtype=torch.int64).to(torch.int32)
    assert unpack_int32(word, 4, 8).tolist() == [[-8, -7, -6, -5, -4, -3, -2, -1]]
    # the top nibble set makes the int32 negative: 0xF = 15 -> +7
    neg = torch.tensor([[0xF0000008 - (1 << 32)]], dtype=torch.int32)
    assert unpack_int32(neg, 4, 8).tolist() == [[0, -8, -8, -8, -8, -8, -8, 7]]


def test_unpack_int32_inverts_compressed_tensors_packing():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (5, 64), generator=g, dtype=torch.int8)
    assert torch.equal(unpack_int32(pack_to_int32(q, 4), 4, 64), q)
    with pytest.raises(Eagle3Error, match="bits=3"):
        unpack_int32(pack_to_int32(q, 4), 3, 64)


def test_dequantize_packed_is_scale_times_int_per_group():
    q = torch.tensor([[1, -2, 3, -8], [7, 0, -1, 2]], dtype=torch.int8)
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    scale = torch.tensor([[0.5, 2.0], [0.25, 1.5]], dtype=torch.bfloat16)  # group size 2
    w = dequantize_packed(pack_to_int32(q, 4), scale, [2, 4], 4, dtype=torch.float32)
    assert w.tolist() == [[0.5, -1.0, 6.0, -16.0], [1.75, 0.0, -1.5, 3.0]]


# ---------------------------------------------------------------- the dequant build
def test_tiny_dequant_build_equals_scale_times_int_of_the_packed_checkpoint(tiny_target_dir, tmp_path):
    dense, int4, deq = _cfgs(tiny_target_dir)
    i4, dq = resolve_target(int4, tmp_path), resolve_target(deq, tmp_path)
    packed_dir, dq_dir = Path(i4.path), Path(dq.path)
    assert dq_dir.parent == tmp_path and dq_dir.name == packed_dir.name + "-dequant-bfloat16"
    cfg = json.loads((dq_dir / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16"
    assert (dq_dir / "tokenizer.json").is_file() and (dq_dir / "chat_template.jinja").is_file()
    packed, plain = _tensors(packed_dir), _tensors(dq_dir)
    assert not any(k.endswith(("weight_packed", "weight_scale", "weight_shape")) for k in plain)
    assert sum(k.endswith(".weight_packed") for k in packed) == 8 * 7
    # hand-check: row 3 of one Linear, columns 0..7 (word 0) and 33 (word 4, nibble 1, group 1)
    m = "model.layers.5.self_attn.o_proj"
    word0, word4 = int(packed[m + ".weight_packed"][3, 0]) & 0xFFFFFFFF, int(packed[m + ".weight_packed"][3, 4])
    s = packed[m + ".weight_scale"].float()
    w = plain[m + ".weight"]
    assert w.dtype == torch.bfloat16 and tuple(w.shape) == tuple(packed[m + ".weight_shape"].tolist())
    for k in range(8):
        q = ((word0 >> (4 * k)) & 0xF) - 8
        assert float(w[3, k]) == float(torch.tensor(float(s[3, 0]) * q).to(torch.bfloat16))
    q33 = ((word4 & 0xFFFFFFFF) >> 4 & 0xF) - 8
    assert float(w[3, 33]) == float(torch.tensor(float(s[3, 1]) * q33).to(torch.bfloat16))
    # everything not quantised is copied bit for bit
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(plain[k], packed[k])
    # its own content hash, different from both parents; reused on the next resolve
    hashes = {resolve_target(dense, tmp_path).content_hash, i4.content_hash, dq.content_hash}
    assert len(hashes) == 3 and resolve_target(deq, tmp_path).content_hash == dq.content_hash


def test_tiny_int4_and_int4_dequant_are_the_same_model(tiny_target_dir, tmp_path):
    dense, int4, deq = _cfgs(tiny_target_dir)
    models = {k: load_target(c, tmp_path)[0].float() for k, c in (("bf16", dense), ("int4", int4), ("dequant", deq))}
    dq_params = dict(models["dequant"].named_parameters())
    i4_params = dict(models["int4"].named_parameters())
    assert all(torch.equal(dq_params[k], i4_params[k]) for k in dq_params)
    g = torch.Generator().manual_seed(1)
    seqs = [{"input_ids": torch.randint(0, 1000, (n,), generator=g).tolist(), "prompt_len": 5} for n in (12, 20)]
    res = measure_drift(models, seqs, [("int4", "dequant"), ("bf16", "int4")], num_states=9)
    same, drift = res["int4:dequant"]["all"], res["bf16:int4"]["all"]
    assert same["tokens"] == 11 + 19
    assert all(v == pytest.approx(1.0, abs=1e-12) for v in same["cosine"].values())
    assert all(v == 0.0 for v in same["rel_l2"].values())
    assert same["top1_agreement"] == 1.0 and same["mean_kl"] == pytest.approx(0.0, abs=1e-12)
    # the parent differs after the first quantised layer; the embeddings (state 0) do not
    assert drift["cosine"]["0"] == pytest.approx(1.0, abs=1e-12) and drift["cosine"]["4"] < 0.9999
    assert drift["mean_kl"] > 0


def test_dequant_of_a_dense_folder_and_unknown_methods_are_refused(tiny_target_dir, tmp_path):
    not_packed = ModelConfig(name="x", source=str(tiny_target_dir),
                             quantization=QuantizationConfig(method="w4a16-dequant", prequantized=True))
    with pytest.raises(Eagle3Error, match="not a compressed-tensors pack-quantized checkpoint"):
        resolve_target(not_packed, tmp_path)
    bad = ModelConfig(name="x", source=str(tiny_target_dir), quantization=QuantizationConfig(method="int4"))
    with pytest.raises(Eagle3Error, match="none, w4a16, w4a16-dequant"):
        resolve_target(bad, tmp_path)


# ----------------------------------------------------------------------- metrics
def test_metrics_on_hand_built_tensors():
    a = torch.tensor([[3.0, 4.0], [1.0, 0.0], [2.0, 2.0]])
    b = torch.tensor([[0.0, 5.0], [1.0, 1.0], [2.0, 2.0]])
    assert cosine_per_token(a, b).tolist() == pytest.approx([0.8, 1 / math.sqrt(2), 1.0])
    assert relative_l2_per_token(a, b).tolist() == pytest.approx([math.sqrt(10) / 5, 1.0, 0.0])
    assert cosine_per_token(torch.zeros(1, 2), a[:1]).tolist() == [0.0]
    la = torch.tensor([[0.0, 0.0], [5.0, 1.0]])
    lb = torch.tensor([[math.log(3.0), 0.0], [0.0, 2.0]])
    # KL((.5,.5) || (.75,.25)) = .5 ln(2/3) + .5 ln 2 = .5 ln(4/3)
    assert kl_per_token(la, lb)[0].item() == pytest.approx(0.5 * math.log(4 / 3))
    assert kl_per_token(la, la).tolist() == pytest.approx([0.0, 0.0], abs=1e-15)
    # argmax: la -> [0 (a tie goes to the lowest id), 0], lb -> [0, 1]
    assert top1_agreement_per_token(la, lb).tolist() == [True, False]
    assert top1_agreement_per_token(lb, lb).tolist() == [True, True]


def test_pair_accumulator_means_over_masked_tokens():
    acc = PairAccumulator(layers=[0])
    sa = torch.tensor([[[3.0, 4.0], [1.0, 0.0], [9.0, 9.0]]])  # [L+1=1, T=3, H=2]
    sb = torch.tensor([[[0.0, 5.0], [1.0, 1.0], [-9.0, 9.0]]])
    logits_a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    logits_b = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    acc.add(sa, sb, logits_a, logits_b, torch.tensor([True, True, False]))
    s = acc.summary()
    assert s["tokens"] == 2
    assert s["cosine"]["0"] == pytest.approx((0.8 + 1 / math.sqrt(2)) / 2)
    assert s["cosine_min"]["0"] == pytest.approx(1 / math.sqrt(2))
    assert s["rel_l2"]["0"] == pytest.approx((math.sqrt(10) / 5 + 1.0) / 2)
    assert s["top1_agreement"] == 0.5
    p, q = torch.softmax(torch.tensor([0.0, 1.0]), 0), torch.softmax(torch.tensor([1.0, 0.0]), 0)
    assert s["mean_kl"] == pytest.approx(float((p * (p / q).log()).sum()) / 2)


def test_scope_masks():
    m = scope_masks(6, 3)
    assert m["all"].tolist() == [False, True, True, True, True, True]
    assert m["reply"].tolist() == [False, False, True, True, True, False]


# --------------------------------------------------------------- served kernel
def test_top1_from_prompt_logprobs_shifts_to_the_predicting_position():
    pl = [None,
          {"504": {"logprob": -8.0, "rank": 484}, "2581": {"logprob": -3.8, "rank": 1}},
          {"100": {"logprob": -0.1, "rank": 1}},
          {"7": {"logprob": -9.0, "rank": 3}}]  # no rank-1 entry listed
    assert top1_from_prompt_logprobs(pl) == [2581, 100, None]
    # local argmax per position (T = 4); served covers positions 0..2; scored from position 1
    res = compare_top1([[2581, 100, None]], [[2581, 100, 5, 9]], prompt_lens=[3])
    assert res["all"] == {"tokens": 2, "top1_agreement": 0.5}
    assert res["reply"] == {"tokens": 1, "top1_agreement": 0.0}


def test_format_table_lists_every_pair():
    s = {"tokens": 3, "cosine": {"2": 0.99, "4": 0.9}, "cosine_min": {}, "rel_l2": {"2": 0.1, "4": 0.3},
         "top1_agreement": 0.5, "mean_kl": 0.25}
    result = {"aux_layer_ids": [2, 4], "pairs": {"a:b": {"reply": s}},
              "served": {"vllm:a": {"reply": {"tokens": 3, "top1_agreement": 1.0}}}}
    text = format_table(result, "reply").splitlines()
    assert text[0].split() == ["pair", "(a:b)", "tokens", "cos@2", "cos@4", "relL2@2", "relL2@4", "top1", "KL(a||b)"]
    assert text[2].split() == ["a:b", "3", "0.99000", "0.90000", "0.1000", "0.3000", "50.0%", "0.2500"]
    assert text[3].split()[0] == "vllm:a" and text[3].split()[-2:] == ["100.0%", "-"]


def test_chunked_states_equal_the_full_forward_in_float32(tiny_target_dir, tmp_path):
    """Prefill + verify-shaped chunks over a KV cache compute what one full forward does:
    equal in float32 up to rounding, for chunk sizes that do and do not divide the reply."""
    from eagle3.study.drift import chunked_states, forward_states

    model, _, _ = load_target(ModelConfig(name="tiny", source=str(tiny_target_dir), dtype="float32"), tmp_path)
    ids = torch.randint(0, 1000, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    full_s, full_l = forward_states(model, ids)
    for chunk in (1, 4, 7):
        s, lg = chunked_states(model, ids, prompt_len=9, chunk=chunk)
        assert s.shape == full_s.shape and lg.shape == full_l.shape
        assert torch.allclose(s, full_s, atol=1e-4, rtol=1e-4) and torch.allclose(lg, full_l, atol=1e-4, rtol=1e-4)
    # and it is not the same call: a wrong position offset in the chunks breaks the equality
    s_wrong = torch.cat([forward_states(model, ids[:9])[0], forward_states(model, ids[9:])[0]], 1)
    assert not torch.allclose(s_wrong, full_s, atol=1e-3)
