"""Precision recipes (workloads/precision.py) in one process: BF16 GEMM emulation, FP8 scaling,
master weights. The multi-rank behaviour (amax reduced over TP) is checked through Ray in
test_checks_precision.py."""

import pytest
import torch
from torch import nn

from tracer.errors import ConfigError
from workloads import precision, rounding_draws
from workloads.precision import E4M3, E5M2, FP8Scaling, Precision, bf16_linear, dequantize, quantize

G = lambda s: torch.Generator().manual_seed(s)


def test_bf16_gemm_is_fp32_accumulation_of_bf16_inputs_rounded_once():
    x = torch.randn(4, 8, 64, generator=G(0)).bfloat16().requires_grad_()
    w = torch.randn(32, 64, generator=G(1)).bfloat16().requires_grad_()
    b = torch.randn(32, generator=G(2)).bfloat16().requires_grad_()
    y = bf16_linear(x, w, b)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (x.float() @ w.float().t() + b.float()).bfloat16())
    g = torch.randn(y.shape, generator=G(3)).bfloat16()
    y.backward(g)
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    assert torch.equal(x.grad, (g.float() @ w.float()).bfloat16())
    assert torch.equal(w.grad, (g.float().reshape(-1, 32).t() @ x.float().reshape(-1, 64)).bfloat16())


def test_the_gpu_bf16_mode_computes_gemms_and_norm_and_embedding_grads_in_fp32_rounded_once():
    """workloads/bf16_dispatch.GpuBF16, around third-party BF16 code (megatron-core's): torch's own BF16
    GEMM calls, forward and in an autograd.Function's backward, are FP32 accumulations rounded once;
    LayerNorm's and the embedding's grads are the FP32 computation rounded once, on any thread count
    (the CPU kernels accumulate them in BF16: 1e-2 off, thread-dependent)."""
    from workloads.bf16_dispatch import GpuBF16

    class Matmul(torch.autograd.Function):   # as megatron's linear layers: GEMMs in a Python backward
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return torch.matmul(x, w.t())

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g.matmul(w), g.t().matmul(x)

    x = torch.randn(48, 64, generator=G(0)).bfloat16().requires_grad_()
    w = torch.randn(32, 64, generator=G(1)).bfloat16().requires_grad_()
    g = torch.randn(48, 32, generator=G(2)).bfloat16()
    with GpuBF16():
        y = Matmul.apply(x, w)
        y.backward(g)
    assert torch.equal(y, (x.float() @ w.float().t()).bfloat16())
    assert torch.equal(x.grad, (g.float() @ w.float()).bfloat16())
    assert torch.equal(w.grad, (g.float().t() @ x.float()).bfloat16())

    h = torch.randn(64, 256, generator=G(3)).bfloat16()
    gh = torch.randn(64, 256, generator=G(4)).bfloat16()
    tokens = torch.randint(0, 8, (512,), generator=G(5))   # repeated tokens: sums in the weight grad
    ge = torch.randn(512, 16, generator=G(6)).bfloat16()
    got = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        norm, emb = nn.LayerNorm(256).bfloat16(), nn.Embedding(8, 16).bfloat16()
        with GpuBF16():
            norm(h).backward(gh)
            emb(tokens).backward(ge)
        got.append((norm.weight.grad, norm.bias.grad, emb.weight.grad))
    exact_norm, exact_emb = nn.LayerNorm(256), nn.Embedding(8, 16)
    exact_norm(h.float()).backward(gh.float())
    exact_emb(tokens).backward(ge.float())
    for grads in got:
        assert torch.equal(grads[0], exact_norm.weight.grad.bfloat16())
        assert torch.equal(grads[1], exact_norm.bias.grad.bfloat16())
        assert torch.equal(grads[2], exact_emb.weight.grad.bfloat16())


def test_fp8_quantization_uses_the_amax_scale_and_saturates():
    t = torch.randn(1000, generator=G(4)) * 0.02
    amax = t.abs().max()
    q, scale = quantize(t, E4M3, amax)
    assert q.dtype == E4M3 and scale.item() == pytest.approx(448.0 / amax.item())
    assert q.float().abs().max().item() == 448.0                  # the amax maps to fp8 max
    big = (dequantize(q, scale) - t).abs() / t.abs()
    assert big[t.abs() > amax / 16].max() <= 2.0**-4 + 1e-6       # E4M3: 3 mantissa bits
    q2, s2 = quantize(t, E5M2, amax / 4)                          # a too-small amax saturates
    assert q2.dtype == E5M2 and torch.isfinite(q2.float()).all()
    assert q2.float().abs().max().item() == torch.finfo(E5M2).max


