"""loop.compile_drafter: the drafter's norms and MLPs compiled by inductor train the same drafter."""

import copy

import torch

from eagle3.model.drafter import DrafterArch, Eagle3Drafter
from eagle3.train.fused import compile_drafter_elementwise
from eagle3.train.ttt import TTTCollator, target_to_draft_index, ttt_forward
from test_ttt import V, VD, H, random_sample


def test_compiled_norms_and_mlps_give_the_eager_loss_logits_and_gradients():
    torch.manual_seed(3)
    eager = Eagle3Drafter(DrafterArch(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      intermediate_size=24, num_layers=2, target_hidden_size=H, vocab_size=V,
                                      draft_vocab_size=VD))
    fused = copy.deepcopy(eager)
    # two layers: 4 parts in the first (its hidden_norm too), 3 in the second, and the final norm
    assert compile_drafter_elementwise(fused) == 8 and compile_drafter_elementwise(fused) == 0
    assert list(fused.state_dict()) == list(eager.state_dict())  # checkpoints and exports unchanged
    b = TTTCollator(target_to_draft_index(torch.zeros(VD, dtype=torch.int64), V), ttt_steps=3, max_length=64)(
        [random_sample(23, 1, 4), random_sample(17, 2, 9)])
    b2 = TTTCollator(target_to_draft_index(torch.zeros(VD, dtype=torch.int64), V), ttt_steps=3, max_length=64)(
        [random_sample(30, 3, 2)])

    def run(m, batch):
        m.zero_grad()
        o = ttt_forward(m, batch, 3, return_logits=True)
        o.loss.backward()
        return o, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    for batch in (b, b2):  # a second padded length: the same compiled code, no shape specialisation
        want, gw = run(eager, batch)
        got, gg = run(fused, batch)
        for j in range(3):
            torch.testing.assert_close(got.logits[j], want.logits[j], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-5)
        assert gg.keys() == gw.keys() and "layers.1.mlp.down_proj.weight" in gg
        for n in gw:
            torch.testing.assert_close(gg[n], gw[n], atol=1e-5, rtol=1e-4, msg=n)
    assert fused.layers[0].mlp._compiled_call_impl is not None and eager.layers[0].mlp._compiled_call_impl is None


def test_a_compiled_run_trains_the_eager_runs_drafter_and_resumes_either_way(tmp_path):
    from safetensors.torch import load_file

    from eagle3.train.run import train_drafter
    from toy import embed, make_cfg, tiny_target, write_features

    write_features(tmp_path / "f", n=30)
    tgt, E = tiny_target(), embed()
    over = {"loop.max_steps": 4}
    torch._dynamo.utils.counters.clear()
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "eager", **over), tgt, E)
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"]
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "fused", **over, **{"loop.compile_drafter": True}), tgt, E)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # inductor did compile
    # stopped after 2 steps without compiling, resumed compiled: a flag that may change on resume
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "mixed", **over), tgt, E, stop_after=2)
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "mixed", **over, **{"loop.compile_drafter": True}), tgt, E)
    ckpt = "checkpoints/step-00000004/model.safetensors"  # float32 (the exports are bf16)
    want = load_file(str(tmp_path / "eager" / ckpt))
    for run in ("fused", "mixed"):
        got = load_file(str(tmp_path / run / ckpt))
        assert got.keys() == want.keys()
        for k in want:  # float32 on CPU; fused kernels sum in another order
            torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4, msg=f"{run}: {k}")
