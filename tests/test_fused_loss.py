"""The fused top-k KL loss (loop.fused_loss): the eager loss's values, argmax and gradients without its logits."""

import pytest
import torch

from eagle3.model.drafter import Eagle3Drafter
from eagle3.train.loss import fused_topk_kl, kl_loss
from eagle3.train.ttt import TTTCollator, ttt_forward
from test_ttt import ARCH, T2D_INDEX, random_sample


def _case(N=23, H=16, Vd=37, k=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(Vd, H, generator=g, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, Vd, (N, k), generator=g)
    q = torch.softmax(torch.randn(N, k, generator=g, dtype=torch.float64), -1).float()
    q[3] = 0.0  # a row whose target lies wholly outside the draft vocabulary: KL 0, no gradient
    q[5, 2:] = 0.0  # entries outside the vocabulary: id 0, q 0 (target_distribution's convention)
    ids[5, 2:] = 0
    ids[7, 1] = ids[7, 0]  # a repeated id: both entries' mass lands on it
    return x, w, ids, q


@pytest.mark.parametrize("chunk", [1, 4, 23, 100])
def test_fused_loss_equals_the_eager_loss_its_argmax_and_gradients(chunk):
    x, w, ids, q = _case()
    gk = torch.randn(x.shape[0], dtype=torch.float32, generator=torch.Generator().manual_seed(1))  # any upstream grad
    logits = x @ w.t()
    ref = kl_loss(logits, ids, q)
    (ref * gk).sum().backward()
    gx_ref, gw_ref = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    kl, top = fused_topk_kl(x, w, ids, q, chunk=chunk)
    (kl * gk).sum().backward()
    # float64 inputs: the fused loss stays in float64, the eager one computes in float32
    torch.testing.assert_close(kl, ref.double(), rtol=1e-5, atol=1e-6)
    assert torch.equal(top, logits.argmax(-1)) and kl[3] == 0
    torch.testing.assert_close(x.grad, gx_ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad, gw_ref, rtol=1e-4, atol=1e-6)
    assert x.grad[3].abs().max() == 0  # no target mass, no gradient


def test_fused_loss_gradient_is_the_finite_difference_of_its_value():
    x, w, ids, q = _case(N=8, H=4, Vd=9, k=3)
    torch.autograd.gradcheck(lambda a, b: fused_topk_kl(a, b, ids, q, chunk=4)[0], (x, w))


def test_ttt_unroll_with_the_fused_loss_trains_the_eager_gradients():
    torch.manual_seed(4)
    m = Eagle3Drafter(ARCH)
    samples = [random_sample(40, s, start) for s, start in ((1, 10), (2, 4), (3, 25))]
    b = TTTCollator(T2D_INDEX, ttt_steps=3, max_length=64)(samples)
    outs = []
    for fused in (False, True):
        m.zero_grad()
        o = ttt_forward(m, b, 3, fused_loss=fused)
        o.loss.backward()
        outs.append((o, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (e, ge), (f, gf) = outs
    torch.testing.assert_close(f.loss, e.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(f.step_stats, e.step_stats, rtol=1e-6, atol=1e-5)  # KL sums, rows, correct
    assert f.accepted == e.accepted and ge.keys() == gf.keys() and "lm_head.weight" in gf
    for n in ge:
        torch.testing.assert_close(gf[n], ge[n], rtol=1e-5, atol=1e-6, msg=n)


def test_fused_loss_under_bf16_autocast_runs_lm_head_in_bf16_like_the_eager_path():
    x, w, ids, q = _case(N=64, H=32, Vd=300, k=8, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = kl_loss(torch.nn.functional.linear(x, w), ids, q)
        ref.sum().backward()
        gx_ref, gw_ref = x.grad.clone(), w.grad.clone()
        x.grad = w.grad = None
        kl, _ = fused_topk_kl(x, w, ids, q, chunk=16)
        kl.sum().backward()
    assert kl.dtype == torch.float32 and x.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(kl, ref, rtol=0, atol=1e-4)  # the same bf16 logits, float32 after
    torch.testing.assert_close(x.grad, gx_ref, rtol=2e-2, atol=2e-3)  # bf16 matmuls in the backward pass
    torch.testing.assert_close(w.grad, gw_ref, rtol=2e-2, atol=2e-3)


def test_a_run_with_the_fused_loss_trains_the_eager_runs_drafter_and_resumes_either_way(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    import eagle3.train.ttt as ttt
    from eagle3.train.run import train_drafter
    from toy import embed, make_cfg, tiny_target, write_features

    calls = []
    monkeypatch.setattr(ttt, "fused_topk_kl", lambda *a, **k: calls.append(1) or fused_topk_kl(*a, **k))

    write_features(tmp_path / "f", n=30)
    tgt, E = tiny_target(), embed()
    over = {"loop.max_steps": 4}
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "eager", **over), tgt, E)
    assert not calls
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "fused", **over, **{"loop.fused_loss": True}), tgt, E)
    assert calls  # training and validation went through the fused loss
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "mixed", **over), tgt, E, stop_after=2)
    train_drafter(make_cfg(tmp_path / "f", tmp_path / "mixed", **over, **{"loop.fused_loss": True}), tgt, E)
    ckpt = "checkpoints/step-00000004/model.safetensors"
    want = load_file(str(tmp_path / "eager" / ckpt))
    for run in ("fused", "mixed"):
        got = load_file(str(tmp_path / run / ckpt))
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4, msg=f"{run}: {k}")


def test_fused_loss_is_refused_under_fsdp_before_anything_is_trained(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import eagle3.train.build as build
    from eagle3.errors import Eagle3Error
    from eagle3.train.run import train_drafter
    from toy import embed, make_cfg, tiny_target, write_features

    write_features(tmp_path / "f", n=10)
    real = build._accelerator
    monkeypatch.setattr(build, "_accelerator", lambda *a: SimpleNamespace(
        real=real(*a), distributed_type=SimpleNamespace(value="FSDP")))
    with pytest.raises(Eagle3Error, match="loop.fused_loss.*FSDP.*loop.fused_loss=false"):
        train_drafter(make_cfg(tmp_path / "f", tmp_path / "out", **{"loop.fused_loss": True}), tiny_target(), embed())
    assert not (tmp_path / "out" / "checkpoints").exists()
