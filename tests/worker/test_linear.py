"""The runner's linear kernels against torch's F.linear: fused projections, oneDNN's prepacked
GEMM and the gated MLP's post-ops give the same numbers as the separate nn.Linear modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridkv.models.layers.activations import activation
from hybridkv.worker.cpu_malloc import keep_buffers_in_heap
from hybridkv.worker.linear import (
    ONEDNN_ACTIVATIONS,
    GatedLinear,
    Linear,
    choose_kernel,
    onednn_supports,
)

KERNELS = ["torch"] + (["onednn"] if onednn_supports(torch.device("cpu"), torch.float32)
                       else [])


def linears(*outs: int, bias: bool, width: int = 48) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(width, n, bias=bias) for n in outs]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_fused_projections_equal_separate_linears(kernel: str, bias: bool,
                                                  tokens: int) -> None:
    parts = linears(64, 32, 32, bias=bias)
    if bias:
        parts[1].bias = None  # a missing bias among present ones is a zero bias
    fused = Linear(parts, kernel)
    x = torch.randn(tokens, 48)
    for got, lin in zip(fused.split(x), parts, strict=True):
        torch.testing.assert_close(got, lin(x), rtol=1e-5, atol=1e-5)
    # A strided input (a row subset, as KV-sharing fast prefill passes) and a 3-D one.
    strided = torch.randn(tokens, 96)[:, ::2]
    torch.testing.assert_close(fused(strided)[:, :64], parts[0](strided), rtol=1e-5,
                               atol=1e-5)
    batched = torch.randn(2, tokens, 48)
    torch.testing.assert_close(fused(batched)[..., 64:96], parts[1](batched), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("act", [*ONEDNN_ACTIVATIONS, "relu2"])
def test_gated_linear_equals_act_gate_times_up(kernel: str, act: str) -> None:
    gate, up = linears(80, 80, bias=act == "gelu")
    fn = activation(act)
    gated = GatedLinear(gate, up, act, fn, kernel)
    # relu2 has no oneDNN post-op: it takes the one-GEMM path whatever the kernel.
    assert (gated.post_op is not None) == (kernel == "onednn" and act != "relu2")
    x = torch.randn(33, 48)
    torch.testing.assert_close(gated(x), fn(gate(x)) * up(x), rtol=1e-5, atol=1e-5)


def test_choose_kernel() -> None:
    assert choose_kernel("torch", "cpu", torch.float32) == "torch"
    assert choose_kernel("auto", "cpu", torch.float16) == "torch"  # no fp16 packing here
    if onednn_supports(torch.device("cpu"), torch.float32):
        assert choose_kernel("auto", "cpu", torch.float32) == "onednn"
    with pytest.raises(ValueError, match="linear_kernel 'onednn' needs a CPU device"):
        choose_kernel("onednn", "meta", torch.float32)
    with pytest.raises(ValueError, match="linear_kernel 'mkl' is not one of auto, onednn"):
        choose_kernel("mkl", "cpu", torch.float32)


def test_cpu_buffers_stay_in_the_heap_on_glibc() -> None:
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert keep_buffers_in_heap()
