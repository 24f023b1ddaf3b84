"""The GPTQ W4A16 build (quantization.algorithm=gptq) against the round-to-nearest one.

GPTQ chooses each Linear's int4 weights to minimise that layer's output error on the
calibration activations; round-to-nearest ignores them. On layer 0, whose inputs are the
same in the dense and the quantised model, GPTQ's error on those activations must
therefore be lower than round-to-nearest's, and both must store weights on the same
int4 grid in the same pack-quantized format.
"""

import dataclasses

import pytest
import torch

from eagle3.config import ModelConfig, QuantizationConfig
from eagle3.errors import Eagle3Error
from eagle3.target import load_target, resolve_target
from eagle3.target.gptq import calibration_ids
from eagle3.target.resolve import target_folder
from eagle3.target.source import quantized_folder_name

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("llmcompressor")

SAMPLES, TOKENS = 8, 64


def _cfg(src, algorithm: str) -> ModelConfig:
    q = QuantizationConfig(method="w4a16", algorithm=algorithm, calibration_samples=SAMPLES,
                           calibration_max_tokens=TOKENS)
    return ModelConfig(name=f"tiny-{algorithm}", source=str(src), quantization=q)


@pytest.fixture(scope="module")
def builds(tiny_target_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("gptq_cache")
    return {a: target_folder(_cfg(tiny_target_dir, a), cache) for a in ("rtn", "gptq")}


def _dequantized(folder):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                quantization_config=CompressedTensorsConfig(dequantize=True))


@torch.no_grad()
def _layer0_error(dense, quant, x: torch.Tensor) -> dict:
    """``||x W^T - x Q^T||^2`` per projection of layer 0 (x: layer 0's normalised input)."""
    out = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(dense.model.layers[0].self_attn, name).weight.float()
        wq = getattr(quant.model.layers[0].self_attn, name).weight.float()
        out[name] = float(((x @ (w - wq).T) ** 2).sum())
    return out


def test_gptq_lowers_layer0_output_error_below_round_to_nearest(tiny_target_dir, builds, tiny_tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dense = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    rtn, gptq = _dequantized(builds["rtn"]), _dequantized(builds["gptq"])
    ids = calibration_ids(AutoTokenizer.from_pretrained(tiny_tokenizer_dir), SAMPLES, TOKENS)
    with torch.no_grad():
        x = torch.cat([dense.model.layers[0].input_layernorm(dense.model.embed_tokens(torch.tensor(s)))
                       for s in ids])  # [sum(T), H]
    e_rtn, e_gptq = _layer0_error(dense, rtn, x), _layer0_error(dense, gptq, x)
    for name in e_rtn:
        assert e_gptq[name] < 0.9 * e_rtn[name], (name, e_gptq[name], e_rtn[name])
    # and GPTQ moved weights: it is not round-to-nearest under another name
    assert not torch.equal(rtn.model.layers[3].mlp.down_proj.weight, gptq.model.layers[3].mlp.down_proj.weight)


def test_gptq_build_stores_int4_on_the_w4a16_grid_and_loads(tiny_target_dir, builds):
    from safetensors import safe_open

    from eagle3.target.quantize import unpack_int32

    folder = builds["gptq"]
    assert folder.name == quantized_folder_name(tiny_target_dir.name, {**dataclasses.asdict(_cfg(tiny_target_dir, "gptq").quantization)})
    assert folder.name.endswith(f"-w4a16-g32-sym-gptq{SAMPLES}x{TOKENS}-d0.01")
    packed = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                if k.endswith(".weight_packed"):
                    q = unpack_int32(fh.get_tensor(k), 4, int(fh.get_tensor(k.replace("_packed", "_shape"))[1]))
                    assert q.min() >= -8 and q.max() <= 7
                    packed += 1
                assert not k.startswith("lm_head.weight_")  # lm_head is ignored: stays dense
    assert packed == 8 * 7  # q, k, v, o, gate, up, down of 8 layers
    cfg = _cfg(tiny_target_dir, "gptq")
    info = resolve_target(cfg, folder.parent)
    assert info.quantization["algorithm"] == "gptq"
    model, _, _ = load_target(cfg, folder.parent, device="cpu")
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()


def test_a_built_target_is_reused_without_its_source_package(tmp_path):
    cfg = ModelConfig(name="smollm2-gptq", source="package:no_such_package/model.gguf",
                      quantization=QuantizationConfig(method="w4a16", algorithm="gptq"))
    with pytest.raises(Eagle3Error):
        target_folder(cfg, tmp_path)  # neither the package nor a build
    q = dataclasses.asdict(cfg.quantization)
    built = tmp_path / quantized_folder_name("model-bfloat16", q)
    built.mkdir()
    (built / "config.json").write_text("{}")
    assert target_folder(cfg, tmp_path) == built


def test_unknown_algorithm_is_refused_with_the_choices(tiny_target_dir, tmp_path):
    cfg = _cfg(tiny_target_dir, "awq")
    with pytest.raises(Eagle3Error, match="algorithm 'awq' is unknown; use one of rtn, gptq"):
        target_folder(cfg, tmp_path)
