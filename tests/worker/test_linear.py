"""The runner's linear kernels against torch's F.linear: fused projections, the C kernel's
panels, oneDNN's prepacked GEMM and the gated MLP's fused activations give the same numbers
as the separate nn.Linear modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridkv.models.layers.activations import activation
from hybridkv.worker import native
from hybridkv.worker.cpu_malloc import keep_buffers_in_heap
from hybridkv.worker.linear import cpu as cpu_linear
from hybridkv.worker.linear.layers import (
    ONEDNN_ACTIVATIONS,
    GatedLinear,
    Linear,
    choose_kernel,
    onednn_supports,
)


def _cpu_kernel_builds() -> bool:
    try:
        cpu_linear.library()
        return True
    except native.NativeBuildError:
        return False


KERNELS = ["torch"] + (["onednn"] if onednn_supports(torch.device("cpu"), torch.float32)
                       else []) + (["cpu"] if _cpu_kernel_builds() else [])


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
@pytest.mark.parametrize("bias", [False, True])
def test_gated_linear_equals_act_gate_times_up(kernel: str, act: str, bias: bool) -> None:
    gate, up = linears(80, 80, bias=bias)
    fn = activation(act)
    gated = GatedLinear(gate, up, act, fn, kernel)
    # Activations a kernel lacks (relu2 everywhere, exact gelu in the C kernel) take the
    # one-GEMM path.
    fused = {"torch": set(), "onednn": set(ONEDNN_ACTIVATIONS),
             "cpu": set(cpu_linear.GATED_ACTIVATIONS)}[kernel]
    assert gated.fused_activation == (act in fused)
    # 40 rows: six-row tiles and a partial one; rows scaled from 0.1 to 30 so both the
    # activations' middle and their tails (large |x|, where a naive exp overflows) are hit.
    x = torch.randn(40, 48) * torch.logspace(-1, 1.5, 40)[:, None]
    torch.testing.assert_close(gated(x), fn(gate(x)) * up(x), rtol=1e-5, atol=1e-4)
    # A 3-D input and no rows at all.
    torch.testing.assert_close(gated(x.view(2, 20, 48)), (fn(gate(x)) * up(x)).view(2, 20, 80),
                               rtol=1e-5, atol=1e-4)
    assert gated(torch.randn(0, 48)).shape == (0, 80)
    # Prefill's row counts (x packed per tile in the C kernel), a partial last tile.
    x = torch.randn(200, 48) * torch.logspace(-1, 1.5, 200)[:, None]
    torch.testing.assert_close(gated(x), fn(gate(x)) * up(x), rtol=1e-5, atol=1e-4)
    # A long input: the C kernel's prefill takes K in blocks, the epilogue after the last.
    gate, up = linears(80, 80, bias=bias, width=1100)
    gated = GatedLinear(gate, up, act, fn, kernel)
    x = torch.randn(150, 1100) * torch.logspace(-1, 1.5, 150)[:, None] / 10
    torch.testing.assert_close(gated(x), fn(gate(x)) * up(x), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif("cpu" not in KERNELS, reason="the C linear kernel does not build here")
@pytest.mark.parametrize("tokens", [1, 5, 6, 16, 97, 200])
@pytest.mark.parametrize("shape", [(130, 37), (64, 64), (1, 300), (200, 2048), (70, 1100)])
def test_cpu_kernel_covers_tiles_panels_and_row_blocks(tokens: int,
                                                       shape: tuple[int, int]) -> None:
    """Every way the C kernel cuts the work: rows per tile (1-6), partial last panels,
    row blocks of 96 (97 rows cross one), x packed per tile from 128 rows (200, a partial
    last tile), odd input widths, long inputs (from 1,024 a prefill takes K in blocks of
    256: 2,048 whole blocks, 1,100 a partial last one), and work large enough to split over
    the threads."""
    n, k = shape
    torch.manual_seed(1)
    lin = nn.Linear(k, n, bias=True)
    packed = Linear([lin], "cpu")
    x = torch.randn(tokens, k)
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
    # Rows of a wider tensor (row stride != k) are read in place.
    wide = torch.randn(tokens, k + 3)[:, :k]
    torch.testing.assert_close(packed(wide), lin(wide), rtol=1e-5, atol=1e-5)


def test_cpu_kernel_refuses_other_dtypes() -> None:
    if "cpu" not in KERNELS:
        pytest.skip("the C linear kernel does not build here")
    packed = Linear([nn.Linear(8, 8)], "cpu")
    with pytest.raises(ValueError, match="takes float32 CPU inputs, not torch.float64"):
        packed(torch.randn(2, 8, dtype=torch.float64))


def test_choose_kernel() -> None:
    assert choose_kernel("torch", "cpu", torch.float32) == "torch"
    assert choose_kernel("auto", "cpu", torch.float16) == "torch"  # no fp16 packing here
    if "cpu" in KERNELS:
        assert choose_kernel("auto", "cpu", torch.float32) == "cpu"
    if onednn_supports(torch.device("cpu"), torch.bfloat16):
        assert choose_kernel("auto", "cpu", torch.bfloat16) == "onednn"
    assert choose_kernel("auto", "meta", torch.float32) == "torch"
    with pytest.raises(ValueError, match="linear_kernel 'onednn' needs a CPU device"):
        choose_kernel("onednn", "meta", torch.float32)
    with pytest.raises(ValueError, match="linear_kernel 'cpu' needs a CPU device and "
                                         "float32; got cpu, torch.bfloat16"):
        choose_kernel("cpu", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="linear_kernel 'mkl' is not one of auto, cpu, "
                                         "onednn, torch"):
        choose_kernel("mkl", "cpu", torch.float32)


def test_auto_falls_back_when_the_c_kernel_cannot_build(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    def no_compiler() -> None:
        raise native.NativeBuildError("no C compiler found (set CC, or install gcc)")

    monkeypatch.setattr(cpu_linear, "library", no_compiler)
    expected = "onednn" if onednn_supports(torch.device("cpu"), torch.float32) else "torch"
    assert choose_kernel("auto", "cpu", torch.float32) == expected
    with pytest.raises(ValueError, match="linear_kernel 'cpu' cannot be built here"):
        choose_kernel("cpu", "cpu", torch.float32)


def test_cpu_buffers_stay_in_the_heap_on_glibc() -> None:
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert keep_buffers_in_heap()