def test_shards_quantized_with_the_logical_amax_reproduce_the_reference_and_own_amax_does_not():
    """Column-parallel FP8 GEMM: a weight shard quantized with the logical tensor's amax (what the
    TP all-reduce MAX gives) yields exactly the reference's output columns; with its own amax
    (bug fp8_amax_unreduced) it does not."""
    x = torch.randn(16, 64, generator=G(5)).bfloat16()
    w = torch.randn(32, 64, generator=G(6)).bfloat16() * 0.02
    w[0, 0] = 0.2                                       # the logical amax lives in shard 0
    xq, sx = quantize(x, E4M3, x.float().abs().max())
    ref = dequantize(xq, sx) @ dequantize(*quantize(w, E4M3, w.float().abs().max())).t()
    shard = w[16:]
    good = dequantize(xq, sx) @ dequantize(*quantize(shard, E4M3, w.float().abs().max())).t()
    bad = dequantize(xq, sx) @ dequantize(*quantize(shard, E4M3, shard.float().abs().max())).t()
    assert torch.equal(good, ref[:, 16:])
    assert not torch.equal(bad, ref[:, 16:])


def test_fp8_linear_forward_backward_dtypes_and_delayed_scaling_history():
    for scaling in ("current", "delayed"):
        s = FP8Scaling(Precision("fp8", scaling=scaling, amax_history=2), None, None)
        lin = precision.fp8_linear(s)
        x = torch.randn(2, 8, 64, generator=G(7)).bfloat16().requires_grad_()
        w = (torch.randn(32, 64, generator=G(8)) * 0.02).bfloat16().requires_grad_()
        for _ in range(3):                              # three steps
            y = lin(x, w)
            assert y.dtype == torch.bfloat16
            rel = ((y.float() - (x.float() @ w.float().t())).norm() / y.float().norm()).item()
            assert rel < 0.1                            # FP8 error, not garbage
            y.float().sum().backward()
            assert x.grad.dtype == w.grad.dtype == torch.bfloat16
            s.end_step()
        if scaling == "delayed":
            assert [len(h) for h in s.history.values()] == [2, 2, 2]   # capped at amax_history
        else:
            assert all(len(h) == 0 for h in s.history.values())


def test_master_weights_take_fp32_main_grads_and_round_back_to_bf16():
    model = nn.Linear(8, 4).bfloat16()
    recipe = Precision("bf16")
    precision.apply(model, recipe, None, None)
    opt = precision.optimizer(model, recipe, lambda ps: torch.optim.SGD(ps, lr=1e-3))
    x = torch.randn(3, 8, generator=G(9)).bfloat16()
    for _ in range(2):                                  # two microbatches accumulate in FP32
        model(x).float().sum().backward()
    assert model.weight.grad is None and model.weight.main_grad.dtype == torch.float32
    expected = 2 * (torch.ones(3, 4).t() @ x.float()).bfloat16().float()   # wgrads rounded, summed in FP32
    assert torch.equal(model.weight.main_grad, expected)
    master0 = opt.master[0].clone()
    opt.step()
    assert opt.master[0].dtype == torch.float32
    assert torch.allclose(opt.master[0], master0 - 1e-3 * model.weight.main_grad, rtol=1e-6, atol=1e-9)
    assert torch.equal(model.weight.data, opt.master[0].bfloat16())
    opt.zero_grad()
    assert model.weight.main_grad.abs().sum() == 0


def test_mixed_precision_perturbed_references_draw_gemm_roundings_not_weights():
    """bf16 and fp8 perturbed references re-draw the final rounding of every GEMM result (forward
    output and input grad): one BF16 ulp, random sign, on ~1/4 of the elements in bf16 (all of
    them in fp8), nothing else."""
    assert Precision("fp32").perturbation() == "weights"
    assert Precision("bf16").perturbation() == Precision("fp8").perturbation() == "gemm"
    assert Precision("bf16").perturbation("weights") == "weights"
    with pytest.raises(ConfigError, match="auto, weights or gemm"):
        Precision("bf16").perturbation("gemms")
    draw = rounding_draws.RoundingDraw(1, rounding_draws.ROUNDING_FLIP["bf16"])
    lin = rounding_draws.perturbed_linear(bf16_linear, draw)
    x = torch.randn(16, 64, generator=G(10)).bfloat16().requires_grad_()
    w = torch.randn(256, 64, generator=G(11)).bfloat16()
    y, y0 = lin(x, w), bf16_linear(x, w)
    nxt = lambda t, d: torch.nextafter(t, torch.tensor(d, dtype=t.dtype))
    one_ulp = lambda a, b: (a == nxt(b, float("inf"))) | (a == nxt(b, -float("inf")))
    assert (one_ulp(y, y0) | (y == y0)).all()
    assert 0.2 < one_ulp(y, y0).float().mean().item() < 0.3          # ROUNDING_FLIP of them
    y.float().sum().backward()
    g0 = (torch.ones(16, 256) @ w.float()).bfloat16()
    assert (one_ulp(x.grad, g0) | (x.grad == g0)).all()
    assert 0.2 < one_ulp(x.grad, g0).float().mean().item() < 0.3
    every = rounding_draws.RoundingDraw(1, rounding_draws.ROUNDING_FLIP["fp8"])
    assert one_ulp(every(y0), y0).all()
